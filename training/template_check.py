"""`python -m training.template_check --model-dir DIR`: whether a base model's chat template renders tools
(training.chat_template.tools_problem on the template rows with tools are rendered with), asked by
admission in a child process (models.tool_support) so that the API never imports torch.

Prints {"tools": true} or {"tools": false, "problem": "..."} on stdout and exits 0; exits 1, printing
{"error": {"code": "tokenizer_error", ...}}, when the tokenizer cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from training.chat_template import PROBE_TOOLS, template_for, tools_problem


def model_problem(model_dir: str) -> str | None:
    """tools_problem of the template a model's rows with tools are rendered with (training.data)."""
    from training.model import load_tokenizer  # here: importing this module for its name loads no torch

    tokenizer = load_tokenizer(Path(model_dir))
    template = template_for(tokenizer, PROBE_TOOLS)
    return tools_problem(tokenizer, template)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.template_check", description=__doc__)
    parser.add_argument("--model-dir", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        problem = model_problem(args.model_dir)
    except (OSError, ValueError) as e:
        # Not the exception text: it names this server's paths.
        print(json.dumps({"error": {"code": "tokenizer_error", "message": type(e).__name__}}))
        return 1
    print(json.dumps({"tools": problem is None, **({"problem": problem} if problem else {})}))
    return 0


if __name__ == "__main__":
    from core.process import stop_with_worker

    stop_with_worker()  # ends with the API or worker that asked, never outlives it
    sys.exit(main())
