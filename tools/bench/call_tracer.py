"""Run a pdserve service with a profiler that records which source files' functions it calls.

`python -m tools.bench.call_tracer OUT [PYTHON -m] pdserve ARGS...` runs `pdserve ARGS` in this
process (the launcher's wrapper form: tools.launch puts `PYTHON -m pdserve` after the wrapper).
SIGUSR1 clears the record and starts recording; SIGUSR2 stops and writes the recorded file names,
one per line, to OUT. The hook is installed before the service starts any thread, so every thread
(the engine's, transfer queues, gRPC handlers) is covered. Used by `pdserve bench request-path`.
"""

from __future__ import annotations

import runpy
import signal
import sys
import threading
from types import FrameType


class CallRecorder:
    """The profile hook and the two signal handlers that switch it on and off."""

    def __init__(self, out_path: str) -> None:
        self.out_path = out_path
        self.recording = False
        self.files: set[str] = set()

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if self.recording and event == "call":
            self.files.add(frame.f_code.co_filename)

    def start(self, *_: object) -> None:
        self.files.clear()
        self.recording = True

    def stop(self, *_: object) -> None:
        self.recording = False
        with open(self.out_path, "w") as out:
            out.write("\n".join(sorted(self.files)))


def service_argv(argv: list[str]) -> list[str]:
    """The pdserve arguments in `argv` (everything after the word `pdserve`)."""
    if "pdserve" not in argv:
        raise SystemExit("usage: python -m tools.bench.call_tracer OUT [PYTHON -m] pdserve ARGS...")
    return argv[argv.index("pdserve") + 1:]


def main() -> None:
    recorder = CallRecorder(sys.argv[1])
    args = service_argv(sys.argv[2:])
    signal.signal(signal.SIGUSR1, recorder.start)
    signal.signal(signal.SIGUSR2, recorder.stop)
    threading.setprofile(recorder.hook)
    sys.setprofile(recorder.hook)
    sys.argv = ["pdserve", *args]
    runpy.run_module("pdserve", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
