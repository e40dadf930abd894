"""Addresses: whether a bind address is reachable from other hosts (the checks that warn when an
unauthenticated endpoint is exposed use it)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; False for anything other hosts may reach (a
    routable address, 0.0.0.0 / :: binding every interface, any other host name)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
