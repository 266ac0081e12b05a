"""Where a tenant may make ftune connect (webhooks, and image URLs where fetching is on: core.image_fetch):
public unicast addresses only, unless the operator allows private ones (FTUNE_WEBHOOK_ALLOW_PRIVATE,
FTUNE_IMAGE_FETCH_ALLOW_PRIVATE).

A host is resolved and every address it resolves to is checked (one private record among public ones is
refused: that is how DNS rebinding gets in); the caller connects to the checked address, never resolves
again. Numeric forms (0x7f000001, 2130706433, 0177.0.0.1, 127.1) resolve as the C library reads them, to the
address they name; IPv6 addresses that embed an IPv4 one (::ffff:a.b.c.d, 6to4, NAT64, Teredo) are checked
by the IPv4 address inside as well.

A lookup is the tenant's too (its own nameserver can take the resolver's whole timeout, 30 s and more, to
answer or not): it runs in a thread of its own and the caller waits at most its `timeout`,
and an owner (a tenant) has at most LOOKUPS_PER_OWNER lookups running at once, those it gave up on
included, so a tenant whose names hang holds that many threads and never a thread of anyone else's.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


class AddressRefused(ValueError):
    """A destination ftune does not connect to; `reason` says why, for people."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _embedded(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64 or ip in _NAT64_LOCAL:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def refusal(ip: IPAddress) -> str | None:
    """Why ftune does not connect to `ip` (a kind of address, e.g. "loopback"); None for a public address."""
    if isinstance(ip, ipaddress.IPv6Address) and (inner := _embedded(ip)) is not None:
        why = refusal(inner)
        if why is not None:
            return why
    kinds = (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
        ("non-global", not ip.is_global),
    )
    return next((kind for kind, hit in kinds if hit), None)


class LookupFailed(OSError):
    """A lookup that did not answer in time, or one not started: the owner's lookups are all running."""


LOOKUPS_PER_OWNER = 2
_running: Counter[str] = Counter()  # lookups running, by owner
_running_lock = threading.Lock()


def resolve(host: str, port: int, *, timeout: float, owner: str) -> list[IPAddress]:
    """Every address `host` resolves to, in the resolver's order (socket.gaierror if none); LookupFailed
    when that takes longer than `timeout` seconds, or when `owner` has LOOKUPS_PER_OWNER lookups running."""
    with _running_lock:
        if _running[owner] >= LOOKUPS_PER_OWNER:
            raise LookupFailed(f"not resolved: {LOOKUPS_PER_OWNER} earlier lookups are still running")
        _running[owner] += 1
    answer: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as e:  # handed to the caller
            answer.append(e)
        finally:
            with _running_lock:
                _running[owner] -= 1
                if not _running[owner]:
                    del _running[owner]
            done.set()

    threading.Thread(target=lookup, name="ftune-lookup", daemon=True).start()
    if not done.wait(timeout):
        raise LookupFailed(f"{host} did not resolve within {timeout:.2g} s")
    if isinstance(answer[0], BaseException):
        raise answer[0]
    out: list[IPAddress] = []
    for *_, sockaddr in answer[0]:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])  # an IPv6 zone is not part of it
        if ip not in out:
            out.append(ip)
    return out


def host_port(url: str) -> tuple[str, int]:
    """The host and port an http(s) URL connects to (AddressRefused for any other URL)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AddressRefused("only http and https URLs with a host are allowed")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise AddressRefused("the port is not valid") from e
    return parts.hostname, port


def checked_address(url: str, *, allow_private: bool, timeout: float, owner: str) -> str:
    """The address to connect to for `url`: its host resolved (`timeout`, `owner`: see resolve), each
    address checked (AddressRefused naming the first refused one; socket.gaierror when the host does not
    resolve, LookupFailed); `allow_private`: no check."""
    host, port = host_port(url)
    addresses = resolve(host, port, timeout=timeout, owner=owner)
    if not allow_private:
        for ip in addresses:
            why = refusal(ip)
            if why is not None:
                shown = "" if host == str(ip) else f"{host} resolves to "
                raise AddressRefused(f"{shown}{ip}, a {why} address, is not allowed")
    return str(addresses[0])
