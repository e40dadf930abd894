"""Ending a process that hosted a transfer engine."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_process(code: int = 0) -> NoReturn:
    """Flush output and end the process now, skipping interpreter teardown.

    NIXL's UCX agent (and UCX contexts in general) crash in their static destructors at
    interpreter exit (rc 139 on this machine). A process that created one must call the
    backend's close() first and then end with this instead of returning from main.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
