"""The image flags of launch-router (vLLM's forms) and the checks the gateway makes on a request's
image sources before anything is decoded or fetched."""

from __future__ import annotations

import argparse
import asyncio
import base64

import pytest

from pdserve.config_flags import config_from_args
from services.gateway.config import GatewayConfig, joined_list_flags
from services.gateway.errors import GatewayError
from services.gateway.images import ImageLoader
from services.gateway.main import add_arguments
from services.gateway.media_limits import MediaLimits, parse_domains, parse_limit_mm_per_prompt


def config_of(*argv: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(GatewayConfig, joined_list_flags(parser.parse_args(list(argv))))


@pytest.mark.parametrize(("text", "count"), [('{"image": 4}', 4), ('{"image":0}', 0), ("7", 7), (" 16 ", 16)])
def test_limit_mm_per_prompt_forms(text, count):
    assert parse_limit_mm_per_prompt(text) == count


@pytest.mark.parametrize(("text", "message"), [
    ('{"video": 1}', "images only, not video"), ('{"image": -1}', "whole number >= 0"),
    ('{"image": 1.5}', "whole number"), ('{"image": true}', "whole number"), ("[3]", "takes"),
    ("{}", "takes"),
    ("image=3", "takes"),
])
def test_limit_mm_per_prompt_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_limit_mm_per_prompt(text)


def test_domains_forms():
    assert parse_domains("") == ()
    assert parse_domains("a.example.com, B.example.com. 127.0.0.1 [::1] a.example.com") == (
        "a.example.com", "b.example.com", "127.0.0.1", "::1")


@pytest.mark.parametrize("text", ["https://a.com", "a.com/x", "a b/c", "*.a.com"])
def test_domains_refuse_what_is_not_a_host(text):
    with pytest.raises(ValueError, match="host names"):
        parse_domains(text)


def test_flags_take_vllm_forms():
    config = config_of("--model-path", "", "--allowed-media-domains", "a.com", "b.com",
                       "--limit-mm-per-prompt", '{"image": 3}', "--media-fetch-timeout", "2.5")
    limits = MediaLimits.of(config)
    assert limits.allowed_domains == ("a.com", "b.com")
    assert limits.max_images == 3 and limits.fetch_timeout_s == 2.5
    assert limits.domain_allowed("A.com") and not limits.domain_allowed("x.a.com")
    limits = MediaLimits.of(config_of("--allowed-media-domains", "a.com,b.com"))
    assert limits.allowed_domains == ("a.com", "b.com")
    assert MediaLimits.of(config_of()).allowed_domains == ()


@pytest.mark.parametrize(("argv", "message"), [
    (("--limit-mm-per-prompt", '{"audio": 1}'), "images only"),
    (("--max-image-bytes", "0"), "--max-image-bytes must be > 0"),
    (("--media-fetch-timeout", "0"), "--media-fetch-timeout must be > 0"),
    (("--allowed-media-domains", "http://a.com"), "host names"),
])
def test_bad_flags_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        config_of(*argv)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def load(sources, limits=MediaLimits(), **kwargs):
    async def run():
        loader = ImageLoader(limits)
        try:
            return await loader.load(sources, **{"multimodal": True, "param": "messages", **kwargs})
        finally:
            await loader.close()
    return asyncio.run(run())


def refused(sources, limits=MediaLimits(), **kwargs) -> GatewayError:
    with pytest.raises(GatewayError) as raised:
        load(sources, limits, **kwargs)
    return raised.value


def test_inline_images_decode_in_order():
    assert load([f"data:image/png;base64,{b64(b'one')}",
                 f"data:image/jpeg;base64,{b64(b'two')}"]) == [b"one", b"two"]
    assert load([b64(b"/9j/ three"), f"data:image/webp;base64,{b64(b'four')}"], plain_base64=True) == [
        b"/9j/ three", b"four"]
    assert load([]) == []


def test_limits_answer_400_and_413():
    url = f"data:image/png;base64,{b64(b'x' * 100)}"
    error = refused([url] * 3, MediaLimits(max_images=2))
    assert (error.status, error.param) == (400, "messages")
    assert "at most 2 (--limit-mm-per-prompt)" in error.message
    error = refused([url], MediaLimits(max_image_bytes=99))
    assert error.status == 413 and "--max-image-bytes" in error.message
    error = refused([url, url], MediaLimits(max_image_bytes=100, max_request_image_bytes=150))
    assert error.status == 413 and "--max-request-image-bytes" in error.message
    assert load([url], MediaLimits(max_image_bytes=100)) == [b"x" * 100]


@pytest.mark.parametrize(("source", "kwargs", "message"), [
    ("https://a.com/cat.png", {}, "remote image URLs are not allowed on this server"),
    ("https://b.com/cat.png", {"limits": MediaLimits(allowed_domains=("a.com",))}, "b.com is not in"),
    ("ftp://a.com/cat.png", {"limits": MediaLimits(allowed_domains=("a.com",))}, "expected a data: URL"),
    ("file:///etc/passwd", {"plain_base64": True}, "a file: URL"),
    ("/etc/passwd.png", {"plain_base64": True}, "a file path"),
    ("cat.png", {"plain_base64": True}, "a file path"),
    ("aGVsbG8", {"plain_base64": True}, "not valid base64"),
    ("aGVsbG8=", {}, "expected a data: URL, an http(s) URL"),
    ("data:text/plain;base64,aGVsbG8=", {}, "expected data:image/png"),
    ("data:image/png;base64,@@@", {}, "not valid base64"),
])
def test_bad_sources_are_400(source, kwargs, message):
    error = refused([source], **kwargs)
    assert error.status == 400 and message in error.message, error.message


def test_text_only_model_refuses_images():
    error = refused([f"data:image/png;base64,{b64(b'x')}"], multimodal=False)
    assert error.status == 400 and "text-only model" in error.message
