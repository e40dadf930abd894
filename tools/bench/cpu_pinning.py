"""Pinning a bench's processes to CPUs, so the part it measures has a core to itself.

On this 2-core machine a bench that runs what it measures (one gateway) beside what loads it
(workers, clients) would otherwise measure the OS scheduler's sharing too: in production those run
on other machines. Affinity is per thread on Linux, so every thread of the process and its children
is pinned; threads started later inherit their creator's.
"""

from __future__ import annotations

import os

import psutil


def pin(process: psutil.Process, cpus: list[int]) -> None:
    """Every thread of `process` and its children to `cpus`."""
    for proc in [process, *process.children(recursive=True)]:
        try:
            for thread in proc.threads():
                os.sched_setaffinity(thread.id, cpus)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue


def split_cpus() -> tuple[list[int], list[int]] | None:
    """(the first CPU, the others) of this process's CPUs; None with only one."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[:1], cpus[1:]) if len(cpus) > 1 else None
