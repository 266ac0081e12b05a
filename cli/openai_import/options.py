"""The flags of `ftune import-openai` (argparse only: cli.main imports this when it builds its parser)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

OPENAI_BASE_URL = "https://api.openai.com/v1"
SOURCE_KEY_ENV = "OPENAI_API_KEY"
DEST_KEY_ENV = "FTUNE_KEY"


@dataclass(frozen=True)
class Options:
    from_base_url: str
    from_key_env: str
    to_base_url: str | None  # None: this machine's ftune (FTUNE_API_HOST, FTUNE_API_PORT)
    to_key_env: str
    models: dict[str, str]  # source model -> local base model
    dry_run: bool = False
    gpu: str | None = None  # --dry-run plans on it; None: the destination's fleet
    include_failed: bool = False
    paused: bool = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from-base-url",
        default=OPENAI_BASE_URL,
        help=f"the source's OpenAI-compatible API (default {OPENAI_BASE_URL}); another ftune's /v1 works too",
    )
    p.add_argument(
        "--from-key-env",
        default=SOURCE_KEY_ENV,
        metavar="NAME",
        help=f"the environment variable holding the source's API key (default {SOURCE_KEY_ENV}); "
        "the key is never stored",
    )
    p.add_argument("--to-base-url", help="ftune's /v1 (default: this machine's, FTUNE_API_HOST/PORT)")
    p.add_argument(
        "--to-key-env",
        default=DEST_KEY_ENV,
        metavar="NAME",
        help=f"the environment variable holding ftune's API key (default {DEST_KEY_ENV}; "
        "else the local admin key that `ftune up` keeps in the data directory)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="SOURCE=LOCAL",
        help="train jobs of base SOURCE on the local base model LOCAL (repeat for each base); a job whose "
        "base has no mapping is not moved",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, with each job's memory plan")
    p.add_argument("--gpu", help="--dry-run: plan memory on this GPU (A100-80GB, 24GB); default the fleet")
    p.add_argument(
        "--include-failed",
        action="store_true",
        help="also copy the definitions of failed and cancelled jobs (by default they are reported)",
    )
    p.add_argument(
        "--paused",
        action="store_true",
        help="pause each new job at once (POST .../pause), to resume the ones you want trained",
    )


def parse_models(pairs: list[str]) -> dict[str, str]:
    """`["gpt-4o-mini-2024-07-18=ftune-demo", ...]` as a dict; a malformed pair raises ValueError."""
    out: dict[str, str] = {}
    for pair in pairs:
        source, sep, local = pair.partition("=")
        if not sep or not source.strip() or not local.strip():
            raise ValueError(f"--model {pair!r}: SOURCE=LOCAL, as in gpt-4o-mini-2024-07-18=ftune-demo")
        if out.get(source.strip(), local.strip()) != local.strip():
            raise ValueError(f"--model {source.strip()!r} is mapped twice")
        out[source.strip()] = local.strip()
    return out


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        from_base_url=args.from_base_url,
        from_key_env=args.from_key_env,
        to_base_url=args.to_base_url,
        to_key_env=args.to_key_env,
        models=parse_models(args.model),
        dry_run=args.dry_run,
        gpu=args.gpu,
        include_failed=args.include_failed,
        paused=args.paused,
    )
