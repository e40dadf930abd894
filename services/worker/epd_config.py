"""EpdConfig: the EPD (encoder / prefill / decode) flags of `pdserve launch-server`, spelled as SGLang's.

`--encoder-only` starts an encoder service (services/encoder/main.py) instead of a worker;
`--language-only` (an engine flag: engine.config.EngineConfig) starts a worker without a vision tower
that gets its image embeddings from encoders, found at `--encoder-urls` or in the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libkv.transfer import ONE_SIDED_BACKENDS as ENCODER_BACKENDS


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class EpdConfig:
    """Nested in WorkerConfig (`config.epd`); its fields are flags of launch-server."""

    encoder_only: bool = field(default=False, metadata=_help(
        "run only the vision tower of a vision-language checkpoint, as an encoder service (EPD): it "
        "encodes the images language-only workers send and writes the embeddings into their memory"))
    encoder_urls: tuple[str, ...] = field(default=(), metadata=_help(
        "--language-only: the encoder services to use, HOST:PORT or http://HOST:PORT, one or more; unset = "
        "the registry's encoders of this model (--bootstrap)"))
    encoder_transfer_backend: str = field(default="mooncake", metadata=_help(
        "the transfer engine that moves image embeddings from encoders to language-only workers: "
        "mooncake | nixl (both sides must agree)"))
    encoder_timeout: float = field(default=30.0, metadata=_help(
        "--language-only: seconds one encoder call (encode and transfer) may take before the images go to "
        "another encoder, once"))
    embedding_pages: int = field(default=512, metadata=_help(
        "embedding pages (16 rows of the model's hidden size each) of an encoder's staging pool or a "
        "language-only worker's receiving pool"))
    embedding_cache_size: int = field(default=256, metadata=_help(
        "--language-only: images whose embeddings the worker keeps, by image digest (least recently "
        "used out first; 0 = off)"))

    def __post_init__(self) -> None:
        if self.encoder_transfer_backend not in ENCODER_BACKENDS:
            raise ValueError(f"--encoder-transfer-backend must be one of {ENCODER_BACKENDS}, "
                             f"got {self.encoder_transfer_backend!r}")
        if self.encoder_timeout <= 0:
            raise ValueError(f"--encoder-timeout must be > 0, got {self.encoder_timeout}")
        if self.embedding_pages <= 0:
            raise ValueError(f"--embedding-pages must be > 0, got {self.embedding_pages}")
        if self.embedding_cache_size < 0:
            raise ValueError(f"--embedding-cache-size must be >= 0, got {self.embedding_cache_size}")

    def encoder_addresses(self) -> list[str]:
        """--encoder-urls as gRPC addresses (HOST:PORT; an http:// prefix, as the seeds write it, dropped)."""
        return [url.split("://", 1)[-1].rstrip("/") for url in self.encoder_urls]
