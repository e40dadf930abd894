"""Rewrite a DeepSeek-V3 checkpoint so that its MTP layer nearly agrees with the target: NEXTN's
upper bound (random weights otherwise give an MTP layer whose drafts are almost never accepted).

The target's layers after the first are silenced (attention output and MLP down projections zero:
each leaves the residual stream as it found it, yet costs what it did), so the target computes
head(norm(layer0(embed(tokens)))). The MTP layer becomes a copy of layer 0 whose eh_proj passes the
normed embedding through and drops the hidden state, with the target's final norm and head; the
embedding rows are scaled to unit RMS so that enorm's normalisation leaves them as they were. The
MTP layer at position i then sees the tokens t_1..t_{i+1}, the target at i + 1 sees t_0..t_{i+1}:
the same relative positions, only the first token missing, so its drafts mostly match.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_SILENCED = re.compile(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.(.*\.)?down_proj)\.weight")


def make_mtp_agree(model_dir: str | Path) -> Path:
    """Rewrite `model_dir`'s model.safetensors in place (see the module docstring); returns the folder."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    if not config.get("num_nextn_predict_layers"):
        raise ValueError(f"{model_dir} has no MTP layer (config.json num_nextn_predict_layers)")
    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    mtp = f"model.layers.{num_layers}."
    for name, tensor in weights.items():
        silenced = _SILENCED.fullmatch(name)
        if silenced and 0 < int(silenced[1]) < num_layers:
            tensor.zero_()
    embed = weights["model.embed_tokens.weight"]
    embed.div_(embed.float().pow(2).mean(dim=-1, keepdim=True).sqrt().to(embed.dtype))
    weights = {name: tensor for name, tensor in weights.items() if not name.startswith(mtp)
               or name[len(mtp):].split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head")}
    first = "model.layers.0."
    weights.update({mtp + name[len(first):]: tensor.clone() for name, tensor in weights.items()
                    if name.startswith(first)})
    hidden = config["hidden_size"]
    eh_proj = torch.zeros(hidden, 2 * hidden, dtype=embed.dtype)
    eh_proj[:, :hidden] = torch.eye(hidden, dtype=embed.dtype)
    weights[mtp + "eh_proj.weight"] = eh_proj
    weights[mtp + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    weights[mtp + "shared_head.head.weight"] = weights.get("lm_head.weight", embed).clone()
    save_file(weights, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates it owner-only; as tools.models.tiny_model does
    return model_dir
