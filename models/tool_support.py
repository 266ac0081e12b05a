"""Whether a base model's chat template renders tools: asked at admission of a job whose data define or
call tools, so that a model that would train them on calls to tools it was never shown is refused then,
naming the model, rather than when training starts.

The answer is training.chat_template's probe (the model's own template through transformers' `tools=`),
asked of `python -m training.template_check` in a child process as token statistics are
(models.token_stats: the API imports no torch), under the same memory limit. It is kept for the
process's life per model directory and version of its tokenizer files, so a model is probed once (a few
seconds), and concurrent admissions wait for that one probe. A probe that times out or crashes decides
nothing: the job is admitted, and training says what is wrong.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from functools import lru_cache
from pathlib import Path

from core.process import child_env
from core.settings import Settings
from models.admission import ToolsCheck
from models.token_stats import limited_command

log = logging.getLogger(__name__)

PROBE_SECONDS = 60.0
# The files a chat template is read from: a change to any of them is a new template.
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json", "tokenizer.json")


def _stamp(model_dir: Path) -> tuple[int, ...]:
    return tuple(p.stat().st_mtime_ns if p.is_file() else 0 for p in (model_dir / n for n in TEMPLATE_FILES))


@lru_cache(maxsize=4)
def tools_check(timeout_seconds: float = PROBE_SECONDS, memory_bytes: int = 0) -> ToolsCheck:
    """The process's check (one per bound, so its answers are kept across requests)."""
    answers: dict[tuple[str, tuple[int, ...]], str | None] = {}
    lock = threading.Lock()

    def check(model_dir: Path) -> str | None:
        key = (str(model_dir), _stamp(model_dir))
        with lock:  # held through the probe: concurrent admissions for a new model wait for one probe
            if key not in answers:
                decided, problem = _probe(model_dir, timeout_seconds, memory_bytes)
                if not decided:
                    return None
                answers[key] = problem
            return answers[key]

    return check


def from_settings(settings: Settings) -> ToolsCheck:
    return tools_check(PROBE_SECONDS, settings.admission_measure_max_memory_bytes)


def _probe(model_dir: Path, timeout_seconds: float, memory_bytes: int) -> tuple[bool, str | None]:
    """(decided, problem) from `python -m training.template_check` (see its doc)."""
    # For its module name only, imported when a probe runs: importing the API loads nothing of training.
    from training import template_check

    cmd = limited_command(
        ["-m", template_check.__name__, "--model-dir", str(model_dir)], memory_bytes=memory_bytes
    )
    env = child_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_seconds, env=env)
    except subprocess.TimeoutExpired:
        log.warning(
            "the chat template probe of %s took over %g s; admitting undecided", model_dir, timeout_seconds
        )
        return False, None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        log.warning(
            "the chat template probe of %s exited %d\n%s", model_dir, done.returncode, done.stderr[-4000:]
        )
        return False, None
    if isinstance(answer.get("error"), dict):
        return True, "cannot be read: the model's tokenizer does not load"
    return True, None if answer.get("tools") else str(answer.get("problem") or "does not render tools")
