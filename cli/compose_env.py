"""docker-compose's secrets, made once: `.env` beside docker-compose.yml, which docker compose reads.

  make compose-env          (python3 -m cli.compose_env [PATH]: the standard library only, no venv needed)

Each secret the compose file requires gets a random value unless `.env` already has one: a rerun never
changes a value (PostgreSQL keeps the password its volume was first made with). The file is written with
mode 600 and is left out of git and of the image (.gitignore, .dockerignore).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every ${NAME:?...} of docker-compose.yml (tests/test_layout.py checks the two lists agree).
SECRETS = ("POSTGRES_PASSWORD", "REDIS_PASSWORD", "FTUNE_INFERENCE_API_KEY")


def ensure_env(path: Path) -> list[str]:
    """Give each secret that `path` lacks (or has empty) a random value, keeping every other line;
    returns the names given a value. Hex values: safe inside the database and broker URLs."""
    lines = path.read_text().splitlines() if path.exists() else []
    have: dict[str, tuple[int, str]] = {}  # name -> its line, its value
    for i, line in enumerate(lines):
        name, eq, value = line.partition("=")
        if eq and not line.lstrip().startswith("#"):
            have[name.strip()] = (i, value.strip())
    added: list[str] = []
    for name in SECRETS:
        if have.get(name, (None, ""))[1]:
            continue
        line = f"{name}={secrets.token_hex(32)}"
        if name in have:
            lines[have[name][0]] = line
        else:
            lines.append(line)
        added.append(name)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a .tmp left by an earlier run keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
    return added


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else REPO / ".env"
    added = ensure_env(path)
    kept = [name for name in SECRETS if name not in added]
    print(f"{path}: made {', '.join(added) or 'nothing'}; kept {', '.join(kept) or 'nothing'} (mode 600)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
