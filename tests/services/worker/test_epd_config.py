"""The EPD flags of `pdserve launch-server` (services/worker/epd_config.py, WorkerConfig._check_epd)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.config_flags import config_from_args
from services.launch_server import add_arguments
from services.worker.config import WorkerConfig


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tools.models.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {preset: write_tiny_model(root / preset, preset=preset, seed=0) for preset in ("tiny-vl", "tiny")}


def config(*argv: str) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(WorkerConfig, parser.parse_args(list(argv)))


def test_encoder_urls_take_several_values_as_the_seeds_pass_them(models):
    worker = config("--model-path", str(models["tiny-vl"]), "--language-only", "--encoder-urls",
                    "http://127.0.0.1:30002", "http://127.0.0.1:30003", "--encoder-transfer-backend", "nixl")
    assert worker.engine.language_only and worker.role == "colocated"
    assert worker.epd.encoder_addresses() == ["127.0.0.1:30002", "127.0.0.1:30003"]
    assert config("--model-path", str(models["tiny-vl"]), "--encoder-only").role == "encoder"
    assert config("--model-path", str(models["tiny-vl"])).epd.encoder_urls == ()


@pytest.mark.parametrize(("extra", "preset", "message"), [
    (("--encoder-only",), "tiny", "--encoder-only needs a vision-language model"),
    (("--language-only",), "tiny", "--language-only needs a vision-language model"),
    (("--encoder-only", "--language-only"), "tiny-vl", "exclude each other"),
    (("--encoder-only", "--disaggregation-mode", "prefill"), "tiny-vl", "runs no prefill or decode"),
    (("--language-only", "--disaggregation-mode", "decode"), "tiny-vl", "not decode"),
    (("--encoder-transfer-backend", "ucx"), "tiny-vl", "--encoder-transfer-backend must be one of"),
])
def test_bad_epd_flags_are_refused(models, extra, preset, message):
    with pytest.raises(ValueError, match=message):
        config("--model-path", str(models[preset]), *extra)
