"""Reading safetensors checkpoints: one file, or shards listed in model.safetensors.index.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointReader:
    """Tensors of a checkpoint folder by name, read lazily shard by shard (no whole-model copy)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: model_dir / shard for name, shard in weight_map.items()}
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
            self._file_of = {}
            for path in files:
                with safe_open(str(path), framework="pt") as handle:
                    self._file_of.update({name: path for name in handle.keys()})  # noqa: SIM118
        self._handles: dict[Path, object] = {}

    def names(self) -> Iterator[str]:
        return iter(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._handles.clear()
