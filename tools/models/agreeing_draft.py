"""A target and a draft model that always agree: the upper bound of STANDALONE speculation.

A draft that is the target itself accepts every draft, but each drafting step then costs a whole
target step, so speculation cannot pay (k drafts + 1 verify = k + 1 steps for k + 1 tokens). The
question a bench wants answered is different: how fast is decoding when every draft is accepted and
the drafter is much cheaper than the target, as real draft models are?

This writes that pair from a dense checkpoint (llama/qwen2/qwen3 layout). The target keeps every
layer but has the output projections (`o_proj`, `down_proj`) of layers >= D set to zero: those
layers still run at full cost, yet add exactly 0 to the residual stream, so the target computes the
same function as its first D layers followed by the final norm and head. The draft is those first D
layers, the embeddings, the final norm and the head. Their greedy tokens agree wherever the two
engines' kernels give the same bits for the same layers (a verify runs the extend path, drafting the
decode path), which is what acceptance counts show.

    python -m tools.models.agreeing_draft --model .cache/models/small --draft-layers 2 \\
        --target-out .cache/models/small-agreeing --draft-out .cache/models/small-agreeing-draft
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

DENSE_TYPES = ("llama", "qwen2", "qwen3")
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# The weights whose output is added to the residual stream: zero them and the layer adds nothing.
RESIDUAL_WRITERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "self_attn.o_proj.bias")


def _layer(key: str) -> int | None:
    match = LAYER_KEY.match(key)
    return int(match.group(1)) if match else None


def write_pair(model: Path, draft_layers: int, target_out: Path, draft_out: Path) -> tuple[Path, Path]:
    config = json.loads((model / "config.json").read_text())
    if config.get("model_type") not in DENSE_TYPES:
        raise SystemExit(f"{model}: model_type {config.get('model_type')!r} is not one of {DENSE_TYPES}")
    layers = int(config["num_hidden_layers"])
    if not 1 <= draft_layers < layers:
        raise SystemExit(f"--draft-layers must be 1..{layers - 1} (the target has {layers} layers)")
    weights_files = sorted(model.glob("*.safetensors"))
    if len(weights_files) != 1:
        raise SystemExit(f"{model}: expected one model.safetensors, found {len(weights_files)}")
    tensors = load_file(str(weights_files[0]))

    target = {}
    for key, tensor in tensors.items():
        index = _layer(key)
        silent = index is not None and index >= draft_layers and key.endswith(RESIDUAL_WRITERS)
        target[key] = tensor.zero_() if silent else tensor
    draft = {key: tensor for key, tensor in target.items()
             if (index := _layer(key)) is None or index < draft_layers}

    for out, weights, config_out in ((target_out, target, config),
                                     (draft_out, draft, config | {"num_hidden_layers": draft_layers})):
        out.mkdir(parents=True, exist_ok=True)
        for extra in model.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json":
                shutil.copy(extra, out / extra.name)
        (out / "config.json").write_text(json.dumps(config_out, indent=2))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    return target_out, draft_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a dense HF checkpoint folder")
    parser.add_argument("--draft-layers", type=int, default=2, help="layers the draft keeps (D)")
    parser.add_argument("--target-out", type=Path, required=True)
    parser.add_argument("--draft-out", type=Path, required=True)
    args = parser.parse_args(argv)
    target, draft = write_pair(args.model, args.draft_layers, args.target_out, args.draft_out)
    print(f"wrote target {target} and its always-agreeing {args.draft_layers}-layer draft {draft}")


if __name__ == "__main__":
    main()
