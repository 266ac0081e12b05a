"""The inference engine under a burst of concurrent requests, beside plain transformers `generate`.

    .venv/bin/python bench/inference.py [--requests 50] [--adapters 4] [--max-tokens 32] [--max-waiting 32]

Builds the demo model and `--adapters` LoRA adapters (rank 8 on every linear, random weights) in a temp
dir, starts `python -m inference.server` on them, registers the adapters with /v1/load_lora_adapter and
warms each model once (first loads are not timed). Then `--requests` chat completions are sent at once,
spread over the base and the adapters, each generating exactly `--max-tokens` tokens (greedy, vLLM's
ignore_eos), so every request is the same work. Beyond the engine's `--max-waiting` a request is refused
with 429 (counted, not retried); the engine runs with `--timeout-seconds` (default 600 here, so a queued
request on a slow machine is answered rather than timed out). Latency is from send to answer.
Then the same requests run one after another through plain `generate` in this process, the engine
stopped: the base model for the base's, a peft model of its own for each adapter's (min_new_tokens =
max_new_tokens: the same number of tokens).
Prints what it measured; exits 1 if a request was lost or answered 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
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


def prompts(n: int) -> list[str]:
    lines = (REPO / "training" / "demo_corpus.txt").read_text().splitlines()
    return [lines[(2 * i) % len(lines)] for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_engine(
    models_dir: Path, tmp: Path, max_waiting: int, timeout: float
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FTUNE_MODELS_DIR": str(models_dir), "FTUNE_HF_CACHE_DIR": str(tmp / "no-hf")}
    cmd = [sys.executable, "-m", "inference.server", "--port", str(port)]
    cmd += ["--max-waiting", str(max_waiting), "--timeout-seconds", str(timeout)]
    log = (tmp / "engine.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit((tmp / "engine.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the engine did not start")


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.monotonic()
    try:
        r = await client.post(f"{url}/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        return {"status": "lost", "error": repr(e)}
    out = {"status": r.status_code, "seconds": time.monotonic() - started}
    if r.status_code == 200:
        out["tokens"] = r.json()["usage"]["completion_tokens"]
    else:
        out["code"] = r.json()["error"]["code"]
    return out


async def burst(url: str, jobs: list[tuple[str, str]], max_tokens: int) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(jobs))) as client:
        started = time.monotonic()
        results = await asyncio.gather(*(one_request(client, url, m, p, max_tokens) for m, p in jobs))
        return list(results), time.monotonic() - started


def plain_generate(
    model_dir: Path, adapters: dict[str, Path], jobs: list[tuple[str, str]], max_tokens: int
) -> tuple[list[float], int, float]:
    """The same requests through transformers' generate, one after another: the base model for the base's,
    a peft model (PeftModel.from_pretrained on its own copy of the base) for each adapter's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from training.model import load_tokenizer

    def base():
        return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)

    tokenizer = load_tokenizer(model_dir)
    models = {BASE: base().eval()}
    models |= {name: PeftModel.from_pretrained(base(), path).eval() for name, path in adapters.items()}
    latencies, tokens = [], 0
    started = time.monotonic()
    for name, prompt in jobs:
        t0 = time.monotonic()
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.inference_mode():
            out = models[name].generate(
                **ids,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        tokens += out.shape[1] - ids["input_ids"].shape[1]
        latencies.append(time.monotonic() - t0)
    return latencies, tokens, time.monotonic() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=32)
    p.add_argument("--timeout-seconds", type=float, default=600)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ftune-bench-inference-"))
    model_dir = build_demo_model(tmp / "models")
    names = [f"ft:{BASE}:bench::a{i}" for i in range(args.adapters)]
    dirs = [save_random_adapter(model_dir, tmp / f"a{i}", i, 8, TARGETS) for i in range(args.adapters)]
    models = [BASE, *names]
    jobs = [(models[i % len(models)], text) for i, text in enumerate(prompts(args.requests))]

    proc, url = start_engine(tmp / "models", tmp, args.max_waiting, args.timeout_seconds)
    try:
        for name, d in zip(names, dirs, strict=True):
            r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(d)})
            r.raise_for_status()
        for m in models:  # warm-up: base and adapters loaded before timing
            asyncio.run(burst(url, [(m, "warm up")], 4))
        results, wall = asyncio.run(burst(url, jobs, args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429 and r["code"] == "engine_overloaded"]
    lost = [r for r in results if r["status"] == "lost"]
    server_errors = [r for r in results if isinstance(r["status"], int) and r["status"] >= 500]
    other = [r for r in results if r not in ok + refused + lost + server_errors]
    engine_tokens = sum(r["tokens"] for r in ok)
    latencies = [r["seconds"] for r in ok]

    plain_lat, plain_tokens, plain_wall = plain_generate(
        model_dir, dict(zip(names, dirs, strict=True)), jobs, args.max_tokens
    )

    print(
        f"\n{args.requests} chat completions sent at once over {BASE} and {args.adapters} LoRA adapters "
        f"(r=8, all linears), {args.max_tokens} tokens each, greedy; engine --max-waiting "
        f"{args.max_waiting}; {os.cpu_count()} CPU cores"
    )
    cols = ["answered", "429", "5xx", "lost", "p50 s", "p95 s", "tokens/s"]
    print(f"{'':44}" + "".join(f"{c:>9}" for c in cols))
    engine_row = [len(ok), len(refused), len(server_errors), len(lost)]
    engine_row += [f"{statistics.median(latencies):.2f}", f"{percentile(latencies, 0.95):.2f}"]
    engine_row += [f"{engine_tokens / wall:.1f}"]
    print(f"{'engine (HTTP, 1 generation thread)':44}" + "".join(f"{c:>9}" for c in engine_row))
    plain_row = [len(plain_lat), "-", "-", "-", f"{statistics.median(plain_lat):.2f}"]
    plain_row += [f"{percentile(plain_lat, 0.95):.2f}", f"{plain_tokens / plain_wall:.1f}"]
    print(f"{'plain generate (peft per adapter), in turn':44}" + "".join(f"{c:>9}" for c in plain_row))
    print(
        f"engine: {engine_tokens} tokens in {wall:.2f} s wall (latency includes the wait in line); "
        f"plain: {plain_tokens} tokens in {plain_wall:.2f} s (latency: one generate alone)"
    )
    if other:
        print(f"other answers: {[(r['status'], r.get('code')) for r in other]}")
    return 1 if lost or server_errors or other else 0


if __name__ == "__main__":
    raise SystemExit(main())
