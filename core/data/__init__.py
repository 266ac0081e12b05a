"""Datasets: streaming validation at upload (validate), the accepted formats (examples), per-line checks
(line_checks; a row's conversation, tools and content parts: conversation, tools, parts), a row's
messages as the trainer reads them (messages), running summaries (stats) and the token statistics of a
job's data (token_stats)."""
