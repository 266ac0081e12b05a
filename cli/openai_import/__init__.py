"""`ftune import-openai`: copy a user's fine-tuning files and job definitions from an OpenAI-compatible
endpoint into ftune, through the official `openai` SDK on both sides.

options   the command's flags, and the `--model SOURCE=LOCAL` mapping
endpoints the two clients (keys from the environment, never stored) and the Idempotency-Keys
files     files by id with their purpose: streamed down to a temporary file, uploaded once
jobs      job definitions (method, hyperparameters, suffix, seed, files) mapped onto a local base model
memory    ftune's memory plan of a mapped job (POST /plan), for --dry-run
report    progress lines as it goes, and the end report: moved, already there, not moved and why
command   the run: files, then jobs

A rerun is a no-op for what was copied, even with no local state: each create carries an Idempotency-Key
made from the source's address and the source id (ftune replays the first answer), and each job carries
`metadata.imported_from` (the source job id), which the destination lists.
"""
