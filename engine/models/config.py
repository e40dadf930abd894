"""ModelConfig: the decoder shape read from a Hugging Face config.json.

Dense Llama / Qwen2 / Qwen3; mixture-of-experts Qwen3-MoE and Mixtral (`moe`, engine.models.moe_config);
DeepSeek V2 / V3, which add multi-head latent attention (`mla`, engine.models.mla_config) to MoE.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.models.hf_config import refuse_unsupported, resolve_config
from engine.models.mla_config import MLAConfig
from engine.models.moe_config import MoEConfig
from libkv.layout import KVLayout

# architecture name -> (q/k/v bias default, per-head q/k RMSNorm)
_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "DeepseekV2ForCausalLM": (False, False),
    "DeepseekV3ForCausalLM": (False, False),
    # Qwen2-VL: a Qwen2 decoder (config.json's text_config) with M-RoPE, and a vision tower
    # (engine.models.vision) whose outputs replace the image-pad tokens' embeddings.
    "Qwen2VLForConditionalGeneration": (True, False),
    # Qwen2.5-VL: the same decoder; its tower (engine.models.vision) has window attention.
    "Qwen2_5_VLForConditionalGeneration": (True, False),
    # Qwen3-VL: a Qwen3 decoder with interleaved M-RoPE, and deepstack: its tower's features from
    # early blocks are added to the image tokens' hidden states after the first decoder layers.
    "Qwen3VLForConditionalGeneration": (False, True),
    # LLaVA: a CLIP tower and projector (engine.models.vision_clip) before a plain-RoPE decoder
    # whose family (Llama, Qwen2) text_config.model_type names: _decoder_defaults.
    "LlavaForConditionalGeneration": (False, False),
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                "qwen2_vl": "Qwen2VLForConditionalGeneration",
                "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                "qwen3_vl": "Qwen3VLForConditionalGeneration",
                "llava": "LlavaForConditionalGeneration"}
_MROPE_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                        "Qwen3VLForConditionalGeneration")
_HEAD_DIM_FROM_WIDTH = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is "default", "linear", "llama3" or "yarn".

    yarn (DeepSeek-V3/V2 ship it): `beta_fast`/`beta_slow`/`truncate` shape the ramp between
    interpolated and extrapolated frequencies; `attention_factor` scales cos/sin (resolved from
    `mscale`/`mscale_all_dim` as transformers does); `mscale_all_dim` also scales DeepSeek's
    softmax (engine.models.rope.mla_softmax_scale).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about a checkpoint; built by `from_dir`.

    One decoder serves the three families; the switches are `qkv_bias` (Qwen2), `qk_norm`
    (Qwen3), `o_bias`/`mlp_bias` (Llama's attention_bias / mlp_bias) and `tie_word_embeddings`.
    For DeepSeek (`mla` set) `num_kv_heads` is `num_heads` and `head_dim` is a head's q.k width,
    qk_nope_head_dim + qk_rope_head_dim (transformers' own head_dim there is the rope part).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    torch_dtype: str  # the checkpoint's declared dtype, used by --dtype auto
    eos_token_ids: tuple[int, ...] = field(default=())
    moe: MoEConfig | None = None  # routed experts (which layers, how routed); None: every MLP dense
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek); None: GQA
    # Vision-language (Qwen2-VL, Qwen2.5-VL, LLaVA): M-RoPE's rotary sections (None for LLaVA's
    # plain RoPE), the image-pad token, and the vision tower's config.json section
    # (engine.models.vision_towers); None for a text-only model.
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL: sections interleaved over the frequencies (THWTHW...) instead of consecutive, and
    # how many decoder layers take a deepstack feature (the tower's deepstack_visual_indexes)
    mrope_interleaved: bool = False
    deepstack_layers: int = 0
    image_token_id: int | None = None
    vision_config: dict | None = field(default=None, compare=False, hash=False)
    # DeepSeek-V3's multi-token-prediction layers, stored after the last decoder layer (the NEXTN
    # drafter, engine.models.mtp); transformers and the target's forward ignore them.
    num_nextn_predict_layers: int = 0

    @property
    def is_multimodal(self) -> bool:
        return self.vision_config is not None

    def kv_layout(self, page_size: int, dtype: torch.dtype, tp_size: int = 1) -> KVLayout:
        """One rank's KV page: its num_kv_heads / tp_size heads of K and V, or for MLA the whole
        latent (the same on every rank: MLA has no per-head K/V to split)."""
        dtype_name = str(dtype).removeprefix("torch.")
        if self.mla is not None:
            return KVLayout.mla(self.num_layers, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim,
                                page_size, dtype_name)
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads // tp_size,
                        head_dim=self.head_dim, page_size=page_size, dtype=dtype_name)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        return cls.from_dict(raw, _generation_eos(model_dir))

    @classmethod
    def from_dict(cls, raw: dict, generation_eos: tuple[int, ...] | None = None) -> ModelConfig:
        arch = _architecture(raw)
        raw = resolve_config(raw)
        top = raw
        if "text_config" in raw:  # transformers 5 nests a VL model's decoder fields
            raw = {**raw, **{k: v for k, v in raw["text_config"].items() if v is not None}}
        qkv_bias_default, qk_norm = _decoder_defaults(arch, top)
        refuse_unsupported(raw, arch)
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw.get('hidden_act')!r}; only silu is implemented")
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method", "?")
            raise ValueError(f"quantized checkpoints ({method}) are not supported; use a bf16/fp32 "
                             "checkpoint")
        if raw.get("use_sliding_window", False):
            raise ValueError("sliding-window attention is not implemented (use_sliding_window is true)")
        num_heads = raw["num_attention_heads"]
        attention_bias = bool(raw.get("attention_bias", False))
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported checkpoint dtype {dtype!r}")
        eos = generation_eos if generation_eos else _as_ids(raw.get("eos_token_id"))
        mla = MLAConfig.from_dict(raw, arch)
        rope = _rope(raw)
        if rope.rope_type == "yarn" and mla is None:
            # Implemented (and tested against transformers) for DeepSeek checkpoints only so far.
            raise ValueError(f"unsupported rope type 'yarn' for {arch}; implemented there: default, linear, "
                             "llama3")
        if mla is not None:
            # After kv_b_proj every query head has a key and value of its own (what config.json's
            # num_key_value_heads says), and a head's q.k is qk_nope + qk_rope wide; the pool stores
            # the shared latent instead (kv_layout). transformers' own head_dim is the rope dim.
            num_kv_heads, head_dim = num_heads, mla.qk_head_dim
        else:
            num_kv_heads = raw.get("num_key_value_heads") or num_heads
            # Qwen2-VL's and Qwen2.5-VL's attention is hidden / heads wide whatever head_dim says
            honoured = _decoder_arch(arch, top) not in _HEAD_DIM_FROM_WIDTH
            head_dim = (raw.get("head_dim") if honoured else None) or raw["hidden_size"] // num_heads
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=rope,
            # Qwen2 always has q/k/v bias; Llama/Qwen3 only with attention_bias, which also adds o bias.
            qkv_bias=qkv_bias_default or attention_bias,
            o_bias=attention_bias and _decoder_arch(arch, top) != "Qwen2ForCausalLM",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=dtype,
            eos_token_ids=eos,
            moe=MoEConfig.from_dict(raw, arch),
            mla=mla,
            **_vision_fields(top, raw, arch),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0)
            if arch == "DeepseekV3ForCausalLM" else 0,
        )


def _decoder_arch(arch: str, top: dict) -> str:
    """The decoder's own architecture: a LLaVA's is its text_config's family (Llama by default)."""
    if arch != "LlavaForConditionalGeneration":
        return arch
    text_type = (top.get("text_config") or {}).get("model_type", "llama")
    decoder = _MODEL_TYPES.get(text_type)
    if decoder is None or decoder not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        raise ValueError(f"LLaVA with a {text_type!r} decoder is not supported; implemented: llama, qwen2, "
                         "qwen3")
    return decoder


def _decoder_defaults(arch: str, top: dict) -> tuple[bool, bool]:
    return _ARCHITECTURES[_decoder_arch(arch, top)]


def _vision_fields(top: dict, raw: dict, arch: str) -> dict:
    if arch == "LlavaForConditionalGeneration":
        if "vision_config" not in top:
            raise ValueError(f"{arch} config.json needs vision_config")
        token = top.get("image_token_index", top.get("image_token_id"))
        if token is None:
            raise ValueError(f"{arch} config.json needs image_token_index")
        return dict(image_token_id=int(token), vision_config=dict(top["vision_config"]))
    if arch not in _MROPE_ARCHITECTURES:
        return {}
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    section = params.get("mrope_section")
    if not section or "vision_config" not in top:
        raise ValueError(f"{arch} config.json needs rope mrope_section and vision_config")
    qwen3 = arch == "Qwen3VLForConditionalGeneration"
    deepstack = len(top["vision_config"].get("deepstack_visual_indexes") or ()) if qwen3 else 0
    if deepstack > raw["num_hidden_layers"]:
        raise ValueError(f"{deepstack} deepstack features for {raw['num_hidden_layers']} decoder layers")
    return dict(mrope_section=tuple(int(s) for s in section), image_token_id=int(top["image_token_id"]),
                vision_config=dict(top["vision_config"]), mrope_interleaved=qwen3, deepstack_layers=deepstack)


def resolve_dtype(requested: str, config: ModelConfig) -> torch.dtype:
    """`--dtype auto|float32|bfloat16|float16`; auto takes the checkpoint's declared dtype."""
    name = config.torch_dtype if requested == "auto" else requested
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {requested!r}; expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _architecture(raw: dict) -> str:
    for arch in raw.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return arch
    if raw.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[raw["model_type"]]
    raise ValueError(f"unsupported model: architectures={raw.get('architectures')} "
                     f"model_type={raw.get('model_type')!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(raw: dict) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints (e.g. Llama-3.1)
    # have top-level `rope_theta` and an optional `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "mrope":  # Qwen2-VL's older configs: default frequencies, in sections (mrope_section)
        rope_type = "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope type {rope_type!r}; implemented: default, linear, llama3, yarn")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not implemented")
    max_positions = raw.get("max_position_embeddings", 8192)
    # As transformers' standardize_rope_params: a top-level original_max_position_embeddings wins.
    original = raw.get("original_max_position_embeddings") if rope_type in ("llama3", "yarn") else None
    original = int(original or params.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor")
    if factor is None:
        # transformers' yarn: without a factor, the ratio of the context lengths.
        factor = max_positions / original if rope_type == "yarn" else 1.0
    factor = float(factor)
    attention_factor = 1.0
    if rope_type == "yarn":
        given_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if given_factor is not None:
            attention_factor = given_factor
        elif mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (transformers' get_mscale)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return ()
    return _as_ids(json.loads(path.read_text()).get("eos_token_id"))
