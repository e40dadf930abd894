"""The worker a failure is blamed on, as trailing metadata of the failed call.

A decode worker whose prefill failed names that prefill here, so the gateway blames and retries
around the right worker without parsing messages (services/gateway/dispatcher.py).
"""

from __future__ import annotations

from collections.abc import Iterable

FAILED_PEER_KEY = "pdserve-failed-peer"


def failed_peer_metadata(address: str) -> tuple[tuple[str, str], ...]:
    """Trailing metadata naming `address` as the worker that caused the failure ("" names none)."""
    return ((FAILED_PEER_KEY, address),) if address else ()


def failed_peer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The address a call's trailing metadata blames, "" if none."""
    for key, value in metadata or ():
        if key == FAILED_PEER_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return ""
