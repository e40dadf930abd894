"""One row per (scenario, backend): what the clients saw, what the workers kept, and the verdict.

Fields (the JSON keys):
- sent, succeeded, failed_clear, failed_unclear, hung, wrong: the steady load's requests during the
  scenario (load.py, client.py). `errors` counts failures by kind, `examples` shows one of each,
  `hung_details` says of each hung request whether it was answered late, how, or never.
- pages_leaked: KV pages still in use after the settle period on the surviving workers, above what
  each held when the scenario started (0 for a worker started during it); `pages_in_use` has the
  absolute values per worker (idle value 0).
- gateway_retries: attempts the gateway retried on another worker during the scenario, by reason
- gateway_migrations: streams the gateway continued on another pair after their decode failed
  mid-stream (request migration), by reason
  (clients do not see them; they are problems where every worker stayed up).
- leak_detections: growth of the workers' `pdserve:kv_leak_detections_total` during the scenario
  (null where no worker exposes it).
- recovered / not_recovered: every service alive and every worker served new requests afterwards;
  recovery_failed: requests that failed after the fault was over.
- faults: soak mode only (tools/chaos/soak.py): the faults injected, by scenario.
- problems: why the row fails; ok: no problems. A skipped row (skipped: the reason) is ok.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Row:
    """The result of one scenario on one backend."""

    scenario: str
    backend: str
    sent: int = 0
    succeeded: int = 0
    failed_clear: int = 0
    failed_unclear: int = 0
    hung: int = 0
    wrong: int = 0
    pages_leaked: int = 0
    pages_in_use: dict[str, float] = field(default_factory=dict)
    leak_detections: float | None = None
    gateway_retries: dict[str, int] = field(default_factory=dict)
    gateway_migrations: dict[str, int] = field(default_factory=dict)
    recovered: bool = True
    not_recovered: list[str] = field(default_factory=list)
    recovery_failed: int = 0
    disconnects: dict[str, int] | None = None
    faults: dict[str, int] | None = None
    errors: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    hung_details: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def to_json(rows: Sequence[Row]) -> str:
    return json.dumps([row.as_dict() for row in rows], indent=1)


_COLUMNS = ("scenario", "backend", "sent", "ok", "clear", "unclear", "hung", "wrong", "leaked", "detect",
            "recovered", "verdict")


def _cells(row: Row) -> list[str]:
    if row.skipped:
        return [row.scenario, row.backend, *["-"] * 9, "skipped"]
    detections = "-" if row.leak_detections is None else f"{row.leak_detections:g}"
    return [row.scenario, row.backend, str(row.sent), str(row.succeeded), str(row.failed_clear),
            str(row.failed_unclear), str(row.hung), str(row.wrong), str(row.pages_leaked), detections,
            "yes" if row.recovered else "NO", "pass" if row.ok else "FAIL"]


def to_table(rows: Sequence[Row]) -> str:
    """A plain-text table, then one line per problem, error kind and note of each row."""
    grid = [list(_COLUMNS), *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in grid) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
             for line in grid]
    for row in rows:
        label = f"{row.scenario}/{row.backend}"
        if row.skipped:
            lines.append(f"- {label}: skipped: {row.skipped}")
        lines += [f"- {label}: {problem}" for problem in row.problems]
        if row.gateway_retries:
            lines.append(f"  {label} gateway retries: {row.gateway_retries}")
        if row.faults is not None:
            lines.append(f"  {label} faults: {sum(row.faults.values())} "
                         f"({', '.join(f'{name} x{n}' for name, n in sorted(row.faults.items())) or 'none'})")
        if row.gateway_migrations:
            lines.append(f"  {label} gateway migrations: {row.gateway_migrations}")
        if row.errors:
            kinds = ", ".join(f"{kind} x{count}"
                              for kind, count in sorted(row.errors.items(), key=lambda kv: -kv[1]))
            lines.append(f"  {label} failures: {kinds}")
        if "wrong" in row.examples:
            lines.append(f"  {label} wrong: {row.examples['wrong']}")
        if row.hung_details:
            shown = "; ".join(row.hung_details[:4]) + (" ..." if len(row.hung_details) > 4 else "")
            lines.append(f"  {label} hung: {shown}")
        lines += [f"  {label} note: {note}" for note in row.notes]
    return "\n".join(lines)


def markdown_table(rows: Sequence[Row]) -> str:
    """The table as Markdown, as docs/benchmarks-chaos.md shows it."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)
