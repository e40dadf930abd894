"""Vision-language checkpoints on unusual but valid settings, written by transformers' save_pretrained:
PNG bytes through pdserve's whole image path (decode, preprocess, placeholder expansion, tower,
M-RoPE) give the same fp32 greedy tokens as transformers' own path (its PIL image processor loaded
from the folder, the chat template, the model's generate).

Each case changes what the presets keep fixed: M-RoPE sections, tower width, depth and head count,
merge size, patch size, window attention layout, deepstack layers, processor pixel bounds (up and
down), image sizes that are not multiples of the patch, transparent and palette PNGs, LLaVA's
feature layer and selection strategy over a Qwen2 decoder.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engine.models.config import ModelConfig
from engine.multimodal.decode import prepare
from engine.sampling import SamplingParams
from tests.engine.conftest import generate, start_engine
from tools.models.saved_checkpoint import VOCAB_SIZE, save_random_checkpoint, write_tokenizer_files
from tools.models.tiny_vl import IMAGE_PAD, VISION_END, VISION_START, VISION_TOKEN_IDS

NEW = 6
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
PAD = VISION_TOKEN_IDS[IMAGE_PAD]
TOKENS = dict(image_token_id=PAD, video_token_id=PAD, vision_start_token_id=VISION_TOKEN_IDS[VISION_START],
              vision_end_token_id=VISION_TOKEN_IDS[VISION_END])


def text(**fields: Any) -> dict[str, Any]:
    base = dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
    return {**base, **fields}


def mrope(section: list[int], **extra: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": "default", "mrope_section": section, "rope_theta": 1e6, **extra}}


# case id -> (config class, text_config, vision_config, other config fields, image processor
#             (class, kwargs), images as (width, height, PIL mode))
CASES: dict[str, tuple] = {
    # the reported checkpoint: 2-block tower of width 64, sections [4, 6, 6] under rope_parameters,
    # pixels within [3136, 50176]; an opaque and a transparent 96x64 PNG
    "qwen2-vl reported": ("Qwen2VLConfig", text(**mrope([4, 6, 6])),
                          dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4), {},
                          ("qwen2", dict(min_pixels=3136, max_pixels=50176)),
                          [(96, 64, "RGB"), (96, 64, "RGBA")]),
    # sections [2, 7, 7], a 1-block tower of width 48 with 3 heads, merge 1 (a token per patch),
    # 8-pixel patches, pixel bounds that shrink a 300x77 image and grow a 13x9 palette image
    "qwen2-vl merge 1": ("Qwen2VLConfig", text(**mrope([2, 7, 7])),
                         dict(depth=1, embed_dim=48, hidden_size=128, num_heads=3, mlp_ratio=2,
                              patch_size=8, spatial_merge_size=1), {},
                         ("qwen2", dict(min_pixels=64 * 40, max_pixels=64 * 60, patch_size=8, merge_size=1)),
                         [(300, 77, "RGB"), (13, 9, "P")]),
    # merge 3 over 6-pixel patches (18-pixel tokens), head_dim 48 (sections [8, 8, 8]), GQA 2:1
    "qwen2-vl merge 3": ("Qwen2VLConfig", text(hidden_size=96, num_attention_heads=2, num_key_value_heads=1,
                                               **mrope([8, 8, 8])),
                         dict(depth=3, embed_dim=32, hidden_size=96, num_heads=2, patch_size=6,
                              spatial_merge_size=3), {},
                         ("qwen2", dict(min_pixels=18 * 18 * 4, max_pixels=18 * 18 * 30, patch_size=6,
                                        merge_size=3)),
                         [(100, 37, "RGB"), (50, 130, "LA")]),
    # window attention over 112-pixel windows in blocks 0 and 2, full in 1; sections [6, 5, 5]
    "qwen2.5-vl windows": ("Qwen2_5_VLConfig", text(**mrope([6, 5, 5])),
                           dict(depth=3, hidden_size=48, intermediate_size=80, out_hidden_size=128,
                                num_heads=2, window_size=112, fullatt_block_indexes=[1]), {},
                           ("qwen2", dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40)),
                           [(230, 150, "RGB"), (61, 203, "RGBA")]),
    # deepstack after blocks 0 and 1 into decoder layers 0 and 1, interleaved sections [8, 4, 4],
    # learned positions on a 6x6 grid
    "qwen3-vl deepstack 2": ("Qwen3VLConfig",
                             text(head_dim=32, **mrope([8, 4, 4], mrope_interleaved=True)),
                             dict(depth=2, hidden_size=48, intermediate_size=96, out_hidden_size=128,
                                  num_heads=2, patch_size=16, num_position_embeddings=36,
                                  deepstack_visual_indexes=[0, 1]), {},
                             ("qwen2", dict(min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 20, patch_size=16,
                                            image_mean=[0.5] * 3, image_std=[0.5] * 3)),
                             [(150, 70, "RGB"), (33, 33, "RGBA")]),
    # LLaVA over a Qwen2 decoder: the last layer's features, 8-pixel patches, 40-pixel crops
    "llava qwen2 last layer": ("LlavaConfig", dict(model_type="qwen2", **text()),
                         dict(model_type="clip_vision_model", hidden_size=48, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=2, image_size=40, patch_size=8),
                         dict(image_token_index=PAD, vision_feature_layer=-1,
                              vision_feature_select_strategy="default", projector_hidden_act="gelu"),
                         ("clip", dict(size={"shortest_edge": 40}, crop_size={"height": 40, "width": 40})),
                         [(90, 50, "RGB"), (20, 70, "RGBA")]),
}


def build_config(case: tuple) -> Any:
    import transformers

    class_name, text_config, vision_config, other, _, _ = case
    config_class = getattr(transformers, class_name)
    ids = {} if class_name == "LlavaConfig" else TOKENS
    config = config_class(text_config=text_config, vision_config=vision_config, **ids, **other,
                          tie_word_embeddings=False)
    config.architectures = [class_name.removesuffix("Config") + "ForConditionalGeneration"]
    return config


def image_processor(case: tuple) -> Any:
    kind, kwargs = case[4]
    if kind == "clip":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        return CLIPImageProcessorPil(**kwargs)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**kwargs)


def png(width: int, height: int, mode: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    picture = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P":  # a palette image with one transparent colour
        picture = picture.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        picture.info["transparency"] = 3
    elif mode != "RGBA":
        picture = picture.convert(mode)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def prompt_ids(model_dir: Path, images: int) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    content = [{"type": "text", "text": "Look at"}]
    for _ in range(images):
        content += [{"type": "image"}, {"type": "text", "text": "and"}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered)["input_ids"]


def hf_greedy(model_dir: Path, case: tuple, ids: list[int], blobs: list[bytes]) -> list[int]:
    """transformers' own path: its PIL processor on the opened PNGs, placeholders expanded as its
    processor does, the model's generate."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    pictures = [Image.open(io.BytesIO(blob)) for blob in blobs]
    processor = type(image_processor(case)).from_pretrained(str(model_dir))
    processed = processor(images=pictures, return_tensors="pt")
    if case[0] == "LlavaConfig":
        vision = config.vision_config
        counts = [(vision.image_size // vision.patch_size) ** 2
                  + (config.vision_feature_select_strategy == "full")] * len(blobs)
        kwargs = dict(pixel_values=processed["pixel_values"])
    else:
        grids = processed["image_grid_thw"]
        counts = (grids.prod(-1) // config.vision_config.spatial_merge_size ** 2).tolist()
        kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=grids)
    expanded: list[int] = []
    remaining = iter(counts)
    for token in ids:
        expanded += [PAD] * next(remaining) if token == PAD else [token]
    batch = torch.tensor([expanded])
    if case[0] != "LlavaConfig":
        kwargs["mm_token_type_ids"] = (batch == PAD).int()
    model = getattr(transformers, config.architectures[0]).from_pretrained(str(model_dir),
                                                                          dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(batch, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                             **kwargs)
    return out[0, len(expanded):].tolist()


def engine_greedy(model_dir: Path, ids: list[int], blobs: list[bytes]) -> list[int]:
    """pdserve's path: the worker's `prepare` on the PNG bytes, then the engine."""
    prompt, images = prepare(str(model_dir), ModelConfig.from_dir(model_dir), ids, blobs)
    engine = start_engine(model_dir, page_size=8, chunked_prefill_size=16, num_pages=128,
                          disable_radix_cache=True, num_threads=1)

    async def run() -> list[int]:
        return [o.token_id async for o in generate(engine, prompt, GREEDY, "r", images=images)]

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tokenizer"))


def check(case: tuple, tokenizer_dir: Path, folder: Path, seed: int = 7) -> None:
    """One image, then every image of `case`: pdserve's greedy tokens equal transformers'."""
    model_dir = save_random_checkpoint(folder, build_config(case), seed=seed, tokenizer_dir=tokenizer_dir,
                                       image_processor=image_processor(case))
    blobs = [png(w, h, mode, seed) for seed, (w, h, mode) in enumerate(case[5])]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is far faster on a shared machine
    try:
        for count in sorted({1, len(blobs)}):
            ids = prompt_ids(model_dir, count)
            images = blobs[:count]
            assert engine_greedy(model_dir, ids, images) == hf_greedy(model_dir, case, ids, images), case
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", sorted(CASES))
def test_unusual_vl_checkpoint_matches_transformers(name, tokenizer_dir, tmp_path):
    check(CASES[name], tokenizer_dir, tmp_path / "ckpt")


def random_case(rng: random.Random) -> tuple:
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL case drawn at random (the shape of CASES' entries)."""
    family = rng.choice(["Qwen2VLConfig", "Qwen2_5_VLConfig", "Qwen3VLConfig"])
    heads, head_dim = rng.choice([2, 4]), rng.choice([12, 16, 24, 32])
    half = head_dim // 2
    # consecutive sections: any positive split; interleaved (Qwen3-VL): h and w take every third frequency
    height = rng.randint(1, half // 3 if family == "Qwen3VLConfig" else half - 2)
    width_section = rng.randint(1, half // 3 if family == "Qwen3VLConfig" else half - 1 - height)
    section = [half - height - width_section, height, width_section]
    qwen3 = family == "Qwen3VLConfig"
    hidden = heads * head_dim
    text_config = text(hidden_size=hidden, num_attention_heads=heads,
                       num_key_value_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
                       num_hidden_layers=rng.randint(1, 3),
                       **({"head_dim": head_dim} if qwen3 else {}),
                       **mrope(section, **({"mrope_interleaved": True} if qwen3 else {})))
    patch, merge = rng.choice([6, 8, 14, 16]), rng.choice([1, 2, 3])
    depth, vision_heads = rng.randint(1, 3), rng.choice([1, 2, 4])
    width = vision_heads * rng.choice([8, 16])
    vision: dict[str, Any] = dict(depth=depth, num_heads=vision_heads, patch_size=patch,
                                  spatial_merge_size=merge)
    if family == "Qwen2VLConfig":
        vision.update(embed_dim=width, hidden_size=hidden, mlp_ratio=rng.choice([1, 2, 4]))
    else:
        vision.update(hidden_size=width, intermediate_size=width * rng.choice([1, 2]), out_hidden_size=hidden)
    if family == "Qwen2_5_VLConfig":
        vision.update(window_size=patch * merge * rng.choice([1, 2, 3]),
                      fullatt_block_indexes=sorted(rng.sample(range(depth), rng.randint(0, depth))))
    if qwen3:
        vision.update(num_position_embeddings=rng.choice([4, 6, 8]) ** 2,
                      deepstack_visual_indexes=sorted(rng.sample(range(depth), rng.randint(
                          0, min(depth, text_config["num_hidden_layers"])))))
    factor = patch * merge
    low = factor * factor * rng.randint(1, 4)
    processor = dict(min_pixels=low, max_pixels=low + factor * factor * rng.randint(0, 40), patch_size=patch,
                     merge_size=merge)
    images = [(rng.randint(5, 300), rng.randint(5, 300), rng.choice(["RGB", "RGBA", "P", "LA"]))
              for _ in range(rng.randint(1, 2))]
    return (family, text_config, vision, {}, ("qwen2", processor), images)


@pytest.mark.long
def test_random_vl_checkpoints_match_transformers(tokenizer_dir, tmp_path):
    """Random Qwen-VL cases (PDSERVE_FUZZ_SEED), 40 of them: about 3 s each here."""
    rng = random.Random(int(os.environ.get("PDSERVE_FUZZ_SEED", "0")))
    for index in range(40):
        check(random_case(rng), tokenizer_dir, tmp_path / f"draw{index}", seed=index)
