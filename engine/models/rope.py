"""Rotary position embedding: inverse frequencies (default, linear, llama3, yarn), a cos/sin table,
and the rotations: rotate-half (Llama, Qwen) and the pairwise ones of DeepSeek's MLA."""

from __future__ import annotations

import math

import torch

from engine.models.config import RopeConfig, yarn_mscale


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """fp32 [head_dim // 2], computed the way transformers does so positions rotate identically."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_frequencies(rope, head_dim)
    return inv_freq


def _yarn_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    # transformers' _compute_yarn_parameters, step for step: frequencies that turn more than
    # beta_fast times over the original context are kept (extrapolated), those under beta_slow
    # divided by `factor` (interpolated), a linear ramp over the dimensions between.
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def mla_softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """DeepSeek's softmax scale (transformers' yarn_apply_mscale): 1/sqrt(qk_head_dim), times
    mscale(factor, mscale_all_dim) squared for a scaled rope that sets mscale_all_dim."""
    scale = qk_head_dim ** (-0.5)
    if rope.rope_type != "default" and rope.mscale_all_dim:
        mscale = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


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
    gather instead of recomputing trigonometry. Values are computed in fp32, scaled by the rope's
    attention factor (yarn; 1 otherwise) and cast to `dtype`, matching transformers' rotary embedding.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int,
                 dtype: torch.dtype, device: torch.device, initial: int = 4096) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)
        self.attention_factor = rope.attention_factor
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
        self.cos = (emb.cos() * self.attention_factor).to(self.dtype)
        self.sin = (emb.sin() * self.attention_factor).to(self.dtype)

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


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with pairs (x0, x1), (x2, x3), ... each rotated by one frequency, written back as
    [rotated evens | rotated odds] (DeepSeek-V3's rope_interleave; transformers'
    apply_rotary_pos_emb_interleave). cos/sin [T, 1, D] as from RotaryTable.lookup."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    evens, odds = x[..., 0::2], x[..., 1::2]
    return torch.cat([evens * cos - odds * sin, odds * cos + evens * sin], dim=-1)


def apply_rotary_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with pairs (x0, x1), ... rotated as complex numbers in fp32 and written back in
    place of each pair, cast to x's dtype (DeepSeek-V2 in transformers 5). cos/sin [T, 1, D] fp32."""
    half = cos.shape[-1] // 2
    freqs_cis = torch.complex(cos[..., :half], sin[..., :half])
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis).flatten(-2).to(x.dtype)
