"""`pdserve bench chaos`: faults against a real PD deployment under steady load, one row per
(scenario, backend), exit code 1 if any row fails.

    pdserve bench chaos --json                                  # every scenario on mooncake and nixl
    pdserve bench chaos --backends nixl --scenarios kill-decode,disconnects --duration 6
    pdserve bench chaos --backends mooncake --soak 30m --seed 7   # random faults for 30 min, one row

Every child gets a fresh random PDSERVE_CLUSTER_SECRET and PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL.
Logs: one file per process under --log-dir (or a temporary folder, kept only when a row fails).
Ctrl-C or SIGTERM stops every process and removes every network namespace before exiting.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from pdserve.config_flags import add_config_arguments, config_from_args
from tools.chaos.config import ChaosConfig
from tools.chaos.prompts import make_prompts
from tools.chaos.report import Row, to_json, to_table
from tools.chaos.runner import run_backend, say
from tools.chaos.scenarios import SCENARIOS, select
from tools.chaos.soak import soak_backend
from tools.up import ensure_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ChaosConfig)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    parser.add_argument("--list-scenarios", action="store_true", help="list the scenarios and exit")


def child_env(cfg: ChaosConfig) -> dict[str, str]:
    """Added to every child's environment."""
    return {"PDSERVE_CLUSTER_SECRET": secrets.token_hex(32),
            "PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL": str(cfg.heartbeat_interval)}


async def run_all(cfg: ChaosConfig, log_root: Path) -> list[Row]:
    scenarios = select(cfg.scenarios)
    prompts = make_prompts(cfg.seed)
    env = child_env(cfg)
    rows: list[Row] = []
    if cfg.soak:
        for backend in cfg.backend_list:
            rows.append(await soak_backend(backend, cfg, scenarios, prompts, log_root, env))
        return rows
    references: dict[str, list[list[str]]] = {}
    for backend in cfg.backend_list:
        result = await run_backend(backend, cfg, scenarios, prompts, log_root, env)
        rows += result.rows
        references[backend] = result.references
    distinct = {tuple(texts) for runs in references.values() for texts in runs}
    if len(distinct) > 1:
        say(f"note: the fault-free answers differ between deployments: {sorted(references)}")
    return rows


def main(args: argparse.Namespace) -> int:
    if args.list_scenarios:
        for scenario in SCENARIOS:
            print(f"{scenario.name:22} {scenario.about}")
        return 0
    try:
        cfg = config_from_args(ChaosConfig, args)
        select(cfg.scenarios)
    except ValueError as exc:
        print(f"pdserve bench chaos: {exc}", file=sys.stderr)
        return 2
    ensure_model(Path(cfg.model_path))
    log_root = cfg.log_path or Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    # SIGTERM unwinds like Ctrl-C: every `with` block stops its processes and removes its namespace.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        rows = asyncio.run(run_all(cfg, log_root))
    except KeyboardInterrupt:
        say(f"interrupted; every process stopped; logs in {log_root}")
        return 130
    print(to_json(rows) if args.json else to_table(rows))
    failed = any(not row.ok for row in rows)
    if failed or cfg.log_path:
        say(f"logs in {log_root}")
    else:
        shutil.rmtree(log_root, ignore_errors=True)
    return 1 if failed else 0
