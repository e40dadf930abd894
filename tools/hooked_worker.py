"""`python -m tools.hooked_worker HOOK... launch-server ARGS`: `pdserve launch-server ARGS` with test
hooks (services/worker/hooks.py) in it. Deployed code reads no test switch: tests and tools that
need to step into a worker start it through here.

Hooks:
  --hold-admission PREFIX   decode holds every request whose room id starts with PREFIX after its
                            KV landed and before its batch takes it, until the request is aborted
                            (tests/e2e/test_abort_window.py lands its abort in that window)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services import launch_server
from services.worker.hooks import WorkerHooks

log = logging.getLogger("pdserve.decode")


def hold_admission(prefix: str):
    """The before_admission hook that holds rooms starting with `prefix` until they are cancelled."""

    async def hold(room: str) -> None:
        if room.startswith(prefix):
            log.info("room %s: held before admission (tools.hooked_worker --hold-admission) until aborted",
                     room)
            await asyncio.Event().wait()  # until cancelled: an Abort, the client gone, shutdown
    return hold


def main(argv: list[str]) -> int:
    hooks_parser = argparse.ArgumentParser(prog="python -m tools.hooked_worker", add_help=False)
    hooks_parser.add_argument("--hold-admission", metavar="PREFIX", default="")
    hook_args, rest = hooks_parser.parse_known_args(argv)
    if not rest or rest[0] != "launch-server":
        hooks_parser.error("expected: HOOK... launch-server ARGS")
    parser = argparse.ArgumentParser(prog="python -m tools.hooked_worker ... launch-server")
    launch_server.add_arguments(parser)
    args = parser.parse_args(rest[1:])
    hooks = WorkerHooks(before_admission=hold_admission(hook_args.hold_admission) if hook_args.hold_admission
                        else None)
    return launch_server.main(args, hooks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
