"""MoEConfig: which layers route tokens to experts, and how (from a HF config.json).

Four routing recipes, each as transformers 5.23 runs it (the engine's output is compared with it):

- Qwen3-MoE: softmax over the router logits (computed in the model dtype), top-k, renormalised
  when `norm_topk_prob`; the weights are cast back to the model dtype.
- Mixtral: the same, always renormalised, weights kept in fp32.
- DeepSeek V2: router logits in fp32, softmax, top-k either `greedy` or `group_limited_greedy`
  (keep the `topk_group` groups with the highest single score, zero the rest), weights times
  `routed_scaling_factor`. Never renormalised: transformers' DeepseekV2 router ignores
  `norm_topk_prob`, and so does this.
- DeepSeek V3 (`noaux_tc`): router logits in fp32, sigmoid scores; experts are chosen on the
  scores plus `e_score_correction_bias`, within the `topk_group` groups whose two best biased
  scores sum highest; the weights are the unbiased scores, renormalised when `norm_topk_prob`,
  times `routed_scaling_factor`.

A setting the engine does not implement is refused with a ValueError naming the field and value.
"""

from __future__ import annotations

from dataclasses import dataclass

SOFTMAX, SIGMOID = "softmax", "sigmoid"
GREEDY, GROUP_LIMITED_GREEDY, NOAUX_TC = "greedy", "group_limited_greedy", "noaux_tc"


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a mixture-of-experts checkpoint (see the module docstring for the recipes)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    sparse_layers: tuple[int, ...]  # layer indices whose MLP is routed; the others are dense
    scoring: str = SOFTMAX  # SOFTMAX or SIGMOID
    topk_method: str = GREEDY  # GREEDY, GROUP_LIMITED_GREEDY (V2) or NOAUX_TC (V3)
    num_groups: int = 1  # expert groups for the group-limited methods
    topk_groups: int = 1  # groups a token may pick experts from
    normalize: bool = False  # renormalise the top-k weights to sum to 1
    scaling_factor: float = 1.0  # routed_scaling_factor
    shared_intermediate_size: int = 0  # DeepSeek's shared experts as one dense MLP; 0: none
    router_fp32: bool = False  # DeepSeek: router logits from fp32 inputs; Qwen3-MoE, Mixtral: model dtype
    weights_in_model_dtype: bool = False  # Qwen3-MoE casts the routing weights to the model dtype

    @property
    def grouped(self) -> bool:
        return self.topk_method in (GROUP_LIMITED_GREEDY, NOAUX_TC)

    @classmethod
    def from_dict(cls, raw: dict, architecture: str) -> MoEConfig | None:
        """None for dense architectures."""
        if architecture == "Qwen3MoeForCausalLM":
            return _qwen3_moe(raw)
        if architecture == "MixtralForCausalLM":
            return _checked(cls(num_experts=raw.get("num_local_experts", 8),
                                top_k=raw.get("num_experts_per_tok", 2),
                                intermediate_size=raw["intermediate_size"],
                                sparse_layers=tuple(range(raw["num_hidden_layers"])), normalize=True))
        if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
            return _deepseek(raw, v3=architecture == "DeepseekV3ForCausalLM")
        return None


def _qwen3_moe(raw: dict) -> MoEConfig | None:
    num_experts = raw.get("num_experts", 128)
    if num_experts <= 0:
        return None  # transformers then builds every MLP dense
    step = raw.get("decoder_sparse_step", 1)
    if step < 1:
        raise ValueError(f"unsupported decoder_sparse_step {step!r}; expected at least 1")
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(raw["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return _checked(MoEConfig(num_experts=num_experts, top_k=raw.get("num_experts_per_tok", 8),
                              intermediate_size=raw.get("moe_intermediate_size", 768), sparse_layers=sparse,
                              normalize=bool(raw.get("norm_topk_prob", False)), weights_in_model_dtype=True))


def _deepseek(raw: dict, v3: bool) -> MoEConfig:
    # Defaults are transformers' DeepseekV2Config / DeepseekV3Config defaults.
    scoring = raw.get("scoring_func") or (SIGMOID if v3 else SOFTMAX)
    method = raw.get("topk_method") or (NOAUX_TC if v3 else GREEDY)
    arch = "DeepseekV3" if v3 else "DeepseekV2"
    expected_scoring, methods = (SIGMOID, (NOAUX_TC,)) if v3 else (SOFTMAX, (GREEDY, GROUP_LIMITED_GREEDY))
    if scoring != expected_scoring:
        raise ValueError(f"unsupported scoring_func {scoring!r} for {arch}; implemented: "
                         f"{expected_scoring!r}")
    if method not in methods:
        raise ValueError(f"unsupported topk_method {method!r} for {arch}; implemented: "
                         f"{', '.join(repr(m) for m in methods)}")
    freq = raw.get("moe_layer_freq", 1)
    if freq != 1:
        # transformers ignores it (every layer from first_k_dense_replace on is routed), DeepSeek's
        # own code routes only every freq-th layer: with freq 1 both agree.
        raise ValueError(f"unsupported moe_layer_freq {freq!r}; only 1 is implemented")
    num_experts = raw.get("n_routed_experts", 256 if v3 else 64)
    top_k = raw.get("num_experts_per_tok", 8 if v3 else None)
    if top_k is None:
        raise ValueError("DeepseekV2 config.json lacks num_experts_per_tok")
    num_groups = topk_groups = 1  # greedy routing looks at no groups
    if method != GREEDY:
        n_group, topk_group = raw.get("n_group", 8 if v3 else None), raw.get("topk_group", 4 if v3 else None)
        if n_group is None or topk_group is None:
            raise ValueError(f"topk_method {method!r} needs n_group and topk_group; got {n_group!r}, "
                             f"{topk_group!r}")
        num_groups, topk_groups = n_group, topk_group
    first_dense = raw.get("first_k_dense_replace", 3 if v3 else 0)
    intermediate = raw.get("moe_intermediate_size", 2048 if v3 else 1407)
    return _checked(MoEConfig(
        num_experts=num_experts, top_k=top_k, intermediate_size=intermediate,
        sparse_layers=tuple(range(first_dense, raw["num_hidden_layers"])),
        scoring=scoring, topk_method=method,
        num_groups=num_groups, topk_groups=topk_groups,
        normalize=v3 and bool(raw.get("norm_topk_prob", True)),  # V2's router never renormalises
        scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        shared_intermediate_size=intermediate * raw.get("n_shared_experts", 1 if v3 else 2),
        router_fp32=True))


def _checked(moe: MoEConfig) -> MoEConfig:
    if moe.top_k < 1 or moe.top_k > moe.num_experts:
        raise ValueError(f"unsupported num_experts_per_tok {moe.top_k!r} with {moe.num_experts} experts")
    if moe.grouped:
        if moe.num_groups < 1 or moe.num_experts % moe.num_groups:
            raise ValueError(f"unsupported n_group {moe.num_groups!r}: must divide the "
                             f"{moe.num_experts} experts")
        if not 1 <= moe.topk_groups <= moe.num_groups:
            raise ValueError(f"unsupported topk_group {moe.topk_groups!r} with n_group {moe.num_groups}")
        per_group = moe.num_experts // moe.num_groups
        if moe.topk_method == NOAUX_TC and per_group < 2:
            raise ValueError(f"unsupported n_group {moe.num_groups!r}: noaux_tc scores a group by its two "
                             f"best experts, so each group needs at least 2 of the {moe.num_experts} experts")
        if moe.top_k > moe.topk_groups * per_group:
            raise ValueError(f"unsupported num_experts_per_tok {moe.top_k!r}: topk_group {moe.topk_groups} "
                             f"groups hold only {moe.topk_groups * per_group} experts")
    return moe
