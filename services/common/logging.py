"""Log set-up shared by every pdserve process: `[YYYY-mm-dd HH:MM:SS] message` on stdout."""

from __future__ import annotations

import logging
import sys

from pdserve import envs

LOG_FORMAT = "[%(asctime)s] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def setup_logging(service_name: str) -> logging.Logger:
    """Configure the root logger once for this process and return the service's logger.

    Called by a service's `main` before anything logs, never on import. Lines go to stdout so
    that launchers and tests read one stream (the ready line with the bound port included).
    The level comes from PDSERVE_LOG_LEVEL. Calling it again replaces the handler instead of
    adding a second one (tests start several services in one process).
    """
    level_name = envs.LOG_LEVEL.get().upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ValueError(f"{envs.LOG_LEVEL.name}={level_name!r} is not a log level")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_pdserve", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler._pdserve = True  # type: ignore[attr-defined]  # marks the handler this function owns
    root.addHandler(handler)
    root.setLevel(level)
    return logging.getLogger(f"pdserve.{service_name}")
