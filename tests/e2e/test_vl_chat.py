"""Images through the OpenAI chat API: a tiny-vl colocated worker behind a gateway, as real
processes, driven by the official openai client with `image_url` data URLs. Greedy fp32 output
equals transformers' Qwen2VLForConditionalGeneration given transformers' own (PIL) image
processor; bad image input answers 400 with a message, and the worker's pages are free after.
"""

from __future__ import annotations

import base64
import io
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

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
NEW = 8


@dataclass
class Servers:
    model_dir: Path
    vl: Proc  # gateway in front of the tiny-vl worker
    text: Proc  # gateway in front of a text-only (tiny Qwen3) worker
    vl_worker: Proc

    def client(self, gateway: Proc) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                             timeout=120)


def router(model_dir, worker: Proc) -> list[str]:
    return ["launch-router", "--model-path", str(model_dir), "--port", "0", "--worker", f"http://{worker.address}"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    from tools.models.tiny_model import write_tiny_model

    vl_dir = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-vl", preset="tiny-vl", seed=0)
    text_dir = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)
    with Cluster(tmp_path_factory.mktemp("vl")) as cluster:
        try:
            vl_worker, text_worker = cluster.start_many([
                ("vl-worker", worker_args(str(vl_dir), "null", extra=("--num-pages", "256"))),
                ("text-worker", worker_args(str(text_dir), "null", extra=("--num-pages", "256")))], 180)
            vl, text = cluster.start_many([("gateway-vl", router(vl_dir, vl_worker)),
                                           ("gateway-text", router(text_dir, text_worker))], 60)
            for gateway in (vl, text):
                wait_until(lambda g=gateway: httpx.get(f"http://{g.address}/health", timeout=5).status_code
                           == 200, 30, f"{gateway.name} to be ready")
            yield Servers(vl_dir, vl, text, vl_worker)
        except BaseException:
            print(cluster.logs())
            raise


def image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(picture: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}[fmt]
    return f"data:{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def hf_reference(model_dir: Path, parts: list, pictures: list[Image.Image]) -> str:
    """transformers end to end: its PIL image processor, the chat template, its model's greedy text."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text)["input_ids"]
    kwargs = {}
    if pictures:
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        processed = processor(images=pictures, return_tensors="pt")
        grids = processed["image_grid_thw"]
        expanded = []
        counts = iter((grids.prod(-1) // 4).tolist())
        pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        for token in ids:
            expanded += [pad] * next(counts) if token == pad else [token]
        ids = expanded
        kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=grids,
                      mm_token_type_ids=(torch.tensor([ids]) == pad).int())
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, **kwargs)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def chat(servers: Servers, gateway: Proc, parts: list, urls: list[str]):
    content, images = [], iter(urls)
    for part in parts:
        content.append({"type": "image_url", "image_url": {"url": next(images)}} if part is None
                       else {"type": "text", "text": part})
    return servers.client(gateway).chat.completions.create(
        model=gateway_model(gateway), messages=[{"role": "user", "content": content}], max_tokens=NEW,
        temperature=0, extra_body={"ignore_eos": True})


def gateway_model(gateway: Proc) -> str:
    return httpx.get(f"http://{gateway.address}/v1/models", timeout=5).json()["data"][0]["id"]


@pytest.mark.parametrize(("parts", "pictures", "fmt"), [
    (["Look at", None, "what is it?"], [(130, 90, 1)], "PNG"),
    (["compare", None, "with", None], [(60, 200, 2), (100, 100, 3)], "WEBP"),
    ([None], [(120, 80, 4)], "PNG"),
    (["just text here"], [], "PNG"),
], ids=["text+1 image", "text+2 images", "image alone", "text only"])
def test_chat_images_match_transformers(servers, parts, pictures, fmt):
    images = [image(*p) for p in pictures]
    answer = chat(servers, servers.vl, parts, [data_url(i, fmt) for i in images])
    assert answer.choices[0].message.content == hf_reference(servers.model_dir, parts, images)


def test_jpeg_is_accepted(servers):
    answer = chat(servers, servers.vl, ["what", None], [data_url(image(64, 64, 5), "JPEG")])
    assert answer.usage.completion_tokens == NEW


def bad_request(servers: Servers, gateway: Proc, urls: list[str], match: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(servers, gateway, ["see"] + [None] * len(urls), urls)
    assert match in raised.value.body["message"], raised.value.body


def test_bad_images_are_refused(servers):
    png = data_url(image(64, 64, 6))
    raw = base64.b64decode(png.split(",", 1)[1])
    bad_request(servers, servers.vl, ["data:image/png;base64," + base64.b64encode(b"not an image").decode()],
                "is not a PNG, JPEG or WebP image")
    bad_request(servers, servers.vl,
                ["data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()],
                "truncated or corrupt")
    bad_request(servers, servers.vl, ["data:text/plain;base64,aGVsbG8="], "expected data:image/png")
    bad_request(servers, servers.vl, ["https://example.com/cat.png"], "remote image URLs are not allowed")
    bad_request(servers, servers.vl, [png] * 17, "at most 16")
    bad_request(servers, servers.text, [png], "images sent to a text-only model")
    # 50 megapixels in a small PNG (one colour compresses well), refused from its header
    big = Image.new("RGB", (10000, 5000), (10, 20, 30))
    bad_request(servers, servers.vl, [data_url(big)], "pixels; at most")
    wait_until(lambda: servers.vl_worker.metric("pdserve:kv_pages_used") == 0, 30,
               "the worker's pages to be free")


def with_private_chunk(png: bytes, size: int) -> bytes:
    """`png` with a private ancillary chunk of `size` random bytes before its end: the same pixels,
    a body big enough that the gateway parses it and decodes its image in its pool (large_bodies.py)."""
    import os
    import struct
    import zlib

    data = os.urandom(size)
    chunk = struct.pack(">I", size) + b"prVt" + data + struct.pack(">I", zlib.crc32(b"prVt" + data))
    end = png.rindex(b"IEND") - 4
    return png[:end] + chunk + png[end:]


def test_a_large_image_body_and_a_concurrent_stream(servers):
    import threading

    picture = image(96, 64, 7)
    small = data_url(picture)
    large = "data:image/png;base64," + base64.b64encode(
        with_private_chunk(base64.b64decode(small.split(",", 1)[1]), 6_000_000)).decode()
    client = servers.client(servers.vl)
    messages = [{"role": "user", "content": "tell me a story about a boat"}]
    streamed: list[str] = []

    def stream() -> None:
        for chunk in client.chat.completions.create(model=gateway_model(servers.vl), messages=messages,
                                                    max_tokens=48, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True}):
            streamed.append(chunk.choices[0].delta.content or "" if chunk.choices else "")

    uploads = servers.vl_worker.metric("pdserve:image_drop_uploads")
    streaming = threading.Thread(target=stream)
    streaming.start()
    answer = chat(servers, servers.vl, ["what is it?", None], [large])  # an 8 MB body, while the stream runs
    streaming.join(120)
    assert not streaming.is_alive()
    # its 6 MB image went beside the Generate call, through the worker's image drop (image_drop.py)
    assert servers.vl_worker.metric("pdserve:image_drop_uploads") == uploads + 1
    assert servers.vl_worker.metric("pdserve:image_drop_pending_bytes") == 0
    assert answer.choices[0].message.content == chat(servers, servers.vl, ["what is it?", None],
                                                     [small]).choices[0].message.content
    alone = client.chat.completions.create(model=gateway_model(servers.vl), messages=messages, max_tokens=48,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert "".join(streamed) == alone.choices[0].message.content and alone.usage.completion_tokens == 48
