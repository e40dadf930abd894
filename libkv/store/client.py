"""Store clients: the few calls the store tier makes, each bounded in time.

Mooncake Store's Python client answers errors with negative codes and returns b"" for a missing
key. Measured here (TCP, master on 127.0.0.1): with the master killed most calls fail in under a
millisecond (-900, RPC_FAIL), but some wait seconds for a reconnect (batch_is_exist took 4.3 s);
with the master frozen (SIGSTOP) every call waits 30 s; `setup` with no master retries for about
90 s, holding the GIL (see `connect`). So every call runs on a lane
thread of its own and the caller waits at most `timeout_s`: past it the call counts as failed (the
lane thread finishes it in the background; later calls on that lane queue behind it and time out
too until it returns). Reads (fetches, on the engine thread) and writes (the writer thread, the
probe) have separate lanes, so a slow put never delays a fetch.
"""

from __future__ import annotations

import concurrent.futures
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class StoreError(RuntimeError):
    """A store call failed, returned an error code or did not answer in time."""


class StoreClient(Protocol):
    def connect(self) -> None: ...
    def exists(self, keys: Sequence[str]) -> list[bool]: ...
    def get(self, keys: Sequence[str]) -> list[bytes]: ...
    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None: ...
    def upsert(self, keys: Sequence[str], values: Sequence[bytes]) -> None: ...
    def ping(self) -> None: ...
    def close(self, *, exiting: bool = False) -> None: ...


# Native clients a process that is about to end left open (close(exiting=True)): referenced here so
# that no destructor tears them down before the process ends (launch_server ends it with exit_process).
_LEFT_TO_EXIT: list[Any] = []


class MooncakeStoreClient:
    """Mooncake Store (`mooncake.store.MooncakeDistributedStore`) over TCP, with a master at
    `master` (HOST:PORT) and no metadata server (P2P handshake). `segment_bytes` is the memory this
    worker lends to the store (the cluster's store is the sum of its clients' segments: an entry
    lives in one of them and is lost with it); `buffer_bytes` its local staging buffer."""

    def __init__(self, master: str, host: str = "127.0.0.1", segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 64 << 20, timeout_s: float = 0.5) -> None:
        self.master, self.host = master, host
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self.timeout_s = timeout_s
        self._store: Any = None
        self._read = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-read")
        self._write = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-write")

    def _call(self, lane: concurrent.futures.ThreadPoolExecutor, fn: Callable[[], Any]) -> Any:
        try:
            future = lane.submit(fn)
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise StoreError(f"mooncake store at {self.master}: no answer in {self.timeout_s:g} s") from None
        except StoreError:
            raise
        except Exception as exc:  # the client raised, or the lane is shut: unusable all the same
            raise StoreError(f"mooncake store at {self.master}: {exc}") from exc

    def _checked(self, what: str, code: int) -> int:
        if code < 0:
            raise StoreError(f"mooncake store at {self.master}: {what} returned {code}")
        return code

    def connect(self) -> None:
        """Set the client up (the tier calls it from its probe thread).

        Mooncake's setup holds the GIL while it retries a master that is not there (about 90 s,
        measured: every Python thread of the worker stops meanwhile), so it is called only once
        the master accepts a TCP connection; then it takes about 40 ms. Its data calls release
        the GIL (a frozen master holds them 30 s, which the lanes' bound cuts short)."""
        from mooncake.store import MooncakeDistributedStore  # imported only where a store is used

        host, _, port = self.master.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s).close()
        except (OSError, ValueError) as exc:
            raise StoreError(f"mooncake store master {self.master} not reachable: {exc}") from None
        store = MooncakeDistributedStore()
        code = store.setup(self.host, "P2PHANDSHAKE", self.segment_bytes, self.buffer_bytes, "tcp", "",
                           self.master)
        if code != 0:
            raise StoreError(f"mooncake store at {self.master}: setup returned {code}")
        self._store = store

    @property
    def connected(self) -> bool:
        return self._store is not None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._call(self._read, lambda: self._store.batch_is_exist(list(keys)))
        return [self._checked("batch_is_exist", code) == 1 for code in codes]

    def get(self, keys: Sequence[str]) -> list[bytes]:
        """The values; b"" for a key that is missing (or failed: the caller's check rejects it)."""
        return list(self._call(self._read, lambda: self._store.get_batch(list(keys))))

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        code = self._call(self._write, lambda: self._store.put_batch(list(keys), list(values)))
        self._checked("put_batch", code)

    def upsert(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """Put that replaces: Mooncake's put leaves an existing key's value as it is (checked), so
        repairing a corrupt entry needs this."""
        code = self._call(self._write, lambda: self._store.upsert_batch(list(keys), list(values)))
        self._checked("upsert_batch", code)

    def ping(self) -> None:
        """A small write: it succeeds only once the master answers and this client's segment is
        mounted again (after a master restart the first puts fail for lack of space)."""
        self._checked("put", self._call(self._write, lambda: self._store.put("pdserve/ping", b"1")))

    def close(self, *, exiting: bool = False) -> None:
        """Close the native client on the write lane and stop the lanes. The caller waits at most
        the timeout only for a close that releases the GIL, and Mooncake's holds it while it
        unmounts the segment on the master: with the master gone that took 5 to 19 s here, during
        which no thread of the process ran (a stopped worker outlived its stop grace, SIGKILLed).

        `exiting`: the process ends right after (launch_server ends it with exit_process), so leave
        the native client to the exit. The master drops the segment of a client that went away when
        its lease runs out, as for a worker that died.
        """
        store, self._store = self._store, None
        if store is not None and exiting:
            _LEFT_TO_EXIT.append(store)
        elif store is not None:
            try:
                self._call(self._write, store.close)
            except StoreError:
                pass
        self._read.shutdown(wait=False, cancel_futures=True)
        self._write.shutdown(wait=False, cancel_futures=True)


def create_client(backend: str, master: str, **options) -> StoreClient:
    if backend != "mooncake":
        raise ValueError(f"--hicache-storage-backend must be mooncake, got {backend!r}")
    if not master:
        raise ValueError("--hicache-storage-backend mooncake needs the master's address: "
                         "--hicache-mooncake-master HOST:PORT "
                         "(or PDSERVE_HICACHE_MOONCAKE_MASTER, MOONCAKE_MASTER)")
    return MooncakeStoreClient(master, **options)
