"""A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors), read and checked
against the base model it is meant for.

Everything that would make an adapter run wrongly is refused here, at load, with a message naming
why: a file missing, a PEFT feature the batched product does not implement (DoRA, trained biases,
modules_to_save, per-module rank/alpha patterns), a rank over --max-lora-rank, a target module the
model lacks or --lora-target-modules excludes, and weights whose shapes are another base's.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from engine.lora.expert_adapter import EXPERT_KEY, EXPERT_PARAMETERS, ExpertLoraWeights, split_experts
from engine.models.config import ModelConfig

# PEFT's module names, in the order the fused projections concatenate them (engine.models.decoder:
# q/k/v into one matrix, gate/up into another).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# DeepSeek's multi-head latent attention: q_proj, or q_a_proj -> norm -> q_b_proj; kv_a_proj_with_mqa
# (the latent and rope key); o_proj. kv_b_proj is absorbed into per-head query and value maps
# (engine.models.mla), which a per-row adapter delta does not reach: refused, naming that.
MLA_MODULES = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES + MLA_MODULES[1:4]

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])\.weight$")


# A MoE layer's shared experts or per-expert modules (routed experts' fused parameters are EXPERT_KEY).
_EXPERT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.((?:shared_)?experts?)\b")


class LoraLoadError(ValueError):
    """An adapter that cannot be served on this model, with the reason."""


class UnknownLoraAdapter(ValueError):
    """A request for an adapter this engine has not loaded (a 404 at the HTTP front end)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")
        self.name = name


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights on the host: (layer, module) -> (A [r, in], B [out, r]) and its scaling
    (lora_alpha / r, or / sqrt(r) with rsLoRA)."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str = ""  # of its files: names its K/V in page hashes (a reloaded name may be other weights)
    # (routed layer, "gate_up_proj" or "down_proj") -> every expert's A and B (engine.lora.expert_adapter)
    experts: dict[tuple[int, str], ExpertLoraWeights] = field(default_factory=dict)

    @property
    def cache_key(self) -> str:
        """What the prefix cache keys this adapter's pages by (pdserve.page_hash.with_adapter)."""
        return f"{self.name}@{self.digest}"


# Under tensor parallelism (engine.tp.shard) these split their output features (B's rows) across
# ranks, the others (o_proj, down_proj) their input features (A's columns; the base layer's all-reduce
# then sums the partial deltas with the partial outputs).
COLUMN_PARALLEL_MODULES = frozenset(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj"))
# MLA's down-projections, whole on every rank (engine.models.mla).
REPLICATED_MODULES = frozenset(("q_a_proj", "kv_a_proj_with_mqa"))


def attention_modules(config: ModelConfig) -> tuple[str, ...]:
    """The PEFT names of the model's attention projections that adapters may target."""
    if config.mla is None:
        return ATTENTION_MODULES
    if config.mla.q_lora_rank is None:
        return ("q_proj", "kv_a_proj_with_mqa", "o_proj")
    return ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")


def module_shape(config: ModelConfig, module: str, tp_size: int = 1) -> tuple[int, int]:
    """(out_features, in_features) of a projection of the base model, on one of `tp_size` ranks."""
    hidden, width = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
    if config.mla is not None:
        mla = config.mla
        q_rows, q_rank = config.num_heads * mla.qk_head_dim, mla.q_lora_rank or 0
        shapes.update(q_proj=(q_rows, hidden), q_a_proj=(q_rank, hidden), q_b_proj=(q_rows, q_rank),
                      kv_a_proj_with_mqa=(mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),
                      o_proj=(hidden, config.num_heads * mla.v_head_dim))
    out_features, in_features = shapes[module]
    if module in REPLICATED_MODULES:
        return out_features, in_features
    if module in COLUMN_PARALLEL_MODULES:
        return out_features // tp_size, in_features
    return out_features, in_features // tp_size


def dense_mlp_layers(config: ModelConfig) -> set[int]:
    """Layers whose MLP is a dense SwiGLU (every layer, but a MoE model's routed layers)."""
    sparse = set(config.moe.sparse_layers) if config.moe is not None else set()
    return {i for i in range(config.num_layers) if i not in sparse}


def check_servable(config: ModelConfig) -> None:
    """Refuse --enable-lora on a model whose projections the LoRA wrappers do not cover."""
    if config.is_multimodal:
        raise LoraLoadError(f"LoRA is not supported on vision-language models ({config.architecture}) yet")


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                 allowed_modules: frozenset[str]) -> LoraAdapter:
    """Read and check the PEFT folder `path` for the base model `config`."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for file in (config_file, weights_file):
        if not file.is_file():
            raise LoraLoadError(f"LoRA adapter {name!r}: {file} is missing")
    try:
        peft = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise LoraLoadError(f"LoRA adapter {name!r}: {config_file} is not JSON ({exc})") from None
    _check_peft_options(name, peft)
    rank, alpha = int(peft.get("r", 0)), float(peft.get("lora_alpha", 0))
    if rank <= 0:
        raise LoraLoadError(f"LoRA adapter {name!r}: rank r={rank} must be positive")
    if rank > max_rank:
        raise LoraLoadError(f"LoRA adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    _check_patterns(name, peft, weights_file)
    weights, experts = _read_weights(name, weights_file, config, rank, peft)
    for (layer, parameter), pair in sorted(experts.items()):
        if pair.a.shape[1] > max_rank:
            raise LoraLoadError(f"LoRA adapter {name!r}: layer {layer} mlp.experts.{parameter} has rank "
                                f"{pair.a.shape[1]}, over --max-lora-rank {max_rank}")
    targets = frozenset(module for _, module in weights).union(
        *(EXPERT_PARAMETERS[parameter] for _, parameter in experts))
    for module in sorted(targets - allowed_modules):
        raise LoraLoadError(f"LoRA adapter {name!r} targets {module}, which --lora-target-modules "
                            f"({', '.join(sorted(allowed_modules))}) leaves out")
    return LoraAdapter(name, str(folder), rank, scaling, targets, weights, _digest(config_file, weights_file),
                       experts)


def _digest(*files: Path) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for file in files:
        with file.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _check_peft_options(name: str, peft: dict) -> None:
    if peft.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"LoRA adapter {name!r}: peft_type {peft.get('peft_type')!r} is not LORA")
    if peft.get("use_dora"):
        raise LoraLoadError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported")
    if peft.get("bias", "none") != "none":
        raise LoraLoadError(f"LoRA adapter {name!r}: trained biases (bias={peft['bias']!r}) are not "
                            "supported")
    if peft.get("modules_to_save"):
        raise LoraLoadError(f"LoRA adapter {name!r}: modules_to_save {peft['modules_to_save']} replace base "
                            "weights, which a shared base cannot do")
    if peft.get("fan_in_fan_out"):
        raise LoraLoadError(f"LoRA adapter {name!r}: fan_in_fan_out (Conv1D bases) is not supported")
    # PEFT's way to adapt weights that are parameters, not Linear modules: served for a MoE model's
    # fused expert tensors (mlp.experts.gate_up_proj, ...), one rank block per expert
    targets = sorted(peft.get("target_parameters") or [])  # PEFT saves them in no fixed order
    # `gate_up_proj`, or a dotted name whose module is a layer's `experts`
    others = [t for t in targets if t.rsplit(".", 1)[-1] not in EXPERT_PARAMETERS
              or "." in t and t.rsplit(".", 2)[-2] != "experts"]
    if others:
        raise LoraLoadError(f"LoRA adapter {name!r}: target_parameters {others} (LoRA on fused parameters "
                            "other than routed experts' gate_up_proj and down_proj) is not supported")


def _check_patterns(name: str, peft: dict, file: Path) -> None:
    """Refuse per-module rank_pattern/alpha_pattern entries that apply to a weight of the file (one
    rank and scaling per adapter here). PEFT writes some of its own that match nothing saved (on
    transformers' fused MoE expert names, `.*\\.gate_up_proj`): those change nothing."""
    patterns = {**(peft.get("rank_pattern") or {}), **(peft.get("alpha_pattern") or {})}
    if not patterns:
        return
    with safe_open(str(file), framework="pt") as tensors:
        modules = {key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for key in tensors.keys()}
    for pattern in sorted(patterns):
        # PEFT's match: the pattern against the end of a module's dotted name
        try:
            hit = next((m for m in sorted(modules) if re.match(rf"(.*\.)?({pattern})$", m)), None)
        except re.error as exc:
            raise LoraLoadError(f"LoRA adapter {name!r}: rank_pattern/alpha_pattern {pattern!r} is not a "
                                f"regular expression ({exc})") from None
        if hit is not None:
            raise LoraLoadError(f"LoRA adapter {name!r}: rank_pattern/alpha_pattern {pattern!r} sets another "
                                f"rank or alpha for {hit}; per-module ranks and alphas are not supported")


def _read_weights(name: str, file: Path, config: ModelConfig, rank: int, peft: dict) -> tuple[
        dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], dict[tuple[int, str], ExpertLoraWeights]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    expert_halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (layer, wrapper depth)
    dense_mlp = dense_mlp_layers(config)
    attention = attention_modules(config)
    with safe_open(str(file), framework="pt") as tensors:
        for key in tensors.keys():
            routed = EXPERT_KEY.match(key)
            if routed is not None:
                wrapper = expert_halves.setdefault((int(routed[1]), routed[2]), {})
                wrapper[routed[3]] = tensors.get_tensor(key).float()
                continue
            expert = _EXPERT_KEY.match(key)
            if expert is not None:
                raise LoraLoadError(f"LoRA adapter {name!r} targets mlp.{expert[2]} of layer {expert[1]} "
                                    f"(weight {key}): LoRA on shared experts or per-expert modules is not "
                                    "supported (routed experts' fused parameters are)")
            match = _KEY.match(key)
            if match is None:
                raise LoraLoadError(f"LoRA adapter {name!r}: weight {key} is not a LoRA A/B matrix of a "
                                    f"decoder layer's projection ({', '.join(SUPPORTED_MODULES)})")
            layer, block, module, half = int(match[1]), match[2], match[3], match[4]
            if block == "self_attn" and module == "kv_b_proj" and config.mla is not None:
                raise LoraLoadError(f"LoRA adapter {name!r} targets self_attn.kv_b_proj (weight {key}): "
                                    "multi-head latent attention absorbs it into per-head query and value "
                                    "maps, which per-row adapters do not reach; adapt q_a/q_b_proj, "
                                    "kv_a_proj_with_mqa or o_proj")
            if module not in (attention if block == "self_attn" else MLP_MODULES):
                raise LoraLoadError(f"LoRA adapter {name!r} targets {block}.{module}, which "
                                    f"{config.architecture} does not have (weight {key})")
            if layer >= config.num_layers:
                raise LoraLoadError(f"LoRA adapter {name!r}: layer {layer} is past the model's "
                                    f"{config.num_layers} layers (another base model?)")
            if block == "mlp" and layer not in dense_mlp:
                raise LoraLoadError(f"LoRA adapter {name!r} targets mlp.{module} of layer {layer}, a routed "
                                    "MoE layer: LoRA on experts is not supported")
            halves.setdefault((layer, module), {})[half] = tensors.get_tensor(key).float()
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraLoadError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{next(iter(pair))} "
                                "without its other half")
        out_features, in_features = module_shape(config, module)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoraLoadError(
                f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, "
                f"this model needs A ({rank}, {in_features}) and B ({out_features}, {rank}) "
                "(an adapter of another base model?)")
        weights[(layer, module)] = (a, b)
    experts: dict[tuple[int, str], ExpertLoraWeights] = {}
    for (layer, _), pair_halves in sorted(expert_halves.items()):
        parameter, expert_weights = split_experts(name, layer, pair_halves, config, peft, LoraLoadError)
        if (layer, parameter) in experts:
            raise LoraLoadError(f"LoRA adapter {name!r}: layer {layer} mlp.experts.{parameter} is adapted "
                                "twice")
        experts[(layer, parameter)] = expert_weights
    if not weights and not experts:
        raise LoraLoadError(f"LoRA adapter {name!r}: {file} holds no LoRA weights")
    return weights, experts


def parse_lora_paths(values: tuple[str, ...]) -> dict[str, str]:
    """SGLang's --lora-paths: NAME=PATH, or a bare PATH named by itself."""
    paths: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = value, value
        if not name or not path:
            raise ValueError(f"--lora-paths entry {value!r} is not NAME=PATH")
        if name in paths:
            raise ValueError(f"--lora-paths names adapter {name!r} twice")
        paths[name] = path
    return paths
