"""Simulated workers forked from one fork server (tools/worker_forks.py), as `pdserve bench fleet`
starts them: they serve PD exactly as workers started alone (the simulator's token function through
a real Mooncake transfer) while sharing the server's import of torch and the rest.

The memory bound: a simulated worker started alone holds 200-290 MB of private memory (USS), nearly
all of it its imports; forked, 30-45 MB after serving. 120 MB separates the two with room to spare.
"""

from __future__ import annotations

import signal

import psutil
import pytest
from transformers import AutoTokenizer

from engine.models.config import ModelConfig
from engine.sim.load import sim_vocabulary
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_sim_engine import NEW_TOKENS, SIM, expected_tokens
from tests.e2e.worker_client import run_all
from tools.worker_forks import ForkServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PRIVATE_MIB_BOUND = 120
LENGTHS = [1, 16, 17, 100]


def test_forked_sim_pair_serves_pd_with_little_private_memory(cluster: Cluster, tiny_model, tmp_path):
    vocabulary = sim_vocabulary(ModelConfig.from_dir(tiny_model),
                                AutoTokenizer.from_pretrained(str(tiny_model)))
    prompts = [[10 + (7 * i + n) % 3000 for i in range(n)] for n in LENGTHS]
    bootstrap = cluster.bootstrap()
    with ForkServer(tmp_path / "forks", str(tiny_model)) as forks:
        spawned = [forks.spawn(role, worker_args(tiny_model, role, backend="mooncake", bootstrap=bootstrap,
                                                 extra=SIM), tmp_path / f"{role}.log")
                   for role in ("prefill", "decode")]
        cluster.procs += spawned
        prefill, decode = (proc.wait_ready(180) for proc in spawned)
        pd = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
        for n, prompt, result in zip(LENGTHS, prompts, pd, strict=True):
            assert result.code is None, (n, result.details)
            assert result.tokens == expected_tokens(prompt, vocabulary), f"{n}-token prompt"
        assert prefill.metric("pdserve:kv_transfer_bytes_total") > 0
        for proc in (prefill, decode):
            wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                       f"{proc.name}'s pages to be idle")
            private_mib = psutil.Process(proc.pid).memory_full_info().uss / (1 << 20)
            assert private_mib < PRIVATE_MIB_BOUND, f"{proc.name}: {private_mib:.0f} MiB private"

        # A child's exit status reaches its Service: a refused flag, and a clean stop on SIGTERM.
        refused = forks.spawn("refused", ["launch-server", "--no-such-flag"], tmp_path / "refused.log")
        assert refused.popen.wait(timeout=60) == 2
        assert prefill.kill(signal.SIGTERM) and prefill.popen.returncode == 0
