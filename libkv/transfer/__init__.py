"""KV transfer backends: the data plane that moves KV pages between workers' pools.

`create_backend(name, **options)` builds one by name; the engines are imported lazily so this
package imports where an engine is missing. libkv.transfer.interface holds the protocol
(TransferBackend, the one type services use), libkv.transfer.base the machinery every engine's
backend builds on, libkv.transfer.tensor_parallel the backend of a worker of TP size > 1.
"""

from __future__ import annotations

import importlib

from libkv.transfer.base import EngineBackend
from libkv.transfer.errors import (
    BackendMismatch,
    EngineUnavailable,
    GrantRefused,
    PeerUnreachable,
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from libkv.transfer.grants import grant_tag
from libkv.transfer.interface import PeerId, TransferBackend, TransferEndpoint, TransferHandle, TransferState
from libkv.transfer.process_exit import exit_process
from pdserve.transfer_backends import BACKEND_NAMES, ONE_SIDED_BACKENDS, REAL_BACKENDS

# name (pdserve/transfer_backends.py declares the names) -> (module, class).
BACKENDS: dict[str, tuple[str, str]] = {
    "mooncake": ("libkv.transfer.mooncake", "MooncakeBackend"),
    "nixl": ("libkv.transfer.nixl", "NixlBackend"),
    "ucx": ("libkv.transfer.ucx", "UcxBackend"),
    "fake": ("libkv.transfer.fake", "FakeBackend"),
}


def backend_class(name: str) -> type[EngineBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; expected one of {sorted(BACKENDS)}")
    module_name, class_name = BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(name: str, **options) -> EngineBackend:
    """Build a backend. Options are the backend's constructor arguments (timeout_s, host, ...);
    services take their defaults from pdserve.envs. Raises EngineUnavailable naming the package
    to install if the engine does not import."""
    return backend_class(name)(**options)


__all__ = [
    "BACKENDS", "BACKEND_NAMES", "ONE_SIDED_BACKENDS", "REAL_BACKENDS", "BackendMismatch", "EngineBackend",
    "EngineUnavailable", "GrantRefused", "PeerId", "PeerUnreachable", "TransferAborted", "TransferBackend",
    "TransferEndpoint", "TransferError", "TransferHandle", "TransferState", "TransferTimeout",
    "backend_class", "create_backend", "exit_process", "grant_tag",
]
