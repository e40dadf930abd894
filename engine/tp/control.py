"""RankControl: rank 0's side-channel to each follower, for work outside the step loop.

The step loop (engine.tp.runner) owns the torch.distributed group and runs only on the engine
thread; KV transfers are driven from the worker's other threads (transfer queues, gRPC handlers)
at any time. So each follower also keeps one authenticated local socket to rank 0
(multiprocessing.connection) on which rank 0 calls named methods of the follower's handler object
(libkv.transfer.tensor_parallel.RankTransfer) and gets the result or the exception back: a
RankControl is the libkv.rank_channel.RankChannel libkv drives the follower's pool and transfer
engine through. Calls on one connection are serialized; they are short (the transfer engines' own
calls return at once).
"""

from __future__ import annotations

import logging
import pickle
import secrets
import threading
from multiprocessing.connection import Client, Connection, Listener

from libkv.rank_channel import RankCallFailed

log = logging.getLogger(__name__)


class ControlListener:
    """Rank 0: listens for the followers' control connections, on loopback unless other nodes' ranks
    must reach it (then on the --dist-init-addr host)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener((host, 0), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address

    def accept(self, num_followers: int) -> dict[int, RankControl]:
        """Wait for every follower's connection (each says its rank first)."""
        controls: dict[int, RankControl] = {}
        while len(controls) < num_followers:
            conn = self._listener.accept()
            rank = conn.recv()
            controls[rank] = RankControl(rank, conn)
        self._listener.close()
        return controls


class RankControl:
    """Rank 0's handle on one follower: `call(method, *args)` runs `handler.method(*args)` there
    (a libkv.rank_channel.RankChannel)."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank = rank
        self._conn = conn
        self._lock = threading.Lock()

    def call(self, method: str, *args: object) -> object:
        with self._lock:
            try:
                self._conn.send((method, args))
                status, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise RankCallFailed(f"tp rank {self.rank} is gone ({method}): {exc}") from None
        if status == "ok":
            return value
        if isinstance(value, BaseException):
            raise value
        type_name, message, detail = value
        raise RankCallFailed(f"tp rank {self.rank}: {message}", type_name, detail)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def connect_to_rank0(address: tuple[str, int], authkey: bytes, rank: int) -> Connection:
    conn = Client(address, authkey=authkey)
    conn.send(rank)
    return conn


def serve(conn: Connection, handler: object) -> None:
    """A follower's loop (in its own thread): answer rank 0's calls until the connection closes."""
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, object] = ("ok", getattr(handler, method)(*args))
        except Exception as exc:
            reply = ("error", _portable(exc))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


def _portable(exc: Exception) -> object:
    """The exception itself if it survives pickling (so rank 0 re-raises the same type), else
    (type name, message, its `refusal` if any)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return type(exc).__name__, str(exc), getattr(exc, "refusal", None)
