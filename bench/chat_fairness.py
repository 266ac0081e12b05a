"""Chat at the defaults through the API: one tenant's 16 clients beside its 1, and tenant B's latency alone
beside tenant A's 32 clients (the fair chat queue, api/chat_queue.py, in front of the batching engine).

    .venv/bin/python bench/chat_fairness.py [--max-tokens 32] [--requests 128] [--b-requests 24]
                                            [--rounds 3] [--pause 3] [--setting FTUNE_CHAT_X=value ...]

Builds the demo model (`ftune models build-demo`) in a temp dir, starts ftune's inference engine on it
(`python -m inference.server`, its defaults) and `ftune api` in front of it (SQLite; every chat setting at
its default unless --setting; ignore_eos allowed so each request generates exactly --max-tokens tokens,
greedy), and warms the model. Each run uses a tenant of its own (its own rate bucket), its clients
closed-loop (each sends its next request when its answer comes), and is followed by --pause seconds, longer
than the queue's linger, so no tenant of a run still counts as active in the next:
  - 1 client (--requests / 2 requests), then 16 clients (--requests): aggregate tokens/s (tokens answered /
    wall clock), and whether all were 200. Goal: 16 clients >= 4x one client's tokens/s, all 200.
  - tenant B, one client, --b-requests requests alone; then the same while tenant A's 32 clients loop
    (B starts once A's have been running 1 s): B's p50 latency (send to answer). Goal: beside <= 2x alone.
  - the 1- and 16-client runs straight to the engine (no API): the baseline, what the API's hop costs.
Every run is repeated in --rounds rounds (runs interleaved, so each sees the machine's load alike); the
table holds each figure's median, the goals the median of the rounds' ratios, each round's beside them.
The machine's load average is printed too: on a shared machine the numbers move with it. Exits 1 when a
goal is missed or a request of the 1-client, 16-client or B's runs is not 200.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.chat_engine import ENGINE_KEY, Answer, ChatAPI, chat, chat_api, engine_process  # noqa: E402
from tests.e2e.stack import env_for  # noqa: E402


def prompts() -> list[str]:
    lines = (REPO / "training" / "demo_corpus.txt").read_text().splitlines()
    return [line for line in lines if line.strip()][:64]


async def closed_loop(api: ChatAPI, key: str, clients: int, total: int, max_tokens: int) -> dict:
    """`clients` clients of one tenant answering `total` requests together."""
    texts, answers, sent = prompts(), [], [0]

    async def client_loop(client: httpx.AsyncClient) -> None:
        while sent[0] < total:
            sent[0] += 1
            answers.append(await chat(client, api, key, max_tokens, texts[sent[0] % len(texts)]))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        started = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.monotonic() - started
    return summary(answers, wall)


def summary(answers: list[Answer], wall: float) -> dict:
    ok = [a.seconds for a in answers if a.status == 200]
    return {
        "statuses": dict(Counter(a.status for a in answers)),
        "tokens_per_s": sum(a.tokens for a in answers) / wall,
        "p50": statistics.median(ok) if ok else float("nan"),
        "p95": sorted(ok)[round(0.95 * (len(ok) - 1))] if ok else float("nan"),
    }


async def beside(
    api: ChatAPI, a_key: str, b_key: str, clients: int, b_requests: int, max_tokens: int
) -> tuple:
    """B's closed loop of one client while A's `clients` loop until B is done: (B's, A's) summaries."""
    texts, done, a_answers = prompts(), asyncio.Event(), []

    async def a_loop(client: httpx.AsyncClient, i: int) -> None:
        while not done.is_set():
            a_answers.append(await chat(client, api, a_key, max_tokens, texts[i % len(texts)]))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 1)) as client:
        started = time.monotonic()
        a_tasks = [asyncio.ensure_future(a_loop(client, i)) for i in range(clients)]
        await asyncio.sleep(1.0)  # A's line is long and its share is running
        b = await closed_loop(api, b_key, 1, b_requests, max_tokens)
        done.set()
        await asyncio.gather(*a_tasks)
    return b, summary(a_answers, time.monotonic() - started)


def build_demo(tmp: Path) -> Path:
    env = env_for(tmp, tmp / "models")
    subprocess.run([sys.executable, "-m", "cli", "models", "build-demo"], env=env, check=True, cwd=REPO)
    return tmp / "models"


def one_round(api: ChatAPI, keys: dict[str, str], engine_url: str, args: argparse.Namespace) -> dict:
    """Every run once, each after a pause longer than the linger (FTUNE_CHAT_SHARE_LINGER_SECONDS), so no
    tenant of an earlier run is still counted active in the next."""
    runs: dict[str, dict] = {}
    tokens, requests, pause = args.max_tokens, args.requests, args.pause

    def run(name: str, result: dict) -> None:
        runs[name] = result
        time.sleep(pause)

    run("one", asyncio.run(closed_loop(api, keys["one"], 1, requests // 2, tokens)))
    run("sixteen", asyncio.run(closed_loop(api, keys["sixteen"], 16, requests, tokens)))
    run("alone", asyncio.run(closed_loop(api, keys["b"], 1, args.b_requests, tokens)))
    b, a = asyncio.run(beside(api, keys["a"], keys["b"], 32, args.b_requests, tokens))
    run("beside", b)
    runs["a"] = a
    direct = ChatAPI(engine_url, "")  # the baseline: the engine without the API (its key is the key)
    run("direct_one", asyncio.run(closed_loop(direct, ENGINE_KEY, 1, requests // 2, tokens)))
    run("direct_sixteen", asyncio.run(closed_loop(direct, ENGINE_KEY, 16, requests, tokens)))
    return runs


FIGURES = ("tokens_per_s", "p50", "p95")
ROWS = {
    "one": "tenant, 1 client",
    "sixteen": "tenant, 16 clients",
    "alone": "B alone, 1 client",
    "beside": "B, 1 client, beside A's 32",
    "a": "A's 32 clients, beside B",
    "direct_one": "engine direct (no API), 1 client",
    "direct_sixteen": "engine direct, 16 clients",
}


def report(rounds: list[dict], settings: dict, args: argparse.Namespace, load_before: float) -> bool:
    """The medians over the rounds, each round's ratios; True when every goal is met."""
    print(f"\nchat through the API, settings {settings or 'default'}; demo model, {args.max_tokens} tokens")
    load = f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    print(f"per request, greedy, closed-loop clients; {os.cpu_count()} CPU cores, {load}")
    print(f"medians of {len(rounds)} rounds\n{'run':<34}{'tokens/s':>10}{'p50 s':>9}{'p95 s':>9}  statuses")
    median = {k: {f: statistics.median(r[k][f] for r in rounds) for f in FIGURES} for k in ROWS}
    for key, name in ROWS.items():
        statuses = sum((Counter(r[key]["statuses"]) for r in rounds), Counter())
        m = median[key]
        print(f"{name:<34}{m['tokens_per_s']:>10.1f}{m['p50']:>9.3f}{m['p95']:>9.3f}  {dict(statuses)}")
    speedups = [r["sixteen"]["tokens_per_s"] / r["one"]["tokens_per_s"] for r in rounds]
    direct = [r["direct_sixteen"]["tokens_per_s"] / r["direct_one"]["tokens_per_s"] for r in rounds]
    slowdowns = [r["beside"]["p50"] / r["alone"]["p50"] for r in rounds]
    all_200 = all(set(r[k]["statuses"]) == {200} for r in rounds for k in ("one", "sixteen", "beside"))
    speedup, slowdown = statistics.median(speedups), statistics.median(slowdowns)
    print(f"16 clients vs 1: {speedup:.2f}x aggregate tokens/s (goal >= 4x; rounds {listed(speedups)})")
    print(f"  the engine without the API: {statistics.median(direct):.2f}x (rounds {listed(direct)})")
    print(f"B's p50 beside A's 32 clients vs alone: {slowdown:.2f}x (goal <= 2x; rounds {listed(slowdowns)})")
    print(f"every request of the 1-client, 16-client and B's runs answered 200: {all_200}")
    return speedup >= 4 and slowdown <= 2 and all_200


def listed(values: list[float]) -> str:
    return " ".join(f"{v:.2f}x" for v in values)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=128, help="answered by 16 clients (1 client: half)")
    p.add_argument("--b-requests", type=int, default=24, help="tenant B's requests, alone and beside A")
    p.add_argument("--rounds", type=int, default=3, help="every run once per round; medians reported")
    p.add_argument("--pause", type=float, default=3.0, help="seconds between runs (> the linger)")
    p.add_argument("--setting", action="append", default=[], help="FTUNE_X=value for the API (default: none)")
    args = p.parse_args()
    settings = dict(s.split("=", 1) for s in args.setting)
    tmp = Path(tempfile.mkdtemp(prefix="ftune-bench-chat-fairness-"))
    models_dir = build_demo(tmp)
    load_before = os.getloadavg()[0]
    with (
        engine_process(models_dir, tmp) as engine_url,
        chat_api(tmp / "api", models_dir, engine_url, **settings) as api,
    ):
        keys = {name: api.key(name) for name in ("warm", "one", "sixteen", "a", "b")}
        asyncio.run(closed_loop(api, keys["warm"], 4, 8, 4))  # loads the model; not timed
        time.sleep(args.pause)
        rounds = [one_round(api, keys, engine_url, args) for _ in range(args.rounds)]
    return 0 if report(rounds, settings, args, load_before) else 1


if __name__ == "__main__":
    raise SystemExit(main())
