"""UCX settings that pdserve derives from its own configuration (the nixl and ucx backends).

UCX reads its configuration only from the environment, once, when a context is created; so the
backends call `bind_ucx_to(host)` just before they create theirs. This is the one place that
writes UCX_* variables, and only for the engine's sake.
"""

from __future__ import annotations

import logging
import os

import psutil

from libkv.transfer.bind_host import is_wildcard, resolve

log = logging.getLogger(__name__)


def interface_of(host: str) -> str:
    """The network interface that holds `host`'s address; ValueError if none does."""
    address = str(resolve(host))
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    raise ValueError(f"no local network interface holds {host} ({address}): a transfer engine "
                     "can only listen on an address of this machine")


def bind_ucx_to(host: str) -> str:
    """Restrict UCX's network devices to the interface holding `host`; return the setting.

    UCX's TCP transport listens on an address of every network device it may use (its
    connection-establishment socket), so by default a worker given 127.0.0.1 also listened on
    the machine's external address. With UCX_NET_DEVICES set to `host`'s interface it listens
    on that interface's address only (for 127.0.0.1: lo). Shared-memory transports (posix,
    sysv, cma) are not network devices and stay available. An operator's own UCX_NET_DEVICES
    (an RDMA HCA, say) wins; a wildcard host leaves UCX alone.
    """
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if is_wildcard(host):
        return os.environ.get("UCX_NET_DEVICES", "")
    if os.environ.get("UCX_NET_DEVICES"):
        log.info("UCX_NET_DEVICES=%s set by the operator; not restricting UCX to %s",
                 os.environ["UCX_NET_DEVICES"], host)
        return os.environ["UCX_NET_DEVICES"]
    os.environ["UCX_NET_DEVICES"] = interface_of(host)
    return os.environ["UCX_NET_DEVICES"]
