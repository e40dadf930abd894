"""`nixl` backend: one-sided RDMA-style WRITEs through a NIXL agent (UCX plugin).

Endpoint blob: the agent's metadata (NIXL's own serialization) plus the pool's base address and
size, as JSON; a pool in GPU memory adds its NIXL memory type (VRAM) and GPU, which every write's
descriptors name on both sides (not yet run on a GPU: `make test-gpu` has the test). connect()
loads the peer's metadata into the local agent (add_remote_agent); a write is one NIXL transfer
request whose descriptor list has one entry per page run.

Grants: the grant table (libkv.transfer.grants) is registered with the agent next to the pool, so
the agent metadata in the blob covers it, and its address travels in the blob; verify_grant is
one NIXL READ request with a descriptor per span of nearby pages into a registered local slot.

Listening: the UCX plugin's TCP transport listens on an address of every network device UCX may
use (by default the machine's external address too); the backend sets UCX_NET_DEVICES to the
interface holding `host` before the agent exists (libkv.transfer.ucx_env), so it listens on
`host`'s interface only. NIXL's own metadata listener (enable_listen_thread) stays off.

Process exit: a process that created a NIXL UCX agent segfaults at interpreter exit. Call
close() and then libkv.transfer.exit_process(code). Never create an agent in a pytest process.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from base64 import b64decode, b64encode
from dataclasses import dataclass
from typing import Any

import torch

from libkv.pool import KVPool
from libkv.transfer.base import EngineBackend
from libkv.transfer.errors import EngineUnavailable, PeerUnreachable
from libkv.transfer.grants import TAG_NBYTES
from libkv.transfer.hooks import Peer, Transfer
from libkv.transfer.interface import TransferEndpoint, TransferState
from libkv.transfer.ucx_env import bind_ucx_to

_GENTLE_PROGRESS_S = 0.001


def _import_nixl():
    try:
        import nixl_cu12 as nixl_api  # the CPU-usable wheel's import name
    except ImportError:
        try:
            import nixl as nixl_api  # type: ignore[no-redef]
        except ImportError as exc:
            raise EngineUnavailable(
                "the nixl backend needs NIXL: pip install --no-deps nixl-cu12==1.5.1 numpy") from exc
    return nixl_api


@dataclass
class _NixlPeer:
    agent_name: str
    base_addr: int
    nbytes: int
    grants_addr: int
    mem: str = "DRAM"  # where the peer's pool lives (NIXL's memory type) and on which GPU
    dev: int = 0


def _memory_of(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id for a pool on `device`: a CUDA pool is VRAM of its GPU
    (register_memory infers the same from the tensor, and a transfer's descriptors must agree)."""
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


class NixlBackend(EngineBackend):
    """NIXL agent with one plugin (`nixl_backend`, default UCX), host or GPU memory.

    Abort waits (bounded by timeout_s) until the request is no longer in progress and then
    releases it: only then can nothing more land. Releasing a request still in progress (after
    the deadline, peer unresponsive) asks NIXL to cancel it.
    """

    name = "nixl"
    device_memory = True  # the nixl-cu* wheels are CUDA builds: a GPU pool is VRAM in every descriptor
    writes_regions = True

    def __init__(self, *, timeout_s: float = 30.0, host: str = "127.0.0.1", nixl_backend: str = "UCX",
                 agent_name: str = "", num_threads: int = 0, progress_thread: bool = False) -> None:
        super().__init__(timeout_s=timeout_s, host=host)
        self._nixl = _import_nixl()
        self.nixl_backend = nixl_backend
        self.agent_name = agent_name or f"pdserve-{uuid.uuid4().hex[:12]}"
        self.num_threads = num_threads  # UCX plugin worker threads; 0 = the plugin's default
        # NIXL's progress thread spins a whole core even when idle (measured: 98% CPU per
        # process here). Without it, polling a transfer progresses it; host-memory puts over
        # shared memory need nothing from the target. Turn it on for transports that need
        # target-side progress (e.g. UCX over TCP between hosts).
        self.progress_thread = progress_thread
        self._agent: Any = None
        self._reg_descs: Any = None
        self._grant_descs: Any = None
        self._stop_progress = threading.Event()
        self._progress: threading.Thread | None = None
        # NIXL's agent is not thread-safe in its default sync mode; every agent call holds this.
        self._agent_lock = self._lock

    def _engine_register(self, pool: KVPool) -> None:
        bind_ucx_to(self.host)  # before the agent: UCX reads its settings once, at context creation
        config = self._nixl.nixl_agent_config(enable_prog_thread=self.progress_thread,
                                              enable_listen_thread=False, backends=[self.nixl_backend],
                                              num_threads=self.num_threads)
        self._agent = self._nixl.nixl_agent(self.agent_name, config)
        if self.nixl_backend not in self._agent.backends:
            raise EngineUnavailable(f"NIXL plugin {self.nixl_backend!r} is not available; "
                                    f"plugins: {self._agent.plugin_list}")
        self._reg_descs = self._agent.register_memory(pool.as_bytes())
        if self._reg_descs is None:
            raise RuntimeError("NIXL refused to register the KV pool")
        self._grant_descs = self._agent.register_memory(self._require_grants().memory)
        if self._grant_descs is None:
            raise RuntimeError("NIXL refused to register the grant table")
        if not self.progress_thread:
            self._progress = threading.Thread(target=self._progress_gently, name="pdserve-nixl-progress",
                                              daemon=True)
            self._progress.start()

    def _progress_gently(self) -> None:
        """Progress the agent's UCX worker about once a millisecond: the target side of a
        connection must answer UCX's wire-up, and NIXL's own thread would spin a core for it."""
        while not self._stop_progress.wait(_GENTLE_PROGRESS_S):
            with self._agent_lock:
                if self._agent is None:
                    return
                self._agent.get_new_notifs()

    def _engine_blob(self) -> bytes:
        pool = self._require_pool()
        with self._agent_lock:
            metadata = self._agent.get_agent_metadata()
        blob = {"agent": self.agent_name, "metadata": b64encode(metadata).decode(),
                "base": pool.data_ptr(), "nbytes": pool.nbytes, "grants": self._require_grants().address()}
        mem, dev = _memory_of(self._require_pool().device)
        if mem != "DRAM":  # only then: a host pool's blob reads as it always did
            blob.update(mem=mem, dev=dev)
        return json.dumps(blob).encode()

    def _engine_connect(self, endpoint: TransferEndpoint) -> Any:
        try:
            raw = json.loads(endpoint.blob)
            with self._agent_lock:
                name = self._agent.add_remote_agent(b64decode(raw["metadata"]))
                if isinstance(name, bytes):
                    name = name.decode()
        except (ValueError, KeyError) as exc:
            raise PeerUnreachable(f"bad nixl endpoint from {endpoint.host}: {exc}") from exc
        except Exception as exc:
            raise PeerUnreachable(f"nixl could not load agent metadata of {endpoint.host}: {exc}") from exc
        return _NixlPeer(name, int(raw["base"]), int(raw["nbytes"]), int(raw["grants"]),
                         str(raw.get("mem", "DRAM")), int(raw.get("dev", 0)))

    def _engine_disconnect(self, peer: Peer) -> None:
        state: _NixlPeer = peer.engine
        if state is None or self._agent is None:
            return
        if any(p.engine is not None and p.engine.agent_name == state.agent_name
               for p in self._peers.values() if p is not peer):
            return  # another PeerId still talks to the same agent
        with self._agent_lock:
            self._agent.remove_remote_agent(state.agent_name)

    def _engine_write(self, peer: Peer, record: Transfer) -> Any:
        state: _NixlPeer = peer.engine
        base = self._require_pool().data_ptr()
        mem, dev = _memory_of(self._require_pool().device)
        local, remote = [], []
        for run in record.runs:
            src, dst, nbytes = self._run_bytes(run)
            local.append((base + src, nbytes, dev))
            remote.append((state.base_addr + dst, nbytes, state.dev))
        with self._agent_lock:
            local_descs = self._agent.get_xfer_descs(local, mem)
            remote_descs = self._agent.get_xfer_descs(remote, state.mem)
            xfer = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, state.agent_name)
            status = self._agent.transfer(xfer)
        if status == "ERR":
            self._release_quietly(xfer)
            raise PeerUnreachable(f"nixl refused to post a write to {peer.endpoint.host}")
        return xfer

    def _engine_progress(self, record: Transfer) -> TransferState:
        with self._agent_lock:
            status = self._agent.check_xfer_state(record.engine)
        if status == "DONE":
            return TransferState.DONE
        if status == "ERR":
            record.error = PeerUnreachable(f"nixl write {record.handle.transfer_id} to "
                                           f"{record.handle.peer} failed (peer gone?)")
            return TransferState.FAILED
        return TransferState.PENDING

    def _engine_cancel(self, record: Transfer, deadline: float) -> None:
        # Let the request leave PROC first: a put the NIC or kernel already started may still
        # land after a cancel, so releasing a finished request is the only sure stop. Past the
        # deadline the peer is unresponsive; releasing then asks NIXL to cancel what is left.
        xfer = record.engine
        if xfer is None:
            return
        while time.monotonic() < deadline:
            with self._agent_lock:
                status = self._agent.check_xfer_state(xfer)
            if status != "PROC":
                break
            time.sleep(0.0005)
        self._release_quietly(xfer)
        record.engine = None

    def _engine_release_transfer(self, record: Transfer) -> None:
        if record.engine is not None:
            self._release_quietly(record.engine)
            record.engine = None

    # ---- grant reads (verify_grant) ---------------------------------------------------------

    def _engine_read_grants(self, peer: Peer, reads: list[tuple[int, int, int]]) -> Any:
        state: _NixlPeer = peer.engine
        local = [(address, count * TAG_NBYTES, 0) for address, _first, count in reads]
        remote = [(state.grants_addr + first * TAG_NBYTES, count * TAG_NBYTES, 0)
                  for _a, first, count in reads]
        with self._agent_lock:
            xfer = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, "DRAM"),
                                               self._agent.get_xfer_descs(remote, "DRAM"), state.agent_name)
            status = self._agent.transfer(xfer)
        if status == "ERR":
            self._release_quietly(xfer)
            raise PeerUnreachable(f"nixl refused to post a grant read from {peer.endpoint.host}")
        return xfer

    def _engine_read_progress(self, op: Any) -> TransferState:
        with self._agent_lock:
            status = self._agent.check_xfer_state(op)
        return {"DONE": TransferState.DONE, "ERR": TransferState.FAILED}.get(status, TransferState.PENDING)

    def _engine_read_release(self, op: Any) -> None:
        self._release_quietly(op)

    def _release_quietly(self, xfer: Any) -> None:
        with self._agent_lock:
            try:
                xfer.release()
            except Exception:
                pass

    def _engine_close(self) -> None:
        self._stop_progress.set()
        if self._progress is not None:
            self._progress.join(timeout=5)
        if self._agent is None:
            return
        with self._agent_lock:
            for descs in (self._reg_descs, self._grant_descs):
                if descs is not None:
                    try:
                        self._agent.deregister_memory(descs)
                    except Exception:
                        pass
            self._reg_descs = self._grant_descs = None
            self._agent = None
