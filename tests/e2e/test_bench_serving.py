"""Smoke runs of `pdserve bench serving` and `pdserve bench pd-vs-colocated`: short, real processes,
no timing assertions; they must finish, print the report and write the JSON and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.cluster import Cluster, worker_args

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def pdserve(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.long
def test_bench_serving_against_a_gateway_writes_report_json_and_png(cluster: Cluster, tiny_model, tmp_path):
    worker = cluster.start("colocated", worker_args(tiny_model, "null"))
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--worker", worker.address])
    url = f"http://{gateway.address}"
    out = tmp_path / "out"
    done = pdserve("bench", "serving", "--base-url", url, "--model", str(tiny_model),
                   "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
                   "--num-prompts", "6", "--request-rate", "20", "--max-concurrency", "4",
                   "--slo-ttft-ms", "5000", "--slo-itl-ms", "1000", "--output-dir", str(out),
                   "--disable-tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "============ Serving Benchmark Result ============" in done.stdout
    assert "Request goodput (req/s):" in done.stdout
    result = json.loads((out / "serving.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] > 0 and len(result["requests"]) == 6
    for key in ("request_throughput", "mean_ttft_ms", "p99_itl_ms", "median_e2e_latency_ms", "goodput"):
        assert key in result
    assert (out / "serving.png").read_bytes().startswith(PNG_MAGIC)

    # a mixed workload and a ShareGPT file through the same flags
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [
        {"from": "human", "value": f"Tell me about item number {i} and why it matters so much."},
        {"from": "gpt", "value": "It matters because of many reasons, the first of which is this."}]}
        for i in range(4)]))
    done = pdserve("bench", "serving", "--base-url", url, "--tokenizer", str(tiny_model),
                   "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), "--num-prompts", "3",
                   "--output-dir", str(out), "--tag", "sg", "--disable-tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "sg.json").read_text())["completed"] == 3
    done = pdserve("bench", "serving", "--base-url", url, "--model", str(tiny_model), "--workload",
                   "bg: in=16 out=8 n=4 concurrency=2; long: in=200 out=2 n=2 rate=10",
                   "--output-dir", str(out), "--tag", "mix", "--disable-tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Class bg" in done.stdout and "Class long" in done.stdout
    assert set(json.loads((out / "mix.json").read_text())["per_class"]) == {"bg", "long"}


@pytest.mark.long
def test_bench_serving_on_the_chat_endpoint_generates_every_token_asked(cluster: Cluster, tiny_model,
                                                                         tmp_path):
    """Random prompts as text to /v1/chat/completions, after a warm-up of other prompts: every request
    ends, with the tokens asked for counted from the stream's logprobs as the server's usage says."""
    worker = cluster.start("colocated", worker_args(tiny_model, "null"))
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--worker", worker.address])
    out = tmp_path / "out"
    done = pdserve("bench", "serving", "--base-url", f"http://{gateway.address}", "--model", str(tiny_model),
                   "--endpoint", "chat", "--random-input-len", "48", "--random-output-len", "8",
                   "--random-range-ratio", "1", "--num-prompts", "5", "--max-concurrency", "3",
                   "--warmup-requests", "2", "--output-dir", str(out), "--tag", "chat", "--disable-tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "chat.json").read_text())
    assert result["endpoint"] == "/v1/chat/completions" and result["warmup_requests"] == 2
    assert result["completed"] == 5 and result["failed"] == 0 and len(result["requests"]) == 5
    for request in result["requests"]:
        assert request["ok"] and request["output_tokens"] == request["output_len"] == 8, request
        assert len(request["itl_ms"]) == 7, request  # the stream's tokens, counted from its logprobs
        assert request["prompt_tokens"] > 0, request  # the server's count, chat template included


@pytest.mark.parametrize("args, message", [
    (["--workload", "bg: in=1 out=1 n=1"], "exactly one of rate="),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent.json"], "No such file"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--slo-itl-ms", "-1"], "--slo-itl-ms must be > 0"),
    (["--warmup-requests", "-1"], "--warmup-requests must be >= 0"),
])
def test_bad_input_gets_a_clear_error(tiny_model, args, message):
    done = pdserve("bench", "serving", "--base-url", "http://127.0.0.1:9", "--model", str(tiny_model), *args,
                   timeout_s=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.long
def test_pd_vs_colocated_smoke_writes_json_and_png(tiny_model, tmp_path):
    out = tmp_path / "out"
    done = pdserve("bench", "pd-vs-colocated", "--model-path", str(tiny_model), "--dtype", "float32",
                   "--transfer-backend", "mooncake", "--num-pages", "512", "--request-rates", "4",
                   "--long-rate", "2", "--duration", "1.5", "--short-output-len", "8",
                   "--long-input-len", "300", "--local-prefill-max-tokens", "32", "--output-dir", str(out),
                   "--log-dir", str(tmp_path / "logs"), "--disable-tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "pd_vs_colocated.json").read_text())
    assert {row["deployment"] for row in summary["rows"]} == {"colocated", "pd", "pd+conditional"}
    assert {r["deployment"] for r in summary["ratios"]} == {"pd", "pd+conditional"}
    assert set(summary["placement"]) == {"colocated", "pd", "pd+conditional"}
    assert (out / "pd_vs_colocated.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "pd-conditional-rate4.png").read_bytes().startswith(PNG_MAGIC)
    assert "ratios to colocated" in done.stdout


@pytest.mark.long
def test_serving_vs_vllm_smoke_reports_tpot_against_the_engine_step(tiny_model, tmp_path):
    out = tmp_path / "out"
    common = ("--model-path", str(tiny_model), "--dtype", "float32", "--transfer-backend", "mooncake",
              "--num-pages", "256", "--input-len", "16", "--output-len", "6", "--num-prompts", "3",
              "--max-concurrency", "2", "--rounds", "1", "--output-dir", str(out))
    done = pdserve("bench", "serving-vs-vllm", *common, "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "serving_vs_vllm.json").read_text())
    assert [row["deployment"] for row in summary["rows"]] == ["colocated", "pd"]
    # vllm bench serve's load: the chat endpoint, a warm-up pass of --max-concurrency other prompts first
    assert summary["load"]["endpoint"] == "/v1/chat/completions"
    assert summary["load"]["warmup"] == {"prompts": 2, "output_len": 16}
    for tag in ("colocated-round1", "pd-round1"):
        run = json.loads((out / f"{tag}.json").read_text())
        assert run["warmup_requests"] == 2 and run["completed"] == 3
        assert all(r["output_tokens"] == 6 and r["prompt_tokens"] > 0
                   for r in run["requests"]), run["requests"]
    for row in summary["rows"]:
        assert row["engine_step_ms"] > 0 and row["tpot_over_step"] > 0 and len(row["request_throughput"]) == 1
    assert "| deployment | req/s" in done.stdout
    # The serving-cost account of each run: engine-only TPOT from the decoding worker's step totals,
    # and CPU per token of every process (gateway; colocated worker, or prefill and decode).
    accounts = summary["accounts"]
    assert set(accounts) == {"colocated, round 1", "pd, round 1"}
    for name, account in accounts.items():
        assert (account["engine_steps"] > 0 and account["account_tpot_ms"] > 0
                and account["measured_over_account"] > 0)
        processes = ({"gateway", "worker"} if name.startswith("colocated")
                     else {"gateway", "prefill", "decode"})
        assert set(account["cpu_ms_per_token"]) == processes
        # /proc counts in clock ticks (10 ms): only the process running the model is sure to show some.
        assert all(ms >= 0 for ms in account["cpu_ms_per_token"].values())
        assert account["cpu_ms_per_token"][account["pacing_worker"]] > 0
    assert "| deployment | measured TPOT ms | account TPOT ms" in done.stdout

    # A "peer" python without vLLM: its server exits at once, and the run says so instead of waiting.
    done = pdserve("bench", "serving-vs-vllm", *common, "--peer-python", sys.executable,
                   "--log-dir", str(tmp_path / "logs-peer"))
    assert done.returncode == 1 and "vLLM's server exited" in done.stderr, done.stdout + done.stderr
