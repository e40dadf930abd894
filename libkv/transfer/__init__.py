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

# name -> (module, class). Real engines first; `fake` moves nothing. The one list of backend
# names: the flags that pick a backend take their choices from the tuples below.
BACKENDS: dict[str, tuple[str, str]] = {
    "mooncake": ("libkv.transfer.mooncake", "MooncakeBackend"),
    "nixl": ("libkv.transfer.nixl", "NixlBackend"),
    "ucx": ("libkv.transfer.ucx", "UcxBackend"),
    "fake": ("libkv.transfer.fake", "FakeBackend"),
}
BACKEND_NAMES = tuple(BACKENDS)  # every backend a worker may run (--disaggregation-transfer-backend)
REAL_BACKENDS = tuple(name for name in BACKENDS if name != "fake")  # the engines that move bytes
# The real engines whose writes land without the receiver taking part (`one_sided` on the class):
# the receiver learns that bytes arrived only from the control plane and the landing checksums.
# EPD's encoders write image embeddings over these only (--encoder-transfer-backend): the worker
# poisons its pages and waits until they hash to the encoder's checksums (services/worker/encoders.py).
ONE_SIDED_BACKENDS = ("mooncake", "nixl")


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
