"""The inference engine under 1, 4 and 16 concurrent clients: batched (continuous batching) beside the
engine before batching (`--sequential`: one request at a time, start to end), in one run.

    .venv/bin/python bench/inference.py [--clients 1,4,16] [--adapters 3] [--max-tokens 32]
                                        [--requests-per-client 2] [--min-requests 16] [--lone-requests 16]
                                        [--engine-threads N] [--modes sequential,batched,json]

`--modes ...,json` adds the batched engine with every answer held to a JSON schema (structured outputs'
grammar, llguidance): its tokens/s beside the free batched engine's, and the grammar's cost per token.

Builds the demo model and `--adapters` LoRA adapters (rank 8 on every linear, random weights) in a temp
dir, starts one `python -m inference.server` per mode on them (both up, the one not measured idle),
registers the adapters with /v1/load_lora_adapter and warms each model once (first loads are not timed).
First `--lone-requests` lone requests go to each engine in turn (alternating, so both see the same load of
the machine): the lone request's latency. Then, for each client count C and each mode in turn, C clients
each send chat completions one after another (closed loop) until `max(C x
--requests-per-client, --min-requests)` are answered, the requests cycling over the base and the adapters
(so a batch mixes adapters), each generating exactly `--max-tokens` tokens (greedy, vLLM's ignore_eos).
Aggregate tokens/s = the tokens answered / the level's wall clock; latency is from send to answer.
Prints the table and the goals (16 clients >= 4x the tokens/s of 1 client; a lone request no slower than
the sequential engine's); exits 1 if a request failed. The machine's load average is printed beside: on a
shared machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.inference.conftest import save_random_adapter  # noqa: E402
from training.demo import build_demo_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE = "ftune-demo"
MODES = {"sequential": ["--sequential"], "batched": []}
# "json": the batched engine with every request's answer held to a JSON schema by its grammar (llguidance):
# a string that cannot end within max_tokens, so both modes generate the same tokens' worth and the
# difference is the grammar's cost per token
JSON = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "bench",
            "schema": {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": 4096}},
                "required": ["text"],
            },
        },
    }
}


def prompts() -> list[str]:
    lines = (REPO / "training" / "demo_corpus.txt").read_text().splitlines()
    return [line for line in lines if line.strip()][:64]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_engine(
    models_dir: Path, tmp: Path, extra: list[str], threads: int | None
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FTUNE_MODELS_DIR": str(models_dir), "FTUNE_HF_CACHE_DIR": str(tmp / "no-hf")}
    env.pop("FTUNE_INFERENCE_API_KEY", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "inference.server", "--port", str(port), "--max-waiting", "256"]
    cmd += ["--insecure-no-key"]  # on 127.0.0.1, for this run alone
    cmd += ["--timeout-seconds", "600", "--generation-seconds", "600", *extra]
    log = (tmp / f"engine-{port}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit((tmp / f"engine-{port}.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the engine did not start")


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **(extra or {}),
    }
    started = time.monotonic()
    try:
        r = await client.post(f"{url}/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e)}
    if r.status_code != 200:
        return {"ok": False, "error": f"{r.status_code} {r.text[:200]}"}
    return {
        "ok": True,
        "seconds": time.monotonic() - started,
        "tokens": r.json()["usage"]["completion_tokens"],
    }


async def level(
    url: str, models: list[str], clients: int, total: int, max_tokens: int, extra: dict | None = None
) -> dict:
    """`clients` closed-loop clients answering `total` requests together (`extra`: more body fields)."""
    texts = prompts()
    numbers = itertools.count()
    results: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while (i := next(numbers)) < total:
            results.append(
                await one_request(
                    client, url, models[i % len(models)], texts[i % len(texts)], max_tokens, extra
                )
            )

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        started = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.monotonic() - started
    ok = [r for r in results if r["ok"]]
    latencies = [r["seconds"] for r in ok]
    return {
        "clients": clients,
        "answered": len(ok),
        "failed": [r["error"] for r in results if not r["ok"]],
        "tokens": sum(r["tokens"] for r in ok),
        "wall": wall,
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "p50": statistics.median(latencies) if latencies else float("nan"),
        "p95": percentile(latencies, 0.95) if latencies else float("nan"),
    }


def ready_engine(mode: str, model_dir: Path, tmp: Path, names: list[str], dirs: list[Path], threads) -> tuple:
    """An engine in this mode with the adapters registered and every model loaded once (not timed)."""
    proc, url = start_engine(model_dir.parent, tmp, MODES[mode], threads)
    for name, d in zip(names, dirs, strict=True):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(d)})
        r.raise_for_status()
    models = [BASE, *names]
    asyncio.run(level(url, models, len(models), len(models), 4))
    return proc, url


def lone(urls: dict[str, str], models: list[str], count: int, max_tokens: int) -> dict[str, list[float]]:
    """`count` lone requests to each engine, alternating (so both see the same machine load)."""
    texts = prompts()
    seconds: dict[str, list[float]] = {mode: [] for mode in urls}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(count):
                for mode, url in urls.items():
                    r = await one_request(
                        client, url, models[i % len(models)], texts[i % len(texts)], max_tokens
                    )
                    if r["ok"]:
                        seconds[mode].append(r["seconds"])

    asyncio.run(run())
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4, 16])
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--engine-threads", type=int, default=None, help="OMP_NUM_THREADS of the engine")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["sequential", "batched"])
    p.add_argument("--lone-requests", type=int, default=16, help="lone requests per engine, alternating")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ftune-bench-inference-"))
    model_dir = build_demo_model(tmp / "models")
    names = [f"ft:{BASE}:bench::a{i}" for i in range(args.adapters)]
    dirs = [save_random_adapter(model_dir, tmp / f"a{i}", i, 8, TARGETS) for i in range(args.adapters)]
    load_before = os.getloadavg()[0]
    models = [BASE, *names]
    engines = {
        mode: ready_engine(mode, model_dir, tmp, names, dirs, args.engine_threads)
        for mode in args.modes
        if mode in MODES
    }
    urls = {mode: url for mode, (_, url) in engines.items()}
    if "json" in args.modes:
        urls["json"] = urls["batched"]
    rows = []
    try:
        engine_urls = {mode: url for mode, url in urls.items() if mode in MODES}
        alone = lone(engine_urls, models, args.lone_requests, args.max_tokens)
        for clients in args.clients:  # the modes one after the other at each level
            total = max(clients * args.requests_per_client, args.min_requests)
            for mode, url in urls.items():
                extra = JSON if mode == "json" else None
                measured = asyncio.run(level(url, models, clients, total, args.max_tokens, extra))
                rows.append({"mode": mode, **measured})
                print(
                    f"  {mode:10} {clients:>3} clients: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True
                )
    finally:
        for proc, _ in engines.values():
            proc.terminate()
            proc.wait(timeout=30)
    load_after = os.getloadavg()[0]

    threads = args.engine_threads or "default"
    print(
        f"\n{BASE} and {args.adapters} LoRA adapters (r=8, all linears) in turn, {args.max_tokens} tokens "
        f"per request, greedy; closed-loop clients; {os.cpu_count()} CPU cores, engine threads {threads}, "
        f"load average {load_before:.1f} -> {load_after:.1f}"
    )
    cols = ["clients", "requests", "tokens/s", "p50 s", "p95 s", "x 1 client"]
    print(f"{'engine':12}" + "".join(f"{c:>11}" for c in cols))
    one = {r["mode"]: r["tokens_per_s"] for r in rows if r["clients"] == min(args.clients)}
    for r in sorted(rows, key=lambda r: (args.modes.index(r["mode"]), r["clients"])):
        cells = [
            r["clients"],
            r["answered"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['p50']:.2f}",
            f"{r['p95']:.2f}",
        ]
        cells.append(f"{r['tokens_per_s'] / one[r['mode']]:.2f}")
        print(f"{r['mode']:12}" + "".join(f"{c:>11}" for c in cells))
    by = {(r["mode"], r["clients"]): r for r in rows}
    if ("batched", 16) in by and ("batched", 1) in by:
        gain = by["batched", 16]["tokens_per_s"] / by["batched", 1]["tokens_per_s"]
        print(f"batched, 16 clients vs 1: {gain:.2f}x aggregate tokens/s (goal >= 4x)")
    if alone.get("batched") and alone.get("sequential"):
        b, s = statistics.median(alone["batched"]), statistics.median(alone["sequential"])
        print(
            f"a lone request ({args.lone_requests} per engine, alternating), p50: batched {b:.3f} s vs "
            f"sequential {s:.3f} s (goal: no slower)"
        )
    for clients in args.clients:
        if ("json", clients) in by and ("batched", clients) in by:
            free, held = by["batched", clients], by["json", clients]
            extra_ms = 1e3 * (held["wall"] / held["tokens"] - free["wall"] / free["tokens"])
            print(
                f"json_schema grammar, {clients} clients: {held['tokens_per_s']:.1f} tokens/s vs "
                f"{free['tokens_per_s']:.1f} free ({extra_ms:+.3f} ms a token of the batch's wall clock)"
            )
    failed = [e for r in rows for e in r["failed"]]
    if failed:
        print(f"failed requests: {failed[:5]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
