"""Throughput and memory of streaming dataset validation (core/data/validate.py) on a generated JSONL file.

    .venv/bin/python bench/data_throughput.py [--mb 200] [--format chat] [--chunk-kb 1024] [--runs 3]
        [--non-ascii 0.2] [--no-http]

`--format shortest` writes lines like {"text": "1f"}: millions of examples per 100 MB, the worst case
for what validation keeps per example (the duplicate count: 8 bytes each, spilled to disk past 4M).

Generates the file into a temp dir (streamed, so generation itself stays small), then validates it in
fresh child processes, so that each child's peak RSS measures validation alone. Other work on the machine
slows single runs down, so it prints the best and the median of --runs.

Then (unless --no-http) the same file goes once through the real upload path: `ftune api` (uvicorn, SQLite)
in its own process, the file streamed as a raw ndjson body; it prints MB/s end to end (receive, write to
disk, validate, store) and the server's peak RSS growth over what it held before the upload.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL_MB_S = 50.0
GOAL_RSS_MB = 200.0
PROSE = (
    "the model learns from examples of questions and answers written by people who know the task well "
    "a dataset should be varied clean and honest about what it contains train evaluate repeat "
    "gradient memory adapter rank layer token batch step loss value result because however therefore "
    "if you want to check it then run it again, and look at the numbers. Why? It's faster! (really)"
)
WORDS = PROSE.split()
# Non-ASCII costs more to decode and parse; a share of the turns carry some.
ACCENTS = "café naïve über straße 東京 데이터 données modèle — “quoted” ✓ 😀"
NON_ASCII = ACCENTS.split()
SYSTEM = "You are a concise, helpful assistant."


def _paragraph(rng: random.Random, non_ascii: float) -> str:
    # Log-normal lengths: mostly short turns, a long tail of multi-paragraph ones (median ~60 words).
    n = max(1, min(3000, int(rng.lognormvariate(4.1, 1.0))))
    words = rng.choices(WORDS, k=n)
    if rng.random() < non_ascii:
        words[rng.randrange(n)] = rng.choice(NON_ASCII)
    return " ".join(words)


def _example(rng: random.Random, fmt: str, i: int, non_ascii: float) -> dict[str, Any]:
    # The index keeps examples distinct, so the duplicate set grows as it would on real data.
    def para() -> str:
        return _paragraph(rng, non_ascii)

    if fmt == "chat":
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            messages.append({"role": "user", "content": f"#{i} {para()}"})
            messages.append({"role": "assistant", "content": para()})
        return {"messages": messages}
    if fmt == "instruction":
        return {"instruction": f"#{i} {para()}", "input": "", "output": para()}
    if fmt == "shortest":  # the most examples per MB: the worst case for per-example memory and time
        return {"text": f"{i:x}"}
    if fmt == "prompt_completion":
        return {"prompt": f"#{i} {para()}", "completion": para()}
    return {"text": f"#{i} {para()}"}


def generate(path: Path, size_mb: int, fmt: str, non_ascii: float) -> int:
    rng = random.Random(1234)
    target = size_mb * 1_000_000
    written = lines = 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            line = json.dumps(_example(rng, fmt, lines, non_ascii), ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode())
            lines += 1
    return lines


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(path: Path, chunk_kb: int) -> None:
    """Validate in this (fresh) process; print seconds, RSS growth and the report as JSON."""
    from core.data.validate import DatasetValidator

    # As the API does it: the duplicate count may spill to a directory beside the data.
    validator = DatasetValidator(
        max_line_bytes=1 << 20, min_examples=1, max_problems=50, spill_dir=path.parent
    )
    before = _peak_rss_mb()
    start = time.perf_counter()
    with path.open("rb") as f:
        while chunk := f.read(chunk_kb * 1024):
            validator.feed(chunk)
    report = validator.finish()
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "rss_growth_mb": _peak_rss_mb() - before, "report": report.model_dump()}
    print(json.dumps(result))


def _run_child(path: Path, chunk_kb: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(path), "--chunk-kb", str(chunk_kb)]
    return dict(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))


def _peak_rss_of_mb(pid: int) -> float:
    """A process's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def _file_chunks(path: Path, chunk_kb: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(chunk_kb * 1024):
            yield chunk


def upload_over_http(path: Path, tmp: Path, chunk_kb: int) -> dict[str, float]:
    """Stream `path` to a real `ftune api` process; seconds and the server's peak RSS growth."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "ftk_0123456789ab_" + "b" * 32
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTUNE_")}
    env |= {"FTUNE_DATA_DIR": str(tmp / "data"), "FTUNE_MODELS_DIR": str(tmp / "models")}
    env |= {"FTUNE_BOOTSTRAP_ADMIN_KEY": key, "FTUNE_MAX_UPLOAD_BYTES": str(path.stat().st_size + 1)}
    repo = Path(__file__).resolve().parent.parent
    subprocess.run(
        [sys.executable, "-m", "cli", "migrate"], env=env, cwd=repo, check=True, capture_output=True
    )
    log = (tmp / "api.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "cli", "api", "--port", str(port)], env=env, cwd=repo, stdout=log, stderr=log
    )
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/x-ndjson"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            for _ in range(300):
                if server.poll() is not None:
                    raise RuntimeError("ftune api exited:\n" + (tmp / "api.log").read_text()[-3000:])
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            # A small upload first, so the baseline holds what any upload loads (routes, validator, DB).
            with path.open("rb") as f:
                first_lines = f.read(100_000).rsplit(b"\n", 1)[0]
            warm = client.post("/datasets", content=first_lines, headers=headers)
            assert warm.status_code == 201, warm.text
            before = _peak_rss_of_mb(server.pid)
            start = time.perf_counter()
            r = client.post("/datasets", content=_file_chunks(path, chunk_kb), headers=headers)
            seconds = time.perf_counter() - start
            assert r.status_code == 201, r.text
            assert r.json()["size_bytes"] == path.stat().st_size
            return {"seconds": seconds, "rss_growth_mb": _peak_rss_of_mb(server.pid) - before}
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument(
        "--format", default="chat", choices=("chat", "instruction", "prompt_completion", "text", "shortest")
    )
    ap.add_argument("--chunk-kb", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--non-ascii", type=float, default=0.2, help="share of turns with a non-ASCII word")
    ap.add_argument("--no-http", action="store_true", help="skip the upload through a real API process")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.chunk_kb)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.jsonl"
        t0 = time.perf_counter()
        lines = generate(path, args.mb, args.format, args.non_ascii)
        size = path.stat().st_size
        print(
            f"generated {size / 1e6:.1f} MB, {lines} {args.format} lines in {time.perf_counter() - t0:.1f} s"
        )
        runs = [_run_child(path, args.chunk_kb) for _ in range(args.runs)]
        http = None if args.no_http else upload_over_http(path, Path(tmp), args.chunk_kb)
    report = runs[0]["report"]
    assert report["valid"], report["problems"]
    speeds = sorted(size / 1e6 / r["seconds"] for r in runs)
    rss = max(r["rss_growth_mb"] for r in runs)
    best, median = speeds[-1], statistics.median(speeds)
    print(f"validated {report['num_examples']} examples, {args.runs} runs, chunks of {args.chunk_kb} KiB")
    print(f"{'metric':<30}{'measured':>10}{'goal':>10}  ok")
    print(f"{'throughput MB/s (best)':<30}{best:>10.1f}{'>= 50':>10}  {best >= GOAL_MB_S}")
    print(f"{'throughput MB/s (median)':<30}{median:>10.1f}{'>= 50':>10}  {median >= GOAL_MB_S}")
    print(f"{'peak RSS growth MB (worst)':<30}{rss:>10.1f}{'< 200':>10}  {rss < GOAL_RSS_MB}")
    if http:
        speed, growth = size / 1e6 / http["seconds"], http["rss_growth_mb"]
        print(f"{'upload over HTTP MB/s':<30}{speed:>10.1f}{'>= 50':>10}  {speed >= GOAL_MB_S}")
        print(f"{'upload server RSS growth MB':<30}{growth:>10.1f}{'< 200':>10}  {growth < GOAL_RSS_MB}")
    print(f"stats: {json.dumps(report['stats'])}")


if __name__ == "__main__":
    main()
