"""Encoded images (PNG, JPEG, WebP bytes) to a request's ImageInputs, with the limits a server
puts on them. Decoding and resizing are CPU work: callers on an event loop run this in a thread."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from engine.models.config import ModelConfig
from engine.multimodal.clip_processor import ClipProcessorConfig
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.multimodal.inputs import ImageInput
from engine.multimodal.prompt import expand_image_tokens

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_IMAGES = 16  # per request
MAX_IMAGE_PIXELS = 32 * 1024 * 1024  # per image, before resizing (a 50-megapixel image is refused)


@lru_cache(maxsize=4)
def processor_config(model_dir: str) -> ImageProcessorConfig | ClipProcessorConfig:
    """The checkpoint's image preprocessing: CLIP's (LLaVA) or Qwen2-VL's (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL); without a preprocessor_config.json, the family's defaults."""
    path = Path(model_dir) / "preprocessor_config.json"
    if path.exists():
        kind = json.loads(path.read_text()).get("image_processor_type", "")
        clip = kind.removesuffix("Fast").removesuffix("Pil") in ("CLIPImageProcessor", "LlavaImageProcessor")
    else:
        clip = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") == "llava"
    if clip:
        return ClipProcessorConfig.from_dir(model_dir)
    return ImageProcessorConfig.from_dir(model_dir) if path.exists() else ImageProcessorConfig()


def decode_image(data: bytes | memoryview, index: int = 0, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """The decoded RGB image; ValueError saying why not (not an image, a format other than
    PNG/JPEG/WebP, too many pixels, truncated or corrupt). The pixel count is read from the
    header and checked before anything is decoded."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (UnidentifiedImageError, OSError):
        raise ValueError(f"image {index} is not a PNG, JPEG or WebP image") from None
    except Image.DecompressionBombError:
        raise ValueError(f"image {index} has too many pixels (at most {max_pixels})") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"image {index} has {width}x{height} = {width * height} pixels; at most "
                         f"{max_pixels}")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"image {index} is truncated or corrupt ({exc})") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' image processors make it (image_transforms.convert_to_rgb): a
    transparent image (an alpha band, or a palette / grey image with a transparent colour) is laid
    over white first. A plain convert("RGB") drops the alpha instead, which shows the colours
    under transparent pixels: different pixels, so a different answer than the model's own."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def prepare(model_dir: str, model: ModelConfig, prompt_ids: Sequence[int],
            blobs: Sequence[bytes | memoryview]) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The prompt with each image placeholder expanded to its image's tokens, and the images
    preprocessed; ValueError for a text-only model or any image refused."""
    if not model.is_multimodal or model.image_token_id is None:
        raise ValueError(f"images sent to a text-only model ({model.architecture})")
    if len(blobs) > MAX_IMAGES:
        raise ValueError(f"{len(blobs)} images in one request; at most {MAX_IMAGES}")
    config = processor_config(model_dir)
    images = tuple(config.preprocess(decode_image(blob, i)) for i, blob in enumerate(blobs))
    return expand_image_tokens(prompt_ids, images, model.image_token_id, config.merge_size), images
