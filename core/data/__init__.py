"""Datasets: streaming validation at upload (validate), the accepted formats (examples), per-line checks
(line_checks), running summaries (stats) and the token statistics of a job's data (token_stats)."""
