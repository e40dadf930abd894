"""Two checkpoints as transformers' save_pretrained writes them, served as real processes colocated, PD
(mooncake and nixl) and, for the vision one, EPD (over nixl), driven by the official openai client:
fp32 greedy text equal to transformers' for text and for images.

- A Qwen3-MoE: 8 experts, top-2, the first layer dense through mlp_only_layers, norm_topk_prob
  false; config.json holds the count as num_local_experts (what transformers 5 writes).
- A Qwen2-VL: a 2-block tower of width 64, mrope_section [4, 6, 6] under rope_parameters, an image
  processor with min_pixels 3136 / max_pixels 50176 saved by Qwen2VLImageProcessorPil; asked about
  a 96x64 PNG, opaque and with an alpha channel (laid over white, as transformers does).

One deployment per mode serves both checkpoints (a gateway each).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_epd import encoder_args, language_only_args
from tests.e2e.test_vl_chat import NEW, data_url, hf_reference
from tests.engine.test_vl_sweep import CASES, build_config, image_processor

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
FLAGS = ("--num-pages", "256", "--chunked-prefill-size", "32")
TEXT = "Tell me a story about the sea"


@dataclass(frozen=True)
class Checkpoints:
    moe: Path
    vl: Path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    from transformers import Qwen3MoeConfig

    from tools.models.saved_checkpoint import save_random_checkpoint, write_tokenizer_files

    root = tmp_path_factory.mktemp("saved")
    tokenizer = write_tokenizer_files(root / "tokenizer")
    moe = Qwen3MoeConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0],
                         norm_topk_prob=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         architectures=["Qwen3MoeForCausalLM"])
    case = CASES["qwen2-vl reported"]
    return Checkpoints(
        moe=save_random_checkpoint(root / "qwen3-moe-saved", moe, seed=1, tokenizer_dir=tokenizer),
        vl=save_random_checkpoint(root / "qwen2-vl-saved", build_config(case), seed=2,
                                  tokenizer_dir=tokenizer, image_processor=image_processor(case)))


def picture(mode: str) -> Image.Image:
    pixels = np.random.default_rng(5).integers(0, 256, (64, 96, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA").convert(mode)


def hf_text(model_dir: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=True,
                                        tokenize=False)
    prompt = tokenizer(ids)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return tokenizer.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)


@dataclass
class Served:
    mode: str
    gateways: dict[str, Proc]  # "moe" / "vl" -> its gateway

    def chat(self, which: str, model_dir: Path, parts: list, pictures: list[Image.Image]) -> str:
        content, images = [], iter(pictures)
        for part in parts:
            content.append({"type": "image_url", "image_url": {"url": data_url(next(images))}} if part is None
                           else {"type": "text", "text": part})
        client = openai.OpenAI(base_url=f"http://{self.gateways[which].address}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        answer = client.chat.completions.create(
            model=model_dir.name, messages=[{"role": "user", "content": content}], max_tokens=NEW,
            temperature=0, extra_body={"ignore_eos": True})
        return answer.choices[0].message.content or ""


def _gateway(cluster: Cluster, name: str, model_dir: Path, *, worker: Proc | None = None,
             bootstrap: Proc | None = None) -> Proc:
    target = ["--worker", f"http://{worker.address}"] if worker else ["--bootstrap", bootstrap.address]
    return cluster.start(f"gateway-{name}", ["launch-router", "--model-path", str(model_dir), "--port", "0",
                                             *target], timeout_s=60)


def _start(cluster: Cluster, mode: str, ckpts: Checkpoints) -> dict[str, Proc]:
    models = {"moe": ckpts.moe, "vl": ckpts.vl}
    if mode == "colocated":
        workers = cluster.start_many([(f"worker-{k}", worker_args(str(d), "null", extra=FLAGS))
                                      for k, d in models.items()], 240)
        return {k: _gateway(cluster, k, d, worker=w)
                for (k, d), w in zip(models.items(), workers, strict=True)}
    if mode == "epd-nixl":  # the VL checkpoint only: encoder -> language-only worker over nixl
        bootstrap = cluster.bootstrap()
        cluster.start("encoder", encoder_args(ckpts.vl, "nixl", bootstrap), timeout_s=240)
        worker = cluster.start("worker", language_only_args(ckpts.vl, "nixl", [], bootstrap), timeout_s=240)
        return {"vl": _gateway(cluster, "vl", ckpts.vl, worker=worker)}
    backend = mode.removeprefix("pd-")
    bootstraps = {k: cluster.bootstrap() for k in models}
    cluster.start_many([(f"{role}-{k}", worker_args(str(d), role, backend=backend, bootstrap=bootstraps[k],
                                                    extra=FLAGS))
                        for k, d in models.items() for role in ("prefill", "decode")], 240)
    return {k: _gateway(cluster, k, d, bootstrap=bootstraps[k]) for k, d in models.items()}


# Colocated in `make test` (both checkpoints end to end); PD on each backend and EPD in `make test-all`
# (about 45 s a deployment here; PD and EPD of the presets run in make test elsewhere).
@pytest.fixture(scope="module", params=["colocated", pytest.param("pd-mooncake", marks=pytest.mark.long),
                                        pytest.param("pd-nixl", marks=pytest.mark.long),
                                        pytest.param("epd-nixl", marks=pytest.mark.long)])
def served(request, checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with Cluster(tmp_path_factory.mktemp(f"saved-{request.param}")) as cluster:
        try:
            deployment = Served(request.param, _start(cluster, request.param, checkpoints))

            def serves() -> bool:
                try:
                    for which, gateway in deployment.gateways.items():
                        if httpx.get(f"http://{gateway.address}/health", timeout=5).status_code != 200:
                            return False
                        deployment.chat(which, getattr(checkpoints, which), ["hello"], [])
                    return True
                except (openai.APIError, httpx.HTTPError):
                    return False

            wait_until(serves, 90, f"the {request.param} deployment to serve")
            yield deployment
        except BaseException:
            print(cluster.logs())
            raise


def test_text_matches_transformers(served: Served, checkpoints: Checkpoints):
    for which in served.gateways:
        model_dir = getattr(checkpoints, which)
        expected = hf_text(model_dir) if which == "moe" else hf_reference(model_dir, [TEXT], [])
        assert served.chat(which, model_dir, [TEXT], []) == expected, which


@pytest.mark.parametrize("modes", [("RGB",), ("RGBA",), ("RGBA", "RGB")], ids=["opaque", "alpha", "two"])
def test_images_match_transformers(served: Served, checkpoints: Checkpoints, modes):
    pictures = [picture(m) for m in modes]
    parts = ["Look at", *[None for _ in pictures], "what is it?"]
    expected = hf_reference(checkpoints.vl, parts, pictures)
    assert served.chat("vl", checkpoints.vl, parts, pictures) == expected
