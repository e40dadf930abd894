"""The serving-cost account of one benchmark run: what each token cost inside the engine against
what the client saw, and where the CPU went.

Around a run (after the warm-up) it reads the decoding worker's step totals
(pdserve:engine_decode_token_seconds_total, engine_decode_tokens_total and engine_steps_total:
engine/step_clock.py) and the CPU time of
every process of the deployment (/proc: the process and its descendants, e.g. tensor-parallel
ranks). Then:
- account TPOT = the mean, over the tokens decoded in the run, of the step that produced each one
  (engine_decode_token_seconds_total / engine_decode_tokens_total): the time between a request's
  tokens if it paid only the engine's decode steps and the prompt chunks that ran inside them (its
  share of the other requests' prefill). Steps with prompt chunks only (no request was decoding)
  count for no token.
- measured TPOT / account TPOT: how much of a token's time is spent outside the engine's steps
  (the gateway, gRPC, detokenizing, SSE, event loops; and on a shared machine, the prefill worker's
  use of the same cores).
- CPU milliseconds per generated token of each process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tools.bench.serving.deployments import Deployment
from tools.metrics import sum_samples

_TICKS = os.sysconf("SC_CLK_TCK")
_PACED = ("decode", "mixed")  # step kinds a decoding request's tokens wait for


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            tree.setdefault(parent, []).append(int(entry.name))
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (every thread of each)."""
    tree, total, todo = _children(), 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of stat)
        todo.extend(tree.get(current, ()))
    return total


def _pacing_worker(deployment: Deployment) -> str:
    return "decode" if "decode" in deployment.workers else "worker"


@dataclass
class _Reading:
    cpu: dict[str, float]
    token_seconds: float  # each decoded token's step seconds, summed
    tokens: float  # tokens decoded by the engine
    steps: float  # steps with decode rows
    at: float


class ServingAccount:
    """`start()` right before the measured requests, `stop()` right after; `stop` returns the account."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self._before: _Reading | None = None

    def _read(self) -> _Reading:
        services = {"gateway": self.deployment.gateway, **self.deployment.workers}
        samples = services[_pacing_worker(self.deployment)].metrics()
        seconds = sum_samples(samples, "pdserve:engine_decode_token_seconds_total") or 0.0
        tokens = sum_samples(samples, "pdserve:engine_decode_tokens_total") or 0.0
        steps = sum(sum_samples(samples, "pdserve:engine_steps_total", kind=k) or 0.0 for k in _PACED)
        return _Reading({name: cpu_seconds(s.pid) for name, s in services.items()}, seconds, tokens, steps,
                        time.monotonic())

    def start(self) -> None:
        self._before = self._read()

    def stop(self, generated_tokens: int, measured_tpot_ms: float | None) -> dict:
        assert self._before is not None, "start() first"
        after, before = self._read(), self._before
        steps, decoded = after.steps - before.steps, after.tokens - before.tokens
        account_ms = (after.token_seconds - before.token_seconds) / decoded * 1e3 if decoded else None
        tokens = max(generated_tokens, 1)
        return {
            "pacing_worker": _pacing_worker(self.deployment),
            "engine_steps": int(steps),
            "account_tpot_ms": account_ms,
            "measured_tpot_ms": measured_tpot_ms,
            "measured_over_account": (measured_tpot_ms / account_ms
                                      if account_ms and measured_tpot_ms else None),
            "cpu_ms_per_token": {name: (after.cpu[name] - before.cpu[name]) / tokens * 1e3
                                 for name in after.cpu},
            "wall_s": after.at - before.at,
        }


def account_table(rows: dict[str, dict]) -> str:
    """Markdown: one row per deployment (its account), CPU ms per token of each of its processes."""
    lines = ["| deployment | measured TPOT ms | account TPOT ms | measured / account "
             "| CPU ms per generated token |",
             "|---|---|---|---|---|"]
    for name, row in rows.items():
        account = row.get("account_tpot_ms")
        ratio = row.get("measured_over_account")
        cpu = ", ".join(f"{process} {ms:.2f}" for process, ms in row["cpu_ms_per_token"].items())
        lines.append(f"| {name} | {row['measured_tpot_ms']:.1f} | {account:.1f} | {ratio:.2f} | {cpu} |"
                     if account and ratio else f"| {name} | {row['measured_tpot_ms']} | - | - | {cpu} |")
    return "\n".join(lines)
