"""Remote media fetched from public addresses only, checked at the address actually connected to.

An allowed domain is a name, and a name can resolve to anything: 127.0.0.1, a private network's
hosts, a cloud's metadata service at 169.254.169.254. PublicOnlyBackend sits under the media
fetcher's HTTP client (httpcore's network backend): for each connection it resolves the host once,
refuses the connection if any of its addresses is not a public one (loopback, private, link-local,
shared, reserved, multicast, unspecified), and connects to those very addresses, so a second lookup
that answers otherwise (DNS rebinding) is never made. TLS still checks the certificate against the
host name (httpcore passes the URL's host as the server name). `--allow-private-media-addresses`
turns the check off, for a deployment whose images live on its own network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable

import httpcore

Resolver = Callable[[str, int], Awaitable[list[str]]]


class NonPublicAddress(Exception):
    """A media host resolved to an address the gateway does not fetch from."""

    def __init__(self, host: str, address: str) -> None:
        super().__init__(f"{host} resolves to {address}, which is not a public address")
        self.host = host
        self.address = address


def is_public(address: str) -> bool:
    """A global unicast address (an IPv4-mapped IPv6 address is judged by its IPv4 one)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def resolve(host: str, port: int) -> list[str]:
    """The host's addresses, in the resolver's order, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class PublicOnlyBackend(httpcore.AsyncNetworkBackend):
    """The network backend of the media fetcher's client (see the module docstring)."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend, resolver: Resolver = resolve) -> None:
        self.inner = inner
        self.resolver = resolver

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self.resolver(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc
        for address in addresses:
            if not is_public(address):
                raise NonPublicAddress(host, address)
        error: Exception = httpcore.ConnectError(f"{host} resolves to no address")
        for address in addresses:
            try:
                return await self.inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)
