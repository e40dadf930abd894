"""StepProfiler: a torch profiler trace of a bounded number of the engine's prefill or decode steps.

SGLang's `--profile-prefill` / `--profile-decode` (EngineConfig's profile_* fields, also set by
PDSERVE_PROFILE_PREFILL=1 / PDSERVE_PROFILE_DECODE=1). The engine thread hands every step to `run`
while `active` is true: at the first step of a profiled kind the profiler starts, each step is
wrapped in a `record_function` slice naming its kind and size ("prefill step 3: 2 chunks, 130
tokens", "decode step 7: batch 8"), and after `steps` steps of a profiled kind it stops, writes a
Chrome trace JSON (opens in https://ui.perfetto.dev) into `directory` and turns itself off for the
rest of the process, so an unprofiled step costs the engine one boolean check.

A step with prefill chunks counts as a prefill step even when decodes ride along in it. Steps of the
other kind that run while the profiler records are in the trace too, labelled with their kind but
not counted. One engine per process is profiled (DP attention's member engines: the first to start).
Profiling must never break serving: a profiler that fails to start or to write is logged as a
warning and profiling stops; the step itself always runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine.config import EngineConfig
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

PERFETTO_URL = "https://ui.perfetto.dev"
# torch's profiler is one per process, and a second one started beside it corrupts both traces.
# DP attention runs several member engines (each with a StepProfiler) in one process: the first to
# start records, the others turn off.
_ONE_PER_PROCESS = threading.Lock()


def step_kind(batch: SchedulerOutput) -> str:
    """"prefill" when the step runs any prompt chunk (mixed steps included), else "decode"."""
    return "prefill" if batch.extends else "decode"


def step_label(kind: str, index: int, batch: SchedulerOutput) -> str:
    """The trace slice of one step: its kind, its index in the trace and what it computes."""
    if kind == "decode":
        return f"decode step {index}: batch {len(batch.decodes)}"
    tokens = sum(len(c.token_ids) for c in batch.extends)
    label = f"prefill step {index}: {_count(len(batch.extends), 'chunk')}, {_count(tokens, 'token')}"
    return label + (f", {_count(len(batch.decodes), 'decode')}" if batch.decodes else "")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


class StepProfiler:
    """Records the first `steps` steps of the profiled kinds into one trace file (module docstring).

    Only the engine thread calls `run`, and only while `active`; `Engine.step` is the one caller.
    """

    def __init__(self, kinds: frozenset[str], steps: int, directory: str, device: torch.device) -> None:
        self.kinds = kinds
        self.steps = steps
        self.directory = Path(directory)
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.active = bool(kinds) and steps > 0
        self._profiler: profile | None = None
        self._seen = 0  # steps in the trace, of any kind: the labels' index
        self._counted = 0  # steps of a profiled kind in the trace

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> StepProfiler:
        kinds = frozenset(kind for kind, on in (("prefill", config.profile_prefill),
                                                ("decode", config.profile_decode)) if on)
        return cls(kinds, config.profile_steps, config.profile_dir, device)

    def run(self, batch: SchedulerOutput, step: Callable[[SchedulerOutput], bool]) -> bool:
        """`step(batch)`, recorded when the trace is running or this step starts it."""
        kind = step_kind(batch)
        if self._profiler is None and (kind not in self.kinds or not self._start()):
            return step(batch)
        self._seen += 1
        with record_function(step_label(kind, self._seen, batch)):
            result = step(batch)
        if kind in self.kinds:
            self._counted += 1
            if self._counted >= self.steps:
                self._finish()
        return result

    def _start(self) -> bool:
        if not _ONE_PER_PROCESS.acquire(blocking=False):
            self._turn_off("another engine of this process is being profiled")
            return False
        profiler = None
        try:
            profiler = profile(activities=self.activities)
            profiler.start()
        except Exception as exc:
            _stop_quietly(profiler)
            _ONE_PER_PROCESS.release()
            self._turn_off(f"could not start the torch profiler: {exc!r}")
            return False
        self._profiler = profiler
        log.info("profiling the next %d %s steps", self.steps, " and ".join(sorted(self.kinds)))
        return True

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        self.active = False
        name = f"{'-'.join(sorted(self.kinds))}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.trace.json"
        path = self.directory / name
        try:
            if profiler is None:  # _finish runs only after _start set one
                raise RuntimeError("no profiler is running")
            profiler.stop()
            self.directory.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
        except Exception as exc:
            self._turn_off(f"could not write the profile to {path}: {exc!r}")
            return
        finally:
            _ONE_PER_PROCESS.release()
        log.info("profile of %d steps written to %s: open it at %s (Open trace file)", self._seen,
                 path.resolve(), PERFETTO_URL)

    def _turn_off(self, why: str) -> None:
        log.warning("%s; profiling is off for the rest of this process", why)
        self.active = False


def _stop_quietly(profiler: profile | None) -> None:
    """Stop a profiler whose start failed halfway, if it runs: the start's error is the one to report."""
    try:
        if profiler is not None:
            profiler.stop()
    except Exception:
        pass  # it never started, or already stopped
