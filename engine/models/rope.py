"""Rotary position embedding: inverse frequencies (default, linear, llama3) and a cos/sin table."""

from __future__ import annotations

import math

import torch

from engine.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """fp32 [head_dim // 2], computed the way transformers does so positions rotate identically."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between the
    # two wavelength limits interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for every position up to the longest seen so far, grown by doubling.

    The table is built once (not per step) and indexed by position, so a decode step pays one
    gather instead of recomputing trigonometry. Values are computed in fp32 and cast to the model
    dtype, matching transformers' rotary embedding.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int,
                 dtype: torch.dtype, device: torch.device, initial: int = 4096) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)
        self.max_positions = max_positions
        self.dtype = dtype
        self.device = device
        self.cos = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.sin = torch.empty(0, head_dim, dtype=dtype, device=device)
        self._grow(min(initial, max_positions))

    def _grow(self, length: int) -> None:
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)

    def tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables [positions, head_dim], grown to cover `max_position`."""
        if max_position >= self.cos.shape[0]:
            self._grow(max(max_position + 1, 2 * self.cos.shape[0]))
        return self.cos, self.sin

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for `positions` [T]; `max_position` is their maximum."""
        cos, sin = self.tables(max_position)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated with the rotate-half convention of HF Llama/Qwen checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
