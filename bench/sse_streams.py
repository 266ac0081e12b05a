"""Tenant B's GET /jobs latency while tenant A opens many event streams on one queued job (issue 41 item 5).

    .venv/bin/python bench/sse_streams.py [--seconds 15] [--streams 300] [--bound 16 300] [--poll 1]

A real `ftune api` (uvicorn, SQLite, the embedded broker) per bound (FTUNE_SSE_MAX_STREAMS_PER_TENANT);
tests/e2e/sse_load.py opens tenant A's streams (raw sockets that then sit idle) and probes tenant B's
GET /jobs every 50 ms, first alone, then beside A's streams. Prints p50/p95 next to the goal (p95 under
100 ms), how A's attempts were answered, and the API's CPU time per second while the streams sit idle.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.hostile_load import percentile
from tests.e2e.sse_load import api_cpu_seconds, open_streams, probe_jobs, sse_stack

GOAL_P95_MS = 100.0
IDLE_SECONDS = 5.0


def line(label: str, latencies: list[float]) -> str:
    p50, p95 = percentile(latencies, 0.5) * 1000, percentile(latencies, 0.95) * 1000
    verdict = "meets" if p95 < GOAL_P95_MS else "MISSES"
    return f"{label}: GET /jobs p50 {p50:.1f} ms, p95 {p95:.1f} ms over {len(latencies)} ({verdict} the goal)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--bound", type=int, nargs="+", default=[16, 300])
    parser.add_argument("--poll", type=float, default=1.0, help="FTUNE_SSE_POLL_SECONDS (default 1)")
    args = parser.parse_args()
    for bound in args.bound:
        env = {"FTUNE_SSE_MAX_STREAMS_PER_TENANT": str(bound), "FTUNE_SSE_POLL_SECONDS": str(args.poll)}
        with sse_stack(**env) as stack:
            a, b = stack.keys["tenant-a"], stack.keys["tenant-b"]
            probe_jobs(stack.base, b, seconds=1)  # warm the route up
            print(f"bound {bound}: " + line("alone", probe_jobs(stack.base, b, seconds=args.seconds / 3)))
            streams = open_streams(stack.base, a, stack.jobs["tenant-a"], args.streams)
            try:
                answered = dict(sorted(Counter(streams.statuses).items()))
                cpu = api_cpu_seconds(stack)
                time.sleep(IDLE_SECONDS)  # the streams alone: what they cost the API sitting idle
                idle = (api_cpu_seconds(stack) - cpu) / IDLE_SECONDS
                latencies = probe_jobs(stack.base, b, seconds=args.seconds)
                print(f"bound {bound}: " + line(f"{len(streams.open)} streams of A open", latencies))
                print(f"    A's {args.streams} attempts answered {answered}; API CPU idle: {idle:.0%}")
            finally:
                streams.close()


if __name__ == "__main__":
    main()
