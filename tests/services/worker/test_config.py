"""`pdserve launch-server` takes the flags of SGLang's PD commands unchanged where they mean the same."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from engine.config import EngineConfig
from pdserve.config_flags import config_from_args
from services.launch_server import add_arguments
from services.worker.config import LocalPrefillRule, WorkerConfig
from tools.models.tiny_model import PRESETS, model_config


def parse(model_dir, *flags: str) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(WorkerConfig, parser.parse_args(["--model-path", str(model_dir), *flags]))


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_seed_commands_parse(model_dir):
    prefill = parse(model_dir, "--disaggregation-mode", "prefill", "--port", "30000",
                    "--disaggregation-transfer-backend", "nixl")
    assert (prefill.role, prefill.server.port,
            prefill.disaggregation_transfer_backend) == ("prefill", 30000, "nixl")
    decode = parse(model_dir, "--disaggregation-mode", "decode", "--port", "30001", "--base-gpu-id", "1",
                   "--disaggregation-ib-device", "mlx5_roce0", "--mem-fraction-static", "0.8",
                   "--max-running-requests", "128", "--chunked-prefill-size", "4096", "--tp-size", "1")
    assert (decode.role == "decode" and decode.base_gpu_id == 1
            and decode.disaggregation_ib_device == "mlx5_roce0")
    engine = decode.engine
    assert (engine.mem_fraction_static, engine.max_running_requests,
            engine.chunked_prefill_size) == (0.8, 128, 4096)
    assert parse(model_dir).role == "colocated"  # --disaggregation-mode null is the default
    # The seeds' DeepSeek command passes --trust-remote-code: accepted, and it runs no checkpoint code.
    assert parse(model_dir, "--trust-remote-code").engine.trust_remote_code


def test_engine_flags_default_to_the_engine_config(model_dir):
    """The engine's settings are EngineConfig's, defaults included; only --device differs: a worker
    takes auto (resolved here), the in-process engine cpu."""
    config = parse(model_dir, "--base-gpu-id", "3")
    assert config.engine == EngineConfig(model_path=str(model_dir), device=config.engine.device)
    assert config.engine.device == ("cuda:3" if torch.cuda.is_available() else "cpu")
    assert parse(model_dir, "--device", "cpu", "--page-size", "32").engine.page_size == 32
    assert config.local_prefill == LocalPrefillRule() and not config.local_prefill_rule().enabled
    decode = parse(model_dir, "--disaggregation-mode", "decode", "--conditional-disaggregation",
                   "--local-prefill-max-tokens", "8")
    assert decode.local_prefill_rule() == LocalPrefillRule(enabled=True, max_tokens=8)


def test_env_knobs_are_the_defaults(model_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_WAITING_TIMEOUT", "600")
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_QUEUE_SIZE", "2")
    config = parse(model_dir)
    assert config.waiting_timeout == 600.0 and config.transfer_queue_size == 2
    assert parse(model_dir, "--waiting-timeout", "5").waiting_timeout == 5.0  # a flag wins


@pytest.mark.parametrize("flags, message", [
    (("--tp-size", "0"), "--tp-size must be at least 1"),
    (("--disaggregation-mode", "both"), "--disaggregation-mode must be one of"),
    (("--disaggregation-transfer-backend", "rdma"), "--disaggregation-transfer-backend must be one of"),
])
def test_bad_flags_are_refused_with_a_message(model_dir, flags, message):
    with pytest.raises(ValueError, match=message):
        parse(model_dir, *flags)


def test_tp_size_must_split_the_heads(tmp_path):
    # The tiny preset's shape: 4 attention heads, 2 KV heads, MLP width 768.
    (tmp_path / "config.json").write_text(json.dumps(model_config(PRESETS["tiny"])))
    assert parse(tmp_path, "--tp-size", "2").engine.tp_size == 2
    with pytest.raises(ValueError, match="--tp-size 4: tp size 4 does not divide the model's 2 KV heads"):
        parse(tmp_path, "--tp-size", "4")


def test_model_path_must_be_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        parse(tmp_path / "missing")


def test_local_prefill_rule_order_and_switch() -> None:
    """Conditional disaggregation's decision: which reason runs a prompt on the decode worker, in order."""
    rule = LocalPrefillRule(enabled=True, max_tokens=32, max_prefill_queue=2)
    assert rule.reason(1000, "", 0) == "no_prefill"
    assert rule.reason(32, "p:1", 0) == "short_prompt"
    assert rule.reason(33, "p:1", 1) is None
    assert rule.reason(33, "p:1", 2) == "prefill_queue"
    assert LocalPrefillRule(enabled=True, max_tokens=0).reason(5, "p:1", 99) is None  # queue rule off
    assert LocalPrefillRule(enabled=False).reason(1, "", 0) is None
    with pytest.raises(ValueError, match="--local-prefill-max-tokens"):
        LocalPrefillRule(max_tokens=-1)
