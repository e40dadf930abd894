"""Remote images: an http(s) image URL fetched by the gateway, within MediaLimits.

Who calls: services.gateway.images, for a URL whose host is in `--allowed-media-domains`, with the
request's remaining byte budget and its fetch deadline. Redirects are followed by hand so that every
hop's host is checked against the allowed domains (at most MediaLimits.max_redirects hops); only
http and https; the answer must be 200 with an `image/*` content type; the body is read in chunks
and refused (413) as soon as it passes the byte limit, whatever Content-Length said. Every connection
goes to public addresses only, checked where it is made (services.gateway.public_addresses). A slow server
holds only its own request: everything here awaits, and the whole fetch is bounded by the deadline.
Every failure is a GatewayError (400, or 413 for size) saying which image and why.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from services.gateway.errors import GatewayError, bad_request
from services.gateway.media_limits import MediaLimits
from services.gateway.public_addresses import NonPublicAddress, PublicOnlyBackend

SCHEMES = ("http", "https")


class MediaFetcher:
    """One HTTP client shared by all requests (connection reuse); `close` on the gateway's shutdown."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        # trust_env=False: no proxy or .netrc from the environment: the gateway talks to the
        # allowed hosts themselves. Timeouts: the deadline in `fetch` bounds the whole fetch.
        transport = httpx.AsyncHTTPTransport(trust_env=False)
        if not limits.allow_private_addresses:
            # httpx has no public way to choose the pool's network backend; the pinned httpx/httpcore
            # keep it here (tests/services/gateway/test_public_addresses.py fails if that changes)
            pool = transport._pool
            pool._network_backend = PublicOnlyBackend(pool._network_backend)
        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False, trust_env=False,
                                         timeout=None,
                                         headers={"Accept": "image/*", "User-Agent": "pdserve-gateway"})

    async def close(self) -> None:
        await self._client.aclose()

    def check_url(self, url: str, where: str) -> httpx.URL:
        """The parsed URL if its scheme and host may be fetched; else a 400 naming the flag."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as exc:
            raise bad_request(f"{where}: not a valid URL ({exc})", param=None) from None
        if parsed.scheme not in SCHEMES:
            raise bad_request(f"{where}: only http and https image URLs are fetched, not "
                              f"{parsed.scheme or '?'}:")
        if not self.limits.allowed_domains:
            raise bad_request(f"{where}: remote image URLs are not allowed on this server (it fetches none: "
                              "the operator may allow domains with --allowed-media-domains); send a data: "
                              "URL")
        if not parsed.host or not self.limits.domain_allowed(parsed.host):
            raise bad_request(f"{where}: the domain {parsed.host or '?'} is not in --allowed-media-domains")
        return parsed

    async def fetch(self, url: str, where: str, max_bytes: int, too_large: str, deadline: float) -> bytes:
        """The image bytes behind `url`, fetched before `deadline` (time.monotonic()); `max_bytes`:
        413 with `too_large` as the reason when the body is longer."""
        left_s = deadline - time.monotonic()
        try:
            return await asyncio.wait_for(
                self._follow(self.check_url(url, where), where, max_bytes, too_large), max(0.0, left_s))
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11 on
            raise bad_request(f"{where}: {_shown(url)} was not fetched within "
                              f"{self.limits.fetch_timeout_s:g}s (--media-fetch-timeout)") from None
        except httpx.HTTPError as exc:
            raise bad_request(f"{where}: fetching {_shown(url)} failed: {type(exc).__name__}: "
                              f"{exc}") from None
        except NonPublicAddress as exc:
            raise bad_request(f"{where}: not fetched: {exc} (the gateway fetches media from public addresses "
                              "only; the operator may allow others with --allow-private-media-addresses)") \
                from None

    async def _follow(self, url: httpx.URL, where: str, max_bytes: int, too_large: str) -> bytes:
        for _ in range(self.limits.max_redirects + 1):
            async with self._client.stream("GET", url) as response:
                if response.is_redirect:
                    location = response.headers.get("location", "")
                    url = self.check_url(str(url.join(location)), f"{where} (redirected)")
                    continue
                if response.status_code != 200:
                    raise bad_request(f"{where}: {_shown(str(url))} answered HTTP {response.status_code}")
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if not kind.startswith("image/"):
                    raise bad_request(f"{where}: {_shown(str(url))} is not an image (content type "
                                      f"{kind or 'missing'})")
                return await _read(response, max_bytes, too_large, where)
        raise bad_request(f"{where}: more than {self.limits.max_redirects} redirects")


async def _read(response: httpx.Response, max_bytes: int, too_large: str, where: str) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise payload_too_large(f"{where}: {declared} bytes; {too_large}")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise payload_too_large(f"{where}: more than {max_bytes} bytes; {too_large}")
        chunks.append(chunk)
    return b"".join(chunks)


def payload_too_large(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(413, message, param=param, code="payload_too_large")


def _shown(url: str) -> str:
    """The URL as an error message quotes it: without a query (it may carry a token), shortened."""
    shown = url.split("?", 1)[0]
    return shown if len(shown) <= 120 else shown[:117] + "..."
