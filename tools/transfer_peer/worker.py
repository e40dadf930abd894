"""A worker process hosting one transfer backend, driven by JSON lines (tests and benchmarks).

Engines live in their own processes because a transfer needs two, and because NIXL and UCX
crash at interpreter exit (so never inside pytest). Run: python -m tools.transfer_peer.worker
(tools.transfer_peer.client.PeerProcess does it for you). Commands arrive on stdin, one JSON
object a line: {"op": "init", ...}, {"op": "connect", ...}, ... (see the handlers below). Grants
travel as hex. Each reply is one line on stdout starting with REPLY_PREFIX; engines print their
own warnings on stdout too, and the driver skips every line without the prefix. An engine error
in a command is a reply with "error" and "error_type", never a crash. The process ends with
close() + exit_process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
import traceback
from collections.abc import Callable

import psutil
import torch

from libkv import KVLayout, KVPool
from libkv.landing import TPKVPool, checksums_in_parts
from libkv.rank_channel import InProcessRank, RankChannel
from libkv.transfer import (
    EngineBackend,
    PeerId,
    TransferBackend,
    TransferEndpoint,
    TransferError,
    TransferHandle,
    create_backend,
    exit_process,
)
from libkv.transfer.tensor_parallel import RankTransfer, TensorParallelBackend

REPLY_PREFIX = "@@reply "


class PeerWorker:
    """Holds one backend and one pool; every handler returns the reply's fields."""

    def __init__(self) -> None:
        self._backend: TransferBackend | None = None
        self._pool: KVPool | None = None
        self.ranks: list[KVPool] = []  # each rank's pool, rank 0's (self.pool) first
        self.handles: dict[int, TransferHandle] = {}

    @property
    def backend(self) -> TransferBackend:
        if self._backend is None:
            raise RuntimeError("no backend yet: send init first")
        return self._backend

    @property
    def pool(self) -> KVPool:
        if self._pool is None:
            raise RuntimeError("no pool yet: send init first")
        return self._pool

    def op_init(self, backend: str, layout: dict, num_pages: int, timeout_s: float,
                options: dict | None = None, tp_size: int = 1) -> dict:
        """`tp_size` > 1: a tensor-parallel worker whose ranks (each a pool of `layout` with its own
        engine) live in this process, driven as rank 0 drives them (InProcessRank for a socket)."""
        torch.set_num_threads(1)
        options = {"timeout_s": timeout_s, **(options or {})}
        rank_layout = KVLayout.from_dict(layout)
        if tp_size == 1:
            pool = KVPool(rank_layout, num_pages)
            engine: TransferBackend = create_backend(backend, **options)
            self.ranks = [pool]
        else:
            followers = [RankTransfer(KVPool(rank_layout, num_pages), rank, tp_size)
                         for rank in range(1, tp_size)]
            channels: list[RankChannel] = [InProcessRank(follower) for follower in followers]
            pool = TPKVPool(rank_layout, num_pages, "cpu", channels)
            engine = TensorParallelBackend(create_backend(backend, **options), channels, options)
            self.ranks = [pool, *(follower.pool for follower in followers)]
        self._pool, self._backend = pool, engine
        engine.register(pool)
        return {"endpoint": engine.endpoint().to_json()}

    def op_fill(self, seed: int) -> dict:
        """Fill each rank's pool with seeded random bytes (byte-level, so any dtype works), a
        different seed per rank."""
        for rank, pool in enumerate(self.ranks):
            gen = torch.Generator().manual_seed(seed + 1000 * rank)
            flat = pool.as_bytes()
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
        return {}

    def op_hashes(self, pages: list[int] | None = None, rank: int = 0) -> dict:
        pool = self.ranks[rank]
        nbytes = pool.layout.page_nbytes
        flat = pool.as_bytes()
        pages = list(range(pool.num_pages)) if pages is None else pages
        return {"hashes": {str(p): hashlib.sha256(flat[p * nbytes:(p + 1) * nbytes].numpy().tobytes())
                           .hexdigest() for p in pages}}

    def op_sent_checksums(self, peer: PeerId, pages: list[int]) -> dict:
        """The checksums a sender sends with a write of `pages` to `peer` (page_checksums_for)."""
        return {"checksums": self.backend.page_checksums_for(peer, pages)}

    def op_landed_checksums(self, pages: list[int], sender_tp_size: int) -> dict:
        """What the receiver's landing check computes over `pages` (libkv.landing)."""
        return {"checksums": checksums_in_parts(self.pool, pages, sender_tp_size)}

    def op_rank_bytes(self) -> dict:
        return {"rank_bytes": self.backend.rank_bytes()}

    def op_connect(self, endpoint: str) -> dict:
        return {"peer": self.backend.connect(TransferEndpoint.from_json(endpoint))}

    def op_expect(self, key: str, pages: list[int], grant: str = "") -> dict:
        self.backend.expect(key, pages, bytes.fromhex(grant))
        return {}

    def op_verify(self, peer: PeerId, pages: list[int], key: str, grant: str = "") -> dict:
        start = time.perf_counter()
        self.backend.verify_grant(peer, pages, key=key, grant=bytes.fromhex(grant))
        return {"seconds": time.perf_counter() - start}

    def op_bench_verify(self, peer: PeerId, pages: list[int], key: str, grant: str, repeats: int) -> dict:
        """Seconds of each of `repeats` verify_grant calls for the same pages."""
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.backend.verify_grant(peer, pages, key=key, grant=bytes.fromhex(grant))
            seconds.append(time.perf_counter() - start)
        return {"seconds": seconds}

    def op_grant_entries(self, pages: list[int]) -> dict:
        """This receiver's grant-table entries of `pages`, hex (zeros: not reserved); a worker of
        one rank only (a tensor-parallel backend keeps a grant table per rank)."""
        if not isinstance(self.backend, EngineBackend):
            raise TypeError(f"grant entries of a {type(self.backend).__name__}: ask a worker of tp_size 1")
        grants = self.backend.grants
        if grants is None:
            raise RuntimeError("no grant table yet: send init first")
        return {"entries": {str(p): grants.entries[p].tobytes().hex() for p in pages}}

    def op_checksums(self, pages: list[int]) -> dict:
        return {"checksums": self.pool.page_checksums(pages)}

    def op_listeners(self) -> dict:
        """Every listening TCP socket of this process, as [ip, port]."""
        return {"listeners": [[c.laddr.ip, c.laddr.port] for c in psutil.Process().net_connections(kind="tcp")
                              if c.status == psutil.CONN_LISTEN]}

    def op_release(self, key: str) -> dict:
        self.backend.release_expectation(key)
        return {}

    def op_write(self, peer: PeerId, src: list[int], dst: list[int], key: str = "", wait: bool = True,
                 abort: bool = False, grant: str = "") -> dict:
        start = time.perf_counter()
        handle = self.backend.write(peer, src, dst, key=key, grant=bytes.fromhex(grant))
        self.handles[handle.transfer_id] = handle
        reply: dict[str, object] = {"transfer_id": handle.transfer_id, "runs": handle.num_runs}
        if abort:
            reply["state"] = self.backend.abort(handle).value
        elif wait:
            asyncio.run(self.backend.wait(handle))  # the services' path: awaited on an event loop
            reply["state"] = "done"
        reply["seconds"] = time.perf_counter() - start
        return reply

    def op_wait(self, transfer_id: int) -> dict:
        self.backend.wait_blocking(self.handles[transfer_id])
        return {"state": "done"}

    def op_write_until_error(self, peer: PeerId, src: list[int], dst: list[int], key: str,
                             max_seconds: float) -> dict:
        """Write the same pages again and again until a write fails (the peer was killed)."""
        start = time.perf_counter()
        writes = 0
        while time.perf_counter() - start < max_seconds:
            handle = self.backend.write(peer, src, dst, key=key)
            self.backend.wait_blocking(handle)
            writes += 1
        return {"writes": writes, "state": "no error"}

    def op_bench_write(self, peer: PeerId, src: list[int], dst: list[int], key: str, repeats: int,
                       grant: str = "") -> dict:
        """Seconds of each of `repeats` write + wait of the same pages."""
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            handle = self.backend.write(peer, src, dst, key=key, grant=bytes.fromhex(grant))
            self.backend.wait_blocking(handle)
            seconds.append(time.perf_counter() - start)
        return {"seconds": seconds, "runs": handle.num_runs}

    def op_bench_checksums(self, pages: list[int], repeats: int) -> dict:
        """Seconds of each of `repeats` checksums of `pages` (KVPool.page_checksums)."""
        return {"seconds": _timed(repeats, lambda: self.pool.page_checksums(pages))}

    def op_bench_poison(self, pages: list[int], repeats: int) -> dict:
        """Seconds of each of `repeats` poisonings of `pages` (KVPool.poison, decode's step before
        it offers pages to a one-sided writer)."""
        return {"seconds": _timed(repeats, lambda: self.pool.poison(pages))}

    def op_close(self) -> dict:
        if self._backend is not None:
            self._backend.close()
        return {}


def _timed(repeats: int, work: Callable[[], object]) -> list[float]:
    """Seconds of each of `repeats` calls of `work`."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    worker = PeerWorker()
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.pop("op")
        try:
            reply = getattr(worker, f"op_{op}")(**command)
        except TransferError as exc:
            reply = {"error": str(exc), "error_type": type(exc).__name__}
        except Exception as exc:  # reported to the driver, which decides whether it was expected
            reply = {"error": f"{exc}\n{traceback.format_exc()}", "error_type": type(exc).__name__}
        print(REPLY_PREFIX + json.dumps(reply), flush=True)
        if op == "close":
            break
    exit_process(0)


if __name__ == "__main__":
    main()
