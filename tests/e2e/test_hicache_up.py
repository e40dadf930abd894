"""`pdserve up --hicache mooncake`: Mooncake Store's master starts with the deployment, every worker
runs the store tier on it, a prompt computed on one prefill worker is fetched from the store by the
other (round-robin sends the second request there), and Ctrl-C stops all of it, the master last."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.cluster import pdserve_up, wait_until
from tests.e2e.test_gateway_up import free_port
from tests.engine.test_hicache import MASTER
from tools.metrics import scrape, sum_samples

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(not MASTER.exists(),
                                 reason="mooncake_master (the Mooncake wheel) is not installed")]

# Long enough for several full pages of the tiny model's tokenizer whatever the chat template adds.
PROMPT = " ".join(f"word{i} of a shared system prompt" for i in range(40))


def metric(port: int, name: str) -> float:
    return sum_samples(scrape(f"http://127.0.0.1:{port}/metrics", 5.0), name) or 0.0


def test_up_hicache_starts_the_master_shares_pages_and_stops_everything(tiny_model: Path,
                                                                         tmp_path: Path) -> None:
    port = free_port()
    logs = tmp_path / "logs"
    with pdserve_up(["--model-path", str(tiny_model), "--port", str(port), "--num-prefill", "2",
                     "--num-decode", "1", "--policy", "round_robin", "--log-dir", str(logs),
                     "--worker-threads", "1", "--hicache", "mooncake"]) as up:
        output = up.output
        assert "Press Ctrl-C to stop." in output, output
        master = re.search(r"mooncake-master ready on (\S+):(\d+)", output)
        assert master, output
        assert f"KV store 127.0.0.1:{master.group(2)}" in output
        assert (logs / "mooncake-master.log").is_file()
        prefill = {name: int(metrics) for name, metrics in
                   re.findall(r"(prefill-\d) ready on \S+ \(metrics :(\d+)\)", output)}
        assert len(prefill) == 2, output
        for name, metrics_port in prefill.items():
            wait_until(lambda p=metrics_port: metric(p, "pdserve:hicache_store_up") == 1, 60,
                       f"{name}'s store")
        children = up.children
        assert len(children) == 6  # mooncake-master, bootstrap, 2 prefill, decode, gateway
        assert any(child.name() == "mooncake_master" for child in children)

        request = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                   "temperature": 0}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        first = httpx.post(url, json=request, timeout=60)
        assert first.status_code == 200, first.text
        # The first prefill worker's pages reach the store (the write-through is asynchronous).
        wait_until(lambda: sum(metric(p, "pdserve:hicache_written_pages_total")
                               for p in prefill.values()) > 0, 60, "the write-through")
        second = httpx.post(url, json=request, timeout=60)
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        hits = {name: metric(p, "pdserve:hicache_hit_pages_total") for name, p in prefill.items()}
        # the second worker fetched
        assert sorted(hits.values())[0] == 0 and sorted(hits.values())[1] > 0, hits

        rest = up.interrupt()
        assert up.popen.returncode == 0, output + rest
        assert rest.count("stopped ") == 6 and "killed" not in rest, rest
        assert rest.rstrip().splitlines()[-1].strip().startswith("stopped mooncake-master"), rest
        assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)


def test_up_refuses_a_master_port_without_hicache_or_in_use(tiny_model: Path, tmp_path: Path) -> None:
    with pdserve_up(["--model-path", str(tiny_model), "--hicache-master-port", "5000",
                     "--log-dir", str(tmp_path / "logs")], timeout_s=30) as up:
        up.popen.wait(timeout=30)
        assert up.popen.returncode != 0
        assert "--hicache-master-port needs --hicache mooncake" in up.output
    # mooncake_master itself would start on a port another process listens on (SO_REUSEPORT).
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pdserve_up(["--model-path", str(tiny_model), "--hicache", "mooncake",
                         "--hicache-master-port", str(port), "--log-dir", str(tmp_path / "logs")],
                        timeout_s=30) as up:
            up.popen.wait(timeout=30)
            assert up.popen.returncode != 0
            assert f"--hicache-master-port {port} is in use on 127.0.0.1" in up.output
            assert not (tmp_path / "logs").exists()  # refused before starting anything
