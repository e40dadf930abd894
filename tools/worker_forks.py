"""Workers forked from one process that imported them: N simulated workers share the pages of one
import of torch, transformers and pdserve instead of each holding its own.

A simulated worker (`launch-server --engine sim`) spends nearly all of its private memory on its
imports (torch's alone is over 200 MB), not on its work. `ForkServer` starts one *fork server*
process (`python -m tools.worker_forks`), which imports the worker's modules, loads the model
folder's tokenizer once (so the lazily imported tokenizer modules are loaded too), freezes its
objects out of the garbage collector's reach and then forks each worker on request. A fork shares
every page of its parent until one side writes to it (copy-on-write); frozen objects are never
scanned by a child's collector, so their pages stay shared unless the worker itself uses them.

Only a process with a single thread may fork safely (another thread could hold a lock the child
inherits held), so the server refuses to start when its imports left threads behind, and it imports
no transfer engine (Mooncake starts threads on import): each worker imports its own.

Protocol on the server's stdin and stdout, one JSON object per line:
    -> {"args": [...pdserve arguments...], "log": "/path/to/log", "env": {"NAME": "value"}}
    <- {"pid": 1234}
`env` is added to the server's environment; with `"whole_env": true` it is the child's whole
environment instead (what a `subprocess.Popen(env=...)` child would get), and an optional `"cwd"`
is the directory the child runs in.
A child runs `pdserve ARGS` with output to its log, in its own session, and is killed when the
server goes (PR_SET_PDEATHSIG); the server itself goes when its stdin closes or on SIGTERM, after
stopping its children. It reaps each child and writes its exit status (a negative signal number
when killed, as subprocess does) to `LOG.exit`, which `ForkedChild` reads.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType, TracebackType

from tools.launch import Service, _die_with_parent, child_env

# Native thread pools a library would start on import: with one thread the server may fork.
_SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _exit_path(log_path: str) -> str:
    return log_path + ".exit"


# ---------------------------------------------------------------- the fork server (its own process)


def _preload(model_path: str | None) -> None:
    """Import what a simulated worker imports (and its tokenizer's lazy modules) so children share it."""
    import engine.sim.load  # noqa: F401
    import pdserve.cli  # noqa: F401
    import services.launch_server  # noqa: F401
    if model_path:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)


def _run_child(request: dict) -> None:
    """In the forked child: become `pdserve ARGS` and never return."""
    code = 1
    try:
        os.setsid()
        _die_with_parent()
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)  # not the server's request pipe
        os.dup2(null, 0)
        os.close(null)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        if request.get("whole_env"):
            os.environ.clear()
        os.environ.update(request.get("env", {}))
        if request.get("cwd"):
            os.chdir(request["cwd"])
        from pdserve.cli import main
        code = main(list(request["args"])) or 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child must end here whatever happened
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(model_path: str | None) -> int:
    """The fork server's loop (see the module docstring)."""
    _preload(model_path)
    if _threads() != 1:
        print(f"fork server: {_threads()} threads after the imports; refusing to fork", file=sys.stderr)
        return 1
    gc.collect()
    gc.freeze()
    children: dict[int, str] = {}  # pid -> log path
    early: dict[int, int] = {}  # reaped before the loop below recorded them (a child that died at once)

    def record(pid: int, code: int) -> None:
        log_path = children.pop(pid, None)
        if log_path is None:
            early[pid] = code
        else:
            Path(_exit_path(log_path)).write_text(str(code))

    def reap(*_: object) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            record(pid, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))

    def stop(*_: object) -> None:
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while children and time.monotonic() < deadline:
            reap()
            time.sleep(0.05)
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop()
        os._exit(0)

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGTERM, on_term)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        children[pid] = request["log"]
        if pid in early:
            record(pid, early.pop(pid))
        print(json.dumps({"pid": pid}), flush=True)
    stop()
    return 0


# ---------------------------------------------------------------- the launcher's side


class ForkedChild:
    """A forked worker, as tools.launch.Service handles a child process (the subset of
    subprocess.Popen it uses). It is the fork server's child, not ours: its exit status comes from
    the file the server writes when it reaps it."""

    def __init__(self, pid: int, log_path: Path) -> None:
        self.pid = pid
        self._exit_file = Path(_exit_path(str(log_path)))
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._exit_file.exists():
            text = self._exit_file.read_text().strip()
            if text:
                self.returncode = int(text)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Starts the fork server (see the module docstring) and forks `pdserve` services from it.
    A context manager: leaving it stops the server and every child still running; stop the
    services gracefully first (tools.launch.ProcessGroup's exit does, when entered inside this)."""

    def __init__(self, workdir: Path, model_path: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.log_path = workdir / "fork-server.log"
        with open(self.log_path, "w") as log_file:
            args = [sys.executable, "-m", "tools.worker_forks"]
            args += ["--model-path", model_path] if model_path else []
            self.popen = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=log_file, env=child_env({**_SINGLE_THREADED, **self.env}),
                                          text=True, start_new_session=True, preexec_fn=_die_with_parent)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def spawn(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None, *,
              whole_env: bool = False, cwd: str | None = None) -> Service:
        """Fork `pdserve ARGS` without waiting for it to be ready (Service.wait_ready does). `env` is
        added to the server's environment, or with `whole_env` replaces it; `cwd`: the child's
        directory (the server's when None)."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        Path(_exit_path(str(log_path))).unlink(missing_ok=True)
        child_vars = dict(env or {}) if whole_env else {**self.env, **(env or {})}
        request = {"args": list(args), "log": str(log_path), "env": child_vars, "whole_env": whole_env,
                   "cwd": cwd}
        try:
            self.popen.stdin.write(json.dumps(request) + "\n")
            self.popen.stdin.flush()
            answer = self.popen.stdout.readline()  # the imports come first: the first answer waits on them
        except BrokenPipeError:
            answer = ""
        if not answer:
            raise RuntimeError(f"the fork server exited; its log:\n{self.log_path.read_text()[-4000:]}")
        child = ForkedChild(json.loads(answer)["pid"], log_path)
        return Service(name, list(args), child, log_path)

    def close(self) -> None:
        if self.popen.poll() is None:
            assert self.popen.stdin is not None
            self.popen.stdin.close()  # the server stops its children and exits
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="fork server of pdserve workers (tools/worker_forks.py)")
    parser.add_argument("--model-path", default=None, help="a model folder whose tokenizer to load once")
    sys.exit(serve(parser.parse_args().model_path))
