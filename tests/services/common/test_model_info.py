"""ModelInfo of a checkpoint folder: what a worker reports and what a gateway writes from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos.v1 import worker_pb2
from services.common import model_info
from services.common.model_info import ModelInfoError, files_digest, read_model_info, write_model_files
from services.gateway.model_source import ServedModel
from services.gateway.prompts import ModelFiles


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tools.models.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)


def test_round_trip_gives_the_same_tokenizer(tiny: Path, tmp_path: Path) -> None:
    info = read_model_info(tiny, "tiny-served")
    names = [file.name for file in info.files]
    assert names == sorted(names) and "tokenizer.json" in names and "model.safetensors" not in names
    assert info.served_model_name == "tiny-served" and info.context_length > 0
    write_model_files(info, tmp_path)
    original, copied = ModelFiles(tiny), ModelFiles(tmp_path)
    text = "Hello there, river and city!"
    assert copied.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    assert copied.context_length == original.context_length == info.context_length
    messages = [{"role": "user", "content": "hi"}]
    assert copied.chat_template.render(messages, add_generation_prompt=True) == \
        original.chat_template.render(messages, add_generation_prompt=True)


def test_digest_depends_on_names_and_contents() -> None:
    assert files_digest({"a": b"x"}) == files_digest({"a": b"x"})
    assert len({files_digest({"a": b"x"}), files_digest({"a": b"y"}), files_digest({"b": b"x"}),
                files_digest({"a": b"", "x": b""}), files_digest({"ax": b""})}) == 5


def test_written_files_are_checked(tiny: Path, tmp_path: Path) -> None:
    info = read_model_info(tiny, "m")
    evil = worker_pb2.ModelInfo()
    evil.CopyFrom(info)
    evil.files.add(name="../escape.json", content=b"{}")
    with pytest.raises(ModelInfoError, match="unexpected"):
        write_model_files(evil, tmp_path)
    tampered = worker_pb2.ModelInfo()
    tampered.CopyFrom(info)
    tampered.files[0].content += b" "
    with pytest.raises(ModelInfoError, match="digest"):
        write_model_files(tampered, tmp_path)
    assert not any(tmp_path.iterdir())


def test_size_is_bounded(tiny: Path, monkeypatch) -> None:
    monkeypatch.setattr(model_info, "MAX_MODEL_FILES_BYTES", 1000)
    with pytest.raises(ModelInfoError, match="exceed"):
        read_model_info(tiny, "m")


def test_served_model_names_the_disagreement(tiny: Path) -> None:
    info = read_model_info(tiny, "m")
    served = ServedModel("m", info.files_sha256, info.context_length, "decode 127.0.0.1:1")
    assert served.disagreement(info) is None
    assert "serves model 'other'" in served.disagreement(read_model_info(tiny, "other"))
    changed = worker_pb2.ModelInfo(served_model_name="m", files_sha256="0" * 64)
    assert "tokenizer files differ" in served.disagreement(changed)
