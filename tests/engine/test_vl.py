"""Qwen2-VL served colocated (the tiny-vl preset): fp32 greedy tokens equal to transformers'
Qwen2VLForConditionalGeneration.generate given the same pixel_values, logprobs within 1e-3; an
image's digest in its pages' hashes (different images, different pages; the same image, a
prefix-cache hit); and the preprocessing's resize rule and patch order."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from PIL import Image

from engine.models.mrope import mrope_positions
from engine.multimodal.image_processor import ImageProcessorConfig, patchify, preprocess, smart_resize
from engine.multimodal.prompt import expand_image_tokens
from engine.multimodal.state import MultimodalState
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from pdserve.page_hash import page_hashes
from tests.engine.conftest import generate, start_engine
from tools.models.tiny_model import write_tiny_model
from tools.models.tiny_vl import IMAGE_PAD, VISION_TOKEN_IDS

PAD = VISION_TOKEN_IDS[IMAGE_PAD]
PAGE = 16
NEW = 10
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "vl", preset="tiny-vl", seed=0)


@pytest.fixture(scope="module")
def hf_model(vl_ckpt):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(vl_ckpt), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(vl_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vl_ckpt))


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def chat_prompt(tokenizer, parts: list, images) -> list[int]:
    """A user turn of `parts` ("IMAGE" for an image part), templated and with pads expanded."""
    content = [{"type": "image"} if p == "IMAGE" else {"type": "text", "text": p} for p in parts]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return expand_image_tokens(tokenizer(text)["input_ids"], images, PAD, 2)


def hf_generate(model, prompt: list[int], images) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    kwargs = {}
    if images:
        kwargs = dict(pixel_values=torch.cat([i.pixel_values for i in images]),
                      image_grid_thw=torch.tensor([i.grid_thw for i in images]),
                      mm_token_type_ids=(ids == PAD).int())
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **kwargs)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


def engine_generate(engine, prompt: list[int], images, room: str) -> tuple[list[int], list[float]]:
    async def run():
        return [o async for o in generate(engine, prompt, GREEDY, room, images=tuple(images))]

    outputs = asyncio.run(run())
    return [o.token_id for o in outputs], [o.logprob for o in outputs]


def assert_matches(got, expected) -> None:
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], abs=1e-3)


@pytest.fixture(scope="module")
def processor_config(vl_ckpt):
    return ImageProcessorConfig.from_dir(vl_ckpt)


@pytest.fixture(scope="module")
def cases(tokenizer, processor_config):
    one = [preprocess(random_image(130, 90, 1), processor_config)]
    two = [preprocess(random_image(60, 200, 2), processor_config), preprocess(random_image(100, 100, 3),
                                                                              processor_config)]
    assert one[0].grid_thw != two[0].grid_thw != two[1].grid_thw
    return {
        "text+1 image": (chat_prompt(tokenizer, ["Look at", "IMAGE", "what is it?"], one), one),
        "text+2 images": (chat_prompt(tokenizer, ["compare", "IMAGE", "with", "IMAGE", "please"], two), two),
        "image alone": (chat_prompt(tokenizer, ["IMAGE"], one), one),
        "text only": (chat_prompt(tokenizer, ["The quick brown fox jumps over the lazy dog."], []), []),
    }


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_greedy_matches_transformers(vl_ckpt, hf_model, cases, cpu_kernels):
    # chunks of 16 split the images' token runs across prefill chunks
    engine = start_engine(vl_ckpt, page_size=PAGE, chunked_prefill_size=16, cpu_kernels=cpu_kernels,
                          disable_radix_cache=True)
    try:
        for name, (prompt, images) in cases.items():
            assert sum(t == PAD for t in prompt) == sum(i.num_tokens(2) for i in images), name
            assert_matches(engine_generate(engine, prompt, images, name),
                           hf_generate(hf_model, prompt, images))
    finally:
        engine.shutdown()


def test_image_digest_in_page_hashes(tokenizer, processor_config):
    first = [preprocess(random_image(100, 100, 4), processor_config)]
    second = [preprocess(random_image(100, 100, 5), processor_config)]
    prompt = chat_prompt(tokenizer, ["describe", "IMAGE", "in detail, please, with many words here"], first)
    assert prompt == chat_prompt(tokenizer, ["describe", "IMAGE", "in detail, please, with many words here"],
                                 second)

    def hashes(images):
        state = MultimodalState.build(prompt, images, PAD, 2, PAGE)
        return page_hashes(prompt, PAGE, salts=state.page_salts)

    text_only = page_hashes(prompt, PAGE)
    a, b = hashes(first), hashes(second)
    assert len(a) >= 3
    first_image_page = prompt.index(PAD) // PAGE
    # pages before the image are text's; from the image's first page on, each image's own
    assert a[:first_image_page] == b[:first_image_page] == text_only[:first_image_page]
    assert all(x != y for x, y in zip(a[first_image_page:], b[first_image_page:], strict=True))
    assert a == hashes(first)


def test_prefix_cache_per_image(vl_ckpt, hf_model, tokenizer, processor_config):
    first = [preprocess(random_image(100, 100, 6), processor_config)]
    second = [preprocess(random_image(100, 100, 7), processor_config)]
    parts = ["describe", "IMAGE", "in detail"]
    prompt = chat_prompt(tokenizer, parts, first)
    engine = start_engine(vl_ckpt, page_size=PAGE)
    try:
        expected_first = hf_generate(hf_model, prompt, first)
        assert_matches(engine_generate(engine, prompt, first, "a"), expected_first)
        hits = engine.stats().prefix_hit_tokens
        # same text, another image: only the text pages before the image may be shared
        assert_matches(engine_generate(engine, prompt, second, "b"), hf_generate(hf_model, prompt, second))
        shared_text = prompt.index(PAD) // PAGE * PAGE
        assert engine.stats().prefix_hit_tokens - hits == shared_text
        hits = engine.stats().prefix_hit_tokens
        # the first image again: every full page but the last token's comes from the cache
        assert_matches(engine_generate(engine, prompt, first, "c"), expected_first)
        assert engine.stats().prefix_hit_tokens - hits == (len(prompt) - 1) // PAGE * PAGE
    finally:
        engine.shutdown()


def test_refusals(vl_ckpt, qwen3_ckpt, tokenizer, processor_config):
    image = preprocess(random_image(100, 100, 8), processor_config)
    prompt = chat_prompt(tokenizer, ["see", "IMAGE"], [image])
    engine = start_engine(qwen3_ckpt)
    try:
        with pytest.raises(ValueError, match="text-only model"):
            engine.check(EngineRequest("x", prompt, GREEDY, images=(image,)))
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="exactly 16 image-pad tokens"):
        mrope_positions([1, PAD, PAD, 2], [image.grid_thw], PAD, 2)
    with pytest.raises(ValueError, match="2 images sent"):
        mrope_positions(prompt, [image.grid_thw] * 2, PAD, 2)
    with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
        expand_image_tokens([1, PAD, 2], [image, image], PAD, 2)


@pytest.mark.parametrize(("height", "width", "expected"), [
    (100, 100, (112, 112)),  # rounded to multiples of 28
    (90, 130, (84, 140)),
    (10, 10, (56, 56)),  # raised to min_pixels (56 * 56)
    (1000, 1000, (224, 224)),  # lowered below max_pixels (28 * 28 * 64)
    (28, 1000, (28, 1008)),
    (5, 200, (28, 364)),  # rounds to 0 rows, then raised to min_pixels
])
def test_smart_resize(height, width, expected):
    got = smart_resize(height, width, 28, 56 * 56, 28 * 28 * 64)
    assert got == expected
    assert got[0] % 28 == 0 and got[1] % 28 == 0
    assert 56 * 56 <= got[0] * got[1] <= 28 * 28 * 64


def test_smart_resize_refuses_extreme_aspect():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100, 28, 56 * 56, 28 * 28 * 1280)


def test_patch_shapes_and_order(processor_config):
    image = preprocess(random_image(130, 90, 9), processor_config)
    assert image.grid_thw == (1, 6, 10)
    assert tuple(image.pixel_values.shape) == (60, 3 * 2 * 14 * 14)
    assert image.num_tokens(2) == 15
    # patchify's order: the 2x2 merge windows row by row, within a window its patches row by row;
    # each patch flattened [channel, time, row, column] with the frame repeated in time
    frames = np.random.default_rng(0).standard_normal((2, 3, 56, 84)).astype(np.float32)
    frames[1] = frames[0]
    patches = patchify(frames, 14, 2, 2).reshape(-1, 3, 2, 14, 14)
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    for row, (r, c) in enumerate(order):
        expected = frames[0, :, r * 14:(r + 1) * 14, c * 14:(c + 1) * 14]
        assert np.array_equal(patches[row, :, 0], expected)
        assert np.array_equal(patches[row, :, 1], expected)


@pytest.mark.parametrize(("width", "height"), [(130, 90), (60, 200), (1000, 700), (10, 10), (3, 500)])
def test_preprocess_matches_transformers_pil_processor(vl_ckpt, processor_config, width, height):
    # transformers' PIL-backend processor (no torchvision needed) as the reference
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil.from_pretrained(str(vl_ckpt))
    image = random_image(width, height, width * height)
    expected = reference(images=[image], return_tensors="pt")
    got = preprocess(image, processor_config)
    assert [list(got.grid_thw)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], atol=1e-5, rtol=0)


def test_tiny_vl_checkpoint(vl_ckpt, tokenizer, tmp_path):
    again = write_tiny_model(tmp_path / "vl", preset="tiny-vl", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (vl_ckpt / name).read_bytes(), name
    assert (vl_ckpt / "model.safetensors").stat().st_size < 5 << 20
    assert tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]) == \
        [VISION_TOKEN_IDS[t] for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    # a pad written in text is the special token, never split
    assert tokenizer("a<|image_pad|>b")["input_ids"].count(PAD) == 1


def encoded(picture: Image.Image, fmt: str = "PNG") -> bytes:
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format=fmt)
    return buffer.getvalue()


def test_decode_refusals_and_expansion(vl_ckpt):
    from engine.models.config import ModelConfig
    from engine.multimodal.decode import MAX_IMAGES, decode_image, prepare

    model = ModelConfig.from_dir(vl_ckpt)
    png = encoded(random_image(100, 100, 10))
    prompt, images = prepare(str(vl_ckpt), model, [1, PAD, 2], [png])
    assert prompt == [1] + [PAD] * 16 + [2] and images[0].grid_thw == (1, 8, 8)
    with pytest.raises(ValueError, match="not a PNG, JPEG or WebP"):
        decode_image(b"GIF89a" + bytes(100))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        decode_image(png[: len(png) // 2])
    with pytest.raises(ValueError, match="pixels; at most"):
        decode_image(encoded(Image.new("RGB", (10000, 5000))))
    with pytest.raises(ValueError, match=f"at most {MAX_IMAGES}"):
        prepare(str(vl_ckpt), model, [1] + [PAD] * 17, [png] * 17)
    with pytest.raises(ValueError, match="text-only model"):
        prepare(str(vl_ckpt), ModelConfig.from_dict(json.loads((vl_ckpt / "config.json").read_text())
                                                    | {"architectures": ["Qwen2ForCausalLM"],
                                                       "model_type": "qwen2"}
                                                    ), [1, PAD], [png])


def test_language_only_engine_takes_embeddings_from_the_request(vl_ckpt, hf_model, cases):
    """EPD's engine hook: a --language-only engine loads no tower; the rows an encoder made (here the
    tower run apart, as the encoder service runs it) give transformers' tokens; without them, or of
    the wrong shape, the request is refused with a message."""
    from engine.models.config import ModelConfig
    from engine.models.vision import VisionTower

    prompt, images = cases["text+2 images"]
    tower = VisionTower.load(str(vl_ckpt), ModelConfig.from_dir(vl_ckpt), torch.float32, torch.device("cpu"))
    rows = tower.encode(images)
    engine = start_engine(vl_ckpt, page_size=PAGE, chunked_prefill_size=16, language_only=True,
                          disable_radix_cache=True)
    try:
        assert engine.model.vision is None

        async def run(**kind):
            return [o async for o in generate(engine, prompt, GREEDY, "epd", images=tuple(images), **kind)]

        outputs = asyncio.run(run(image_embeddings=rows))
        assert_matches(([o.token_id for o in outputs], [o.logprob for o in outputs]),
                       hf_generate(hf_model, prompt, images))
        with pytest.raises(ValueError, match="loads no vision tower"):
            asyncio.run(run())
        with pytest.raises(ValueError, match="do not match the prompt's"):
            asyncio.run(run(image_embeddings=rows[1:]))
        assert engine.stats().used_pages == 0
    finally:
        engine.shutdown()
