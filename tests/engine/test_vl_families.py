"""Qwen2.5-VL (tiny-qwen25-vl), Qwen3-VL (tiny-qwen3-vl) and LLaVA (tiny-llava) served colocated:
fp32 greedy tokens equal to transformers' Qwen2_5_VLForConditionalGeneration /
Qwen3VLForConditionalGeneration / LlavaForConditionalGeneration generate given the same pixel
values, logprobs within 1e-3, for text + 1 image, text + 2 images of different sizes and an image
alone, with the C++ kernels and with torch ops; LLaVA's plain positions and
its images' page salts; its CLIP preprocessing against transformers' CLIPImageProcessorPil."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from engine.models.config import ModelConfig
from engine.models.vision_clip import unpatchify
from engine.multimodal.clip_processor import ClipProcessorConfig, center_crop, resized_size
from engine.multimodal.decode import prepare, processor_config
from engine.multimodal.prompt import expand_image_tokens
from engine.multimodal.state import MultimodalState
from pdserve.page_hash import page_hashes
from tests.engine.conftest import start_engine
from tests.engine.test_vl import NEW, assert_matches, engine_generate
from tools.models.tiny_llava import IMAGE_TOKEN_ID, IMAGE_TOKENS, PREPROCESSOR
from tools.models.tiny_model import write_tiny_model
from tools.models.tiny_vl import IMAGE_PAD, VISION_TOKEN_IDS

PAGE = 16


@dataclass(frozen=True)
class Family:
    preset: str
    model_class: str
    image_token_id: int
    merge_size: int
    tokens_100px: int  # a 100x100 image's tokens

    def hf_images(self, images, ids: torch.Tensor) -> dict:
        """generate's image arguments, from the engine's own preprocessed images."""
        if self.model_class == "LlavaForConditionalGeneration":
            return dict(pixel_values=torch.stack([unpatchify(i, 14) for i in images]))
        return dict(pixel_values=torch.cat([i.pixel_values for i in images]),
                    image_grid_thw=torch.tensor([i.grid_thw for i in images]),
                    mm_token_type_ids=(ids == self.image_token_id).int())


FAMILIES = {
    # 100x100 resized to 112x112: 8x8 patches of 14, 4x4 tokens
    "qwen2.5-vl": Family("tiny-qwen25-vl", "Qwen2_5_VLForConditionalGeneration",
                         VISION_TOKEN_IDS[IMAGE_PAD], 2, 16),
    # 100x100 resized to 96x96: 6x6 patches of 16, 3x3 tokens
    "qwen3-vl": Family("tiny-qwen3-vl", "Qwen3VLForConditionalGeneration", VISION_TOKEN_IDS[IMAGE_PAD], 2, 9),
    "llava": Family("tiny-llava", "LlavaForConditionalGeneration", IMAGE_TOKEN_ID, 1, IMAGE_TOKENS),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def ckpt(family, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / family.preset, preset=family.preset, seed=0)


@pytest.fixture(scope="module")
def hf_model(family, ckpt):
    import transformers

    return getattr(transformers, family.model_class).from_pretrained(str(ckpt), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def chat_prompt(family: Family, tokenizer, parts: list, images) -> list[int]:
    """A user turn of `parts` ("IMAGE" for an image part), templated and with pads expanded."""
    content = [{"type": "image"} if p == "IMAGE" else {"type": "text", "text": p} for p in parts]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return expand_image_tokens(tokenizer(text)["input_ids"], images, family.image_token_id, family.merge_size)


def hf_generate(family: Family, model, prompt: list[int], images) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    kwargs = family.hf_images(images, ids) if images else {}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **kwargs)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


@pytest.fixture(scope="module")
def cases(family, ckpt, tokenizer):
    config = processor_config(str(ckpt))
    one = [config.preprocess(random_image(130, 90, 1))]
    # Qwen2.5-VL: 200x60 and 100x100 give grids of 2x7 and 4x4 image tokens, in one and several
    # attention windows (2x2 tokens each); LLaVA crops both to 56x56
    two = [config.preprocess(random_image(60, 200, 2)), config.preprocess(random_image(100, 100, 3))]
    return {
        "text+1 image": (chat_prompt(family, tokenizer, ["Look at", "IMAGE", "what is it?"], one), one),
        "text+2 images": (chat_prompt(family, tokenizer,
                                      ["compare", "IMAGE", "with", "IMAGE", "please"], two), two),
        "image alone": (chat_prompt(family, tokenizer, ["IMAGE"], one), one),
        "text only": (chat_prompt(family, tokenizer,
                                  ["The quick brown fox jumps over the lazy dog."], []), []),
    }


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_greedy_matches_transformers(family, ckpt, hf_model, cases, cpu_kernels):
    # chunks of 16 split the images' token runs across prefill chunks
    engine = start_engine(ckpt, page_size=PAGE, chunked_prefill_size=16, cpu_kernels=cpu_kernels,
                          disable_radix_cache=True)
    try:
        for name, (prompt, images) in cases.items():
            pads = sum(t == family.image_token_id for t in prompt)
            assert pads == sum(i.num_tokens(family.merge_size) for i in images), name
            expected = hf_generate(family, hf_model, prompt, images)
            assert_matches(engine_generate(engine, prompt, images, name), expected)
    finally:
        engine.shutdown()


def test_prefix_cache_per_image(family, ckpt, hf_model, tokenizer):
    config = processor_config(str(ckpt))
    first = [config.preprocess(random_image(100, 100, 6))]
    second = [config.preprocess(random_image(100, 100, 7))]
    parts = ["describe", "IMAGE", "in detail"]
    prompt = chat_prompt(family, tokenizer, parts, first)
    engine = start_engine(ckpt, page_size=PAGE)
    try:
        expected_first = hf_generate(family, hf_model, prompt, first)
        assert_matches(engine_generate(engine, prompt, first, "a"), expected_first)
        hits = engine.stats().prefix_hit_tokens
        # same text, another image: only the text pages before the image may be shared
        assert_matches(engine_generate(engine, prompt, second, "b"),
                       hf_generate(family, hf_model, prompt, second))
        assert engine.stats().prefix_hit_tokens - hits == prompt.index(family.image_token_id) // PAGE * PAGE
        hits = engine.stats().prefix_hit_tokens
        # the first image again: every full page but the last token's comes from the cache
        assert_matches(engine_generate(engine, prompt, first, "c"), expected_first)
        assert engine.stats().prefix_hit_tokens - hits == (len(prompt) - 1) // PAGE * PAGE
    finally:
        engine.shutdown()


def test_llava_plain_positions_and_salts():
    clip = ClipProcessorConfig(shortest_edge=28, crop_height=28, crop_width=28)
    images = [clip.preprocess(random_image(40, 30, s)) for s in (1, 2)]
    assert images[0].grid_thw == (1, 2, 2) and images[0].num_tokens(1) == 4
    pad = 9
    # two images back to back: their tokens in order, as transformers' masked_scatter fills them
    prompt = [1] * 14 + [pad] * 8 + [2] * 20
    state = MultimodalState.build(prompt, images, pad, 1, PAGE, mrope=False)
    assert state.rope_delta == 0 and state.positions.tolist() == [list(range(len(prompt)))]
    assert state.position_rows(40, 45).tolist() == [list(range(40, 45))]
    assert state.pad_positions.tolist() == list(range(14, 22))
    # page 0 holds image 0's first two tokens, page 1 the rest of both images
    assert state.page_salts[0] != 0 and state.page_salts[1] != 0 and state.page_salts[2] == 0
    hashes = page_hashes(prompt, PAGE, salts=state.page_salts)
    swapped = page_hashes(prompt, PAGE, salts=MultimodalState.build(prompt, images[::-1], pad, 1, PAGE,
                                                                    mrope=False).page_salts)
    text_only = page_hashes(prompt, PAGE)
    assert all(a != b != c for a, b, c in zip(hashes, swapped, text_only, strict=True))
    assert hashes == page_hashes(prompt, PAGE, salts=MultimodalState.build(prompt, images, pad, 1, PAGE,
                                                                           mrope=False).page_salts)
    with pytest.raises(ValueError, match="2 images need 8 image-pad tokens; the prompt has 7"):
        MultimodalState.build(prompt[:14] + prompt[15:], images, pad, 1, PAGE, mrope=False)


@pytest.mark.parametrize(("width", "height"),
                         [(130, 90), (60, 200), (56, 56), (1000, 700), (10, 10), (3, 500)])
def test_clip_preprocess_matches_transformers(width, height, tmp_path):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 14}}))
    reference = CLIPImageProcessorPil.from_pretrained(str(tmp_path))
    image = random_image(width, height, width * height)
    expected = reference(images=[image], return_tensors="pt")["pixel_values"]
    got = ClipProcessorConfig.from_dir(tmp_path).preprocess(image)
    assert got.grid_thw == (1, 4, 4)
    torch.testing.assert_close(unpatchify(got, 14)[None], expected, atol=1e-5, rtol=0)


def test_clip_resize_and_crop_rules():
    assert resized_size(90, 130, 56) == (56, 80)  # shorter side to 56, the longer int(56 * 130 / 90)
    assert resized_size(200, 60, 56) == (186, 56)
    pixels = np.arange(2 * 3 * 5).reshape(2, 3, 5)
    assert center_crop(pixels, 2, 2).tolist() == pixels[:, 0:2, 1:3].tolist()
    padded = center_crop(pixels, 5, 5)  # smaller than the crop: zero-padded around it, as transformers
    assert padded.shape == (2, 5, 5)
    assert padded[:, 1:4, :].tolist() == pixels.tolist() and padded[:, 0].sum() == 0


def test_checkpoints_are_deterministic_and_small(family, ckpt, tokenizer, tmp_path):
    again = write_tiny_model(tmp_path / "again", preset=family.preset, seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json",
                 "chat_template.jinja"):
        assert (again / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert (ckpt / "model.safetensors").stat().st_size < 5 << 20
    config = ModelConfig.from_dir(ckpt)
    assert config.is_multimodal and config.image_token_id == family.image_token_id
    assert (config.mrope_section is None) == (family.preset == "tiny-llava")
    # the placeholder written in text is the special token, never split
    token = tokenizer.convert_ids_to_tokens(family.image_token_id)
    assert tokenizer(f"a{token}b")["input_ids"].count(family.image_token_id) == 1


def test_prepare_expands_each_family(family, ckpt):
    import io

    buffer = io.BytesIO()
    random_image(100, 100, 10).save(buffer, format="PNG")
    prompt, images = prepare(str(ckpt), ModelConfig.from_dir(ckpt), [1, family.image_token_id, 2],
                             [buffer.getvalue()])
    assert prompt == [1] + [family.image_token_id] * family.tokens_100px + [2]


def test_refusals(tmp_path):
    import shutil

    from engine.models.vision import load_vision_tower

    with pytest.raises(ValueError, match="written by the tiny-llava preset only"):
        write_tiny_model(tmp_path / "x", preset="tiny", arch="llava")
    llava = write_tiny_model(tmp_path / "llava", preset="tiny-llava", seed=0)
    raw = json.loads((llava / "config.json").read_text())
    with pytest.raises(ValueError, match="LLaVA with a 'gemma' decoder is not supported"):
        ModelConfig.from_dict({**raw, "text_config": {**raw["text_config"], "model_type": "gemma"}})
    changed = tmp_path / "changed"
    shutil.copytree(llava, changed)
    (changed / "config.json").write_text(json.dumps({**raw, "vision_feature_select_strategy": "full"}))
    with pytest.raises(ValueError, match="'full' is not supported"):
        load_vision_tower(str(changed), ModelConfig.from_dir(changed), torch.float32, torch.device("cpu"))
    (changed / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "do_pad": True}))
    with pytest.raises(ValueError, match="do_pad"):
        ClipProcessorConfig.from_dir(changed)
    (changed / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "crop_size": {"height": 50,
                                                                                               "width": 50}}))
    with pytest.raises(ValueError, match="not a multiple of the tower's patch size 14"):
        ClipProcessorConfig.from_dir(changed)


def test_clip_defaults_without_preprocessor_config(tmp_path):
    import shutil

    llava = write_tiny_model(tmp_path / "llava", preset="tiny-llava", seed=0)
    bare = tmp_path / "bare"
    shutil.copytree(llava, bare)
    (bare / "preprocessor_config.json").unlink()
    # the tower's image_size (56) for both the resize and the crop, CLIP's mean/std
    assert processor_config(str(bare)) == ClipProcessorConfig.from_dir(llava)
