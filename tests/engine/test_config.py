"""EngineConfig flags and KV pool sizing."""

from __future__ import annotations

import argparse

import psutil
import pytest
import torch

from engine.config import EngineConfig
from engine.memory import kv_pages
from libkv.layout import KVLayout
from pdserve.config_flags import add_config_arguments, config_from_args

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")  # 64 KiB pages


def test_flags_default_to_the_dataclass():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    config = config_from_args(EngineConfig, parser.parse_args(["--model-path", "m"]))
    assert config == EngineConfig(model_path="m")
    config = config_from_args(EngineConfig, parser.parse_args(
        ["--model-path", "m", "--num-pages", "7", "--mem-fraction-static", "0.5", "--dtype", "bfloat16"]))
    assert (config.num_pages, config.mem_fraction_static, config.dtype) == (7, 0.5, "bfloat16")


def test_invalid_config():
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        EngineConfig(model_path="m", mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="--num-pages"):
        EngineConfig(model_path="m", num_pages=0)


def test_kv_pages_rules():
    cpu = torch.device("cpu")
    assert kv_pages(EngineConfig(model_path="m", num_pages=9, max_total_tokens=10**6), LAYOUT, cpu) == 9
    assert kv_pages(EngineConfig(model_path="m", max_total_tokens=1000), LAYOUT, cpu) == 63
    capped = kv_pages(EngineConfig(model_path="m", cpu_kv_cap_gib=0.5), LAYOUT, cpu)
    expected_cap = int(0.5 * 2**30 // LAYOUT.page_nbytes)
    by_fraction = int(psutil.virtual_memory().available * 0.8 // LAYOUT.page_nbytes)
    assert capped == pytest.approx(min(expected_cap, by_fraction), rel=0.05)
