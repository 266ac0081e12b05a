"""Fetching a tenant's image URL, where the operator enables it (FTUNE_IMAGE_FETCH_ENABLED): a chat row's
at upload, a chat request's before it goes to the engine. What is fetched is checked and inlined as a data:
URL by core.data.images.check_image_part; this module only gets the bytes, or says why not.

The URL is a tenant's, so nothing at it is trusted, and it is guarded as a webhook's destination is: the
host is resolved (the tenant's lookups bounded) and every address it resolves to checked (core.net:
loopback, private, link-local, multicast and reserved addresses refused unless
FTUNE_IMAGE_FETCH_ALLOW_PRIVATE), and the connection goes to the address checked (core.pinned_http), so a
second lookup cannot swap it. One deadline covers the lookup, connect and read
(FTUNE_IMAGE_FETCH_TIMEOUT_SECONDS). At most `max_bytes` of the body are read: a larger Content-Length is
refused before its body, a body that streams past it is cut off. Redirects are not followed (a 3xx fails:
the next hop would be another URL to check, and a dataset had better name where its image is); any status
but 200 fails. A fetcher takes at most `max_fetches` URLs (an upload's cap, FTUNE_IMAGE_FETCH_MAX_PER_UPLOAD).
A fetcher answers a URL it has already fetched from memory (up to MEMO_BYTES of images, failures too): an
upload that names one image in many rows, or is validated twice (a column mapping sent as a form field),
fetches it once.

Failures are line problems, as the other image checks': image_url_invalid (no host, a bad port),
image_url_private (an address refused), image_fetch_failed (no answer, a lookup that failed, a status other
than 200; the message says which), image_too_large, too_many_images (past max_fetches).
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

from core import net
from core.data.images import MAX_IMAGE_BYTES
from core.data.problems import LineProblem, show
from core.pinned_http import Deadline, ResponseTooLarge, exchange
from core.settings import Settings

HEAD_BYTES = 64 * 1024  # the status line and headers
CHUNK_OVERHEAD_BYTES = 64 * 1024  # chunked framing read with the body; a server that frames more is cut off
MEMO_BYTES = 64 * 1024 * 1024  # images a fetcher keeps to answer a URL again; past it, a URL is fetched again


class _TooLarge(Exception):
    pass


class _NotOk(Exception):
    """An answer other than 200."""


class ImageFetcher:
    """Fetches image URLs for one `owner` (a tenant): called as core.data.images.Fetch, (url, field) -> the
    bytes at the URL, or a LineProblem naming the field."""

    def __init__(
        self,
        *,
        owner: str,
        allow_private: bool,
        timeout: float,
        max_fetches: int | None = None,
        max_bytes: int = MAX_IMAGE_BYTES,
    ) -> None:
        self.owner, self.allow_private, self.timeout = owner, allow_private, timeout
        self.max_fetches, self.max_bytes = max_fetches, max_bytes
        self.fetched = 0  # URLs taken so far, failed ones included
        self._memo: dict[str, bytes | LineProblem] = {}  # URL -> its bytes, or why it failed
        self._memo_bytes = 0

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        owner: str,
        *,
        max_fetches: int | None = None,
        max_bytes: int = MAX_IMAGE_BYTES,
    ) -> ImageFetcher | None:
        """The operator's fetcher for `owner`; None where fetching is off (an http(s) URL is then refused)."""
        if not settings.image_fetch_enabled:
            return None
        return cls(
            owner=owner,
            allow_private=settings.image_fetch_allow_private,
            timeout=settings.image_fetch_timeout_seconds,
            max_fetches=max_fetches,
            max_bytes=max_bytes,
        )

    def __call__(self, url: str, at: str) -> bytes:
        known = self._memo.get(url)
        if isinstance(known, LineProblem):
            raise LineProblem(known.code, known.message, at)
        if known is not None:
            return known
        try:
            data = self._fetch(url, at)
        except LineProblem as p:
            if p.code != "too_many_images":  # the cap is this fetcher's, not the URL's
                self._memo[url] = p
            raise
        if self._memo_bytes + len(data) <= MEMO_BYTES:
            self._memo[url] = data
            self._memo_bytes += len(data)
        return data

    def _fetch(self, url: str, at: str) -> bytes:
        if self.max_fetches is not None and self.fetched >= self.max_fetches:
            raise LineProblem(
                "too_many_images",
                f"is past the {self.max_fetches} image URLs this server fetches for one upload: send the "
                "rest inline as data: URLs",
                at,
            )
        self.fetched += 1
        try:
            host, _ = net.host_port(url)
        except net.AddressRefused as e:
            raise LineProblem("image_url_invalid", f"is not a URL ftune can fetch: {e.reason}", at) from None
        deadline = Deadline(self.timeout)  # the lookup's, the connection's, the answer's
        try:
            address = net.checked_address(
                url, allow_private=self.allow_private, timeout=deadline.left(), owner=self.owner
            )
        except net.AddressRefused as e:
            raise LineProblem(
                "image_url_private",
                f"points at an address ftune does not connect to ({e.reason}): send the image inline as a "
                "data: URL",
                at,
            ) from None
        except OSError as e:  # socket.gaierror, net.LookupFailed, TimeoutError
            raise _failed(f"{show(host)} did not resolve ({type(e).__name__}: {e})", at) from None
        try:
            return self._get(url, address, deadline)
        except (_TooLarge, ResponseTooLarge) as e:
            raise LineProblem("image_too_large", f"could not be inlined: {e}", at) from None
        except _NotOk as e:
            raise _failed(str(e), at) from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise _failed(f"{type(e).__name__}: {e}", at) from None

    def _get(self, url: str, address: str, deadline: Deadline) -> bytes:
        cap = self.max_bytes
        headers = {"user-agent": "ftune-images", "accept": "image/*"}
        budget = HEAD_BYTES + cap + 1 + CHUNK_OVERHEAD_BYTES
        with exchange("GET", url, address, deadline=deadline, max_bytes=budget, headers=headers) as response:
            if response.status != 200:
                redirect = response.status // 100 == 3
                hint = "; redirects are not followed: give the image's own URL" if redirect else ""
                raise _NotOk(f"{urlsplit(url).hostname} answered {response.status} {response.reason}{hint}")
            length = response.getheader("content-length", "")
            if length.isdigit() and int(length) > cap:
                raise _TooLarge(f"its answer is {int(length):,} bytes, over the limit of {cap:,}")
            data = bytearray()
            while len(data) <= cap and (chunk := response.read(min(cap + 1 - len(data), 1 << 20))):
                data += chunk
            if len(data) > cap:
                raise _TooLarge(f"its answer is over the limit of {cap:,} bytes")
            return bytes(data)


def _failed(why: str, at: str) -> LineProblem:
    return LineProblem("image_fetch_failed", f"could not be fetched: {why}", at)
