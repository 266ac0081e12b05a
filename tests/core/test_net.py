"""core.net's lookups against a tenant's nameserver: a lookup waits at most its timeout, and a tenant has at
most LOOKUPS_PER_OWNER running (those given up on included) while other tenants' resolve as usual. The
system resolver is replaced by a double whose names under `hang.` answer only when the test says."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from core import net


class Resolver:
    """getaddrinfo: `*.hang.test` blocks until `release`, anything else is 93.184.216.34 at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked: list[str] = []

    def __call__(self, host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        self.asked.append(host)
        if host.endswith(".hang.test"):
            self.release.wait(30)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Resolver]:
    double = Resolver()
    monkeypatch.setattr(socket, "getaddrinfo", double)
    try:
        yield double
    finally:
        double.release.set()  # the lookups given up on end


def wait_for(condition: Any, seconds: float = 5) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_lookup_waits_at_most_its_timeout(resolver: Resolver) -> None:
    start = time.monotonic()
    with pytest.raises(net.LookupFailed, match=r"did not resolve within 0\.3 s"):
        net.checked_address("https://a.hang.test/hook", allow_private=False, timeout=0.3, owner="t1")
    assert 0.3 <= time.monotonic() - start < 1.5
    assert net.resolve("example.test", 443, timeout=1, owner="t1")[0].compressed == "93.184.216.34"


def test_a_tenants_hanging_lookups_hold_its_own_threads_only(resolver: Resolver) -> None:
    for i in range(net.LOOKUPS_PER_OWNER):
        with pytest.raises(net.LookupFailed):
            net.resolve(f"h{i}.hang.test", 443, timeout=0.05, owner="hostile")
    # given up on but still running: the tenant's next lookup is refused at once, not even started
    start = time.monotonic()
    with pytest.raises(net.LookupFailed, match="earlier lookups are still running"):
        net.resolve("fast.test", 443, timeout=5, owner="hostile")
    assert time.monotonic() - start < 0.5 and "fast.test" not in resolver.asked
    # anyone else resolves as usual
    assert net.checked_address("https://fast.test/hook", allow_private=False, timeout=1, owner="other") == (
        "93.184.216.34"
    )
    # once its nameserver answers, the tenant's lookups run again
    resolver.release.set()
    wait_for(lambda: "hostile" not in net._running)
    assert net.resolve("fast.test", 443, timeout=1, owner="hostile")[0].compressed == "93.184.216.34"


def test_a_failed_lookup_raises_the_resolvers_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing(*args: Any, **kwargs: Any) -> list[Any]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", nothing)
    with pytest.raises(socket.gaierror):
        net.resolve("nowhere.test", 443, timeout=1, owner="t")
    assert "t" not in net._running
