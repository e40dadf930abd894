"""What a request may send as images, from `pdserve launch-router`'s flags, and the parsing of them.

MediaLimits is built once from GatewayConfig (`MediaLimits.of`); services.gateway.images applies it
to each request and services.gateway.media_fetch to each remote image. Flags (vLLM's names where it
has one): `--allowed-media-domains` (hosts whose http(s) image URLs the gateway fetches; none: remote
URLs are refused), `--media-fetch-timeout`, `--limit-mm-per-prompt` (`{"image": N}` as vLLM, or N),
`--max-image-bytes` and `--max-request-image-bytes` (decoded sizes).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

MAX_REDIRECTS = 3  # a CDN hop or two; each hop's host must be allowed too


@dataclass(frozen=True)
class MediaLimits:
    """Per-request image limits and the remote-fetch policy (who calls: images.py, per request)."""

    max_images: int = 16
    max_image_bytes: int = 20 << 20
    max_request_image_bytes: int = 32 << 20
    allowed_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    max_redirects: int = MAX_REDIRECTS
    allow_private_addresses: bool = False  # fetch from loopback, private, link-local addresses too

    @classmethod
    def of(cls, config) -> MediaLimits:
        """From a GatewayConfig (its flags were checked by GatewayConfig.__post_init__)."""
        return cls(max_images=parse_limit_mm_per_prompt(config.limit_mm_per_prompt),
                   max_image_bytes=config.max_image_bytes,
                   max_request_image_bytes=config.max_request_image_bytes,
                   allowed_domains=parse_domains(config.allowed_media_domains),
                   fetch_timeout_s=config.media_fetch_timeout,
                   allow_private_addresses=config.allow_private_media_addresses)

    def domain_allowed(self, host: str) -> bool:
        """`host` is one of the allowed domains, exactly (as vLLM: `a.com` does not allow `b.a.com`)."""
        return host.lower().rstrip(".") in self.allowed_domains

    def body_bytes(self) -> int:
        """Room the request body needs for a request's images as base64 (4 characters per 3 bytes),
        over the body limit for text: a vision-language model's body limit is raised by this."""
        return 4 * math.ceil(self.max_request_image_bytes / 3)


def parse_limit_mm_per_prompt(text: str) -> int:
    """Images per request from `{"image": N}` (vLLM's JSON form; other modalities are refused: this
    server takes images only) or a plain N; ValueError saying what is wrong."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f'--limit-mm-per-prompt takes {{"image": N}} or N, got {text!r}') from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f'--limit-mm-per-prompt takes {{"image": N}} or N, got {text!r}')
    other = sorted(set(value) - {"image"})
    if other:
        raise ValueError(f"--limit-mm-per-prompt: this server takes images only, not {', '.join(other)}")
    count = value["image"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"--limit-mm-per-prompt: image must be a whole number >= 0, got {count!r}")
    return count


_HOST = re.compile(r"^([0-9a-f.]*:[0-9a-f:.]*|[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?)$")  # IPv6 or a name


def parse_domains(text: str) -> tuple[str, ...]:
    """Hosts from a comma- or space-separated list (lower case, trailing dot dropped); ValueError for
    something that is not a host name (a URL, a path, a port: the flag names hosts only)."""
    hosts = []
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        host = item.lower().rstrip(".").removeprefix("[").removesuffix("]")  # [::1] as URLs write it
        if not _HOST.match(host):
            raise ValueError("--allowed-media-domains takes host names (e.g. images.example.com), got "
                             f"{item!r}")
        hosts.append(host)
    return tuple(dict.fromkeys(hosts))
