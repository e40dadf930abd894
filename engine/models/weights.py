"""Reading safetensors checkpoints: one file, or shards listed in model.safetensors.index.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

_LANGUAGE_MODEL = "model.language_model."
_LEGACY_LANGUAGE_MODEL = "language_model."


class MissingTensor(KeyError, ValueError):
    """The checkpoint lacks a tensor the architecture needs; the message names it."""

    def __str__(self) -> str:  # KeyError would quote the message again
        return str(self.args[0])


class MisshapenTensor(ValueError):
    """A checkpoint tensor's shape is not what config.json implies; the message names both."""


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
        # transformers 5 saves a VL model's decoder under model.language_model.* (older Qwen2-VL
        # checkpoints under model.*): the decoder's loader reads either by its model.* names.
        # LLaVA checkpoints (the published ones, and what transformers 5's save_pretrained writes
        # for LlavaForConditionalGeneration) keep the older language_model.model.* and
        # language_model.lm_head.* names.
        self._stored_as = {"model." + name.removeprefix(_LANGUAGE_MODEL): name
                           for name in self._file_of if name.startswith(_LANGUAGE_MODEL)}
        self._stored_as.update({name.removeprefix(_LEGACY_LANGUAGE_MODEL): name for name in self._file_of
                                if name.startswith(_LEGACY_LANGUAGE_MODEL)})
        self._file_of.update({alias: self._file_of[name] for alias, name in self._stored_as.items()})
        self._handles: dict[Path, safe_open] = {}

    def names(self) -> Iterator[str]:
        return iter(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise MissingTensor(f"checkpoint has no tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(self._stored_as.get(name, name))

    def close(self) -> None:
        self._handles.clear()


class ShardedReader:
    """A checkpoint's tensors on the model's device and dtype, and this rank's slices of them.

    Without a TPShard (TP 1) the slicing helpers return the tensor whole. Layer loaders (the
    decoder, engine.models.moe, engine.models.mla) read through this so they share one TP rule.
    """

    def __init__(self, reader: CheckpointReader, device: torch.device, dtype: torch.dtype,
                 shard=None) -> None:
        self.reader = reader
        self.device = device
        self.dtype = dtype
        self.shard = shard  # engine.tp.shard.TPShard | None
        self.tp_size = shard.size if shard else 1

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def get(self, name: str, shape: tuple[int, ...] | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor (before any TP slicing), in `dtype` (default: the model's); `shape` is what
        config.json implies, checked here so that a misshapen checkpoint is refused at load naming
        the tensor, not later."""
        tensor = self.reader.get(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise MisshapenTensor(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but "
                                  f"config.json implies {tuple(shape)}")
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def maybe(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        return self.get(name, shape) if name in self.reader else None

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Column-parallel: this rank's block of output features (dim 0)."""
        return self.shard.rows(tensor) if self.shard else tensor

    def columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Row-parallel: this rank's block of input features (dim 1)."""
        return self.shard.columns(tensor) if self.shard else tensor

    def row_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self.shard.row_bias(bias) if self.shard else bias
