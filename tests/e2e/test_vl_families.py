"""Qwen2.5-VL, Qwen3-VL and LLaVA through the OpenAI chat API: one colocated worker per family
(tiny-qwen25-vl, tiny-qwen3-vl, tiny-llava) behind a gateway, as real processes, driven by the official
openai client with an `image_url` data URL. Greedy fp32 text equals transformers' model given
transformers' own (PIL) image processor for that family (Qwen2VLImageProcessorPil,
CLIPImageProcessorPil), and the worker's pages are free after.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_vl_chat import data_url, image, router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
NEW = 8
PARTS = ["Look at", None, "what is it?"]
# preset -> (transformers model class, its PIL image processor, the image placeholder token)
FAMILIES = {
    "tiny-qwen25-vl": ("Qwen2_5_VLForConditionalGeneration",
                       "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
                       "<|image_pad|>"),
    "tiny-qwen3-vl": ("Qwen3VLForConditionalGeneration",
                      "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
                      "<|image_pad|>"),
    "tiny-llava": ("LlavaForConditionalGeneration",
                   "transformers.models.clip.image_processing_pil_clip.CLIPImageProcessorPil", "<image>"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Proc, Proc]]:
    from tools.models.tiny_model import write_tiny_model

    preset = request.param
    model_dir = write_tiny_model(tmp_path_factory.mktemp("model") / preset, preset=preset, seed=0)
    with Cluster(tmp_path_factory.mktemp(preset)) as cluster:
        try:
            worker = cluster.start_many([("worker", worker_args(str(model_dir), "null",
                                                                extra=("--num-pages", "128")))], 180)[0]
            gateway = cluster.start_many([("gateway", router(model_dir, worker))], 60)[0]
            wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200,
                       30, "the gateway to be ready")
            yield preset, model_dir, gateway, worker
        except BaseException:
            print(cluster.logs())
            raise


def hf_reference(preset: str, model_dir: Path, picture) -> str:
    """transformers end to end: its PIL image processor, the chat template, its model's greedy text."""
    import importlib

    import transformers

    model_name, processor_path, placeholder = FAMILIES[preset]
    module, processor_name = processor_path.rsplit(".", 1)
    processor = getattr(importlib.import_module(module), processor_name).from_pretrained(str(model_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in PARTS]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    processed = processor(images=[picture], return_tensors="pt")
    pad = tokenizer.convert_tokens_to_ids(placeholder)
    kwargs = {"pixel_values": processed["pixel_values"]}
    if "image_grid_thw" in processed:
        count = int(processed["image_grid_thw"].prod()) // 4
        kwargs["image_grid_thw"] = processed["image_grid_thw"]
    else:
        config = transformers.AutoConfig.from_pretrained(str(model_dir))
        count = config.image_seq_length
    ids = []
    for token in tokenizer(text)["input_ids"]:
        ids += [pad] * count if token == pad else [token]
    if "image_grid_thw" in kwargs:
        kwargs["mm_token_type_ids"] = (torch.tensor([ids]) == pad).int()
    model = getattr(transformers, model_name).from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, **kwargs)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_chat_image_matches_transformers(served):
    preset, model_dir, gateway, worker = served
    picture = image(130, 90, 1)
    content = [{"type": "image_url", "image_url": {"url": data_url(picture)}} if p is None
               else {"type": "text", "text": p} for p in PARTS]
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = httpx.get(f"http://{gateway.address}/v1/models", timeout=5).json()["data"][0]["id"]
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == NEW
    expected = hf_reference(preset, model_dir, picture)
    assert expected.strip()  # some text, not only special tokens
    assert answer.choices[0].message.content == expected
    wait_until(lambda: worker.metric("pdserve:kv_pages_used") == 0, 30, "the worker's pages to be free")
