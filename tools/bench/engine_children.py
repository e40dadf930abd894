"""The child processes of `pdserve bench engine`: one per system, driven a round at a time over a
pipe (pdserve, HF) or over JSON lines to another environment's Python (vLLM, tools/bench/peer_vllm.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import tempfile
from pathlib import Path

from tools.bench.engine_systems import peak_rss_mib


def _serve(system_cls, args, conn) -> None:
    """Child process: load a system, then run one round per request until told to stop."""
    system = system_cls(*args)
    conn.send("ready")
    while True:
        index = conn.recv()
        if index is None:
            system.close()
            conn.send({"peak_rss_mib": peak_rss_mib()})
            return
        conn.send(system.round(index))


class SystemChild:
    def __init__(self, system_cls, args, env: dict[str, str] | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(system_cls, args, child_conn), daemon=True)
        saved = {key: os.environ.get(key) for key in env or {}}
        os.environ.update(env or {})  # a spawned child starts with the parent's environment
        try:
            self.process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        child_conn.close()
        self.name = system_cls.__name__

    def call(self, message):
        self.conn.send(message)
        try:
            return self.conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"{self.name} child process died") from exc

    def wait_ready(self) -> None:
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{self.name} did not start")

    def stop(self) -> float:
        peak = self.call(None)["peak_rss_mib"]
        self.process.join(timeout=60)
        return peak


class PeerChild:
    """vLLM in a process of `peer_python` speaking tools/bench/peer_vllm.py's JSON-lines protocol."""

    SCRIPT = Path(__file__).with_name("peer_vllm.py")
    PREFIX = "PDSERVE-PEER "

    def __init__(self, peer_python: str, model: str, prompts: list[list[int]], new_tokens: int, threads: int,
                 dtype: str) -> None:
        self.name = "vllm"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pdserve-bench-vllm-", suffix=".log",
                                               delete=False)
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0")
        self.process = subprocess.Popen([peer_python, str(self.SCRIPT)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                        cwd=tempfile.gettempdir())
        self._send({"model": model, "prompts": prompts, "new_tokens": new_tokens, "dtype": dtype,
                    "threads": threads})

    def _send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _receive(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(self.PREFIX):
                reply = json.loads(line[len(self.PREFIX):])
                if "error" in reply:
                    raise RuntimeError(f"vLLM peer failed (log: {self.log.name}):\n{reply['error']}")
                return reply
            self.log.write(line)  # vLLM's own log lines
        raise RuntimeError(f"vLLM peer exited with {self.process.wait()} (log: {self.log.name})")

    def wait_ready(self) -> None:
        self._receive()

    def call(self, index: int) -> dict:
        self._send({"round": index})
        return self._receive()

    def stop(self) -> float | None:
        try:
            self._send({"stop": True})
            self._receive()
            self.process.wait(timeout=60)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self.log.close()
        return None  # vLLM's work happens in its own worker processes: not measured here
