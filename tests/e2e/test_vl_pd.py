"""Images served prefill/decode disaggregated: a tiny-vl registry + prefill + decode + gateway, as
real processes on mooncake and on nixl, driven by the official openai client.

The decode worker forwards the encoded images to the prefill in its Prefill call; the prefill runs
the vision tower and the prompt and writes the KV; decode builds the same M-RoPE positions and page
salts for its decode steps and prefix cache. Checked here: greedy fp32 output equals transformers'
(text + 1 image, text + 2 images of different sizes, an image alone), on mooncake with the decode
worker running short prompts itself (conditional disaggregation); the same text with another image
hits no image page in either prefix cache, the same image again hits both; a request whose decode
dies mid-stream migrates with its images and ends with the same text; forged Prefill calls
whose images disagree with their tokens get INVALID_ARGUMENT; clients cut off mid-stream leave both
workers with no page in use.
"""

from __future__ import annotations

import asyncio
import base64
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from engine.multimodal.image_processor import ImageProcessorConfig, smart_resize
from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle
from tests.e2e.test_vl_chat import NEW, data_url, hf_reference, image, with_private_chunk

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PAGE = 16  # the workers' default page size
LOCAL_MAX_TOKENS = 40  # mooncake's decode runs prompts of at most this many tokens itself
WORKER_FLAGS = ("--num-pages", "256", "--chunked-prefill-size", "32")  # image tokens span chunks
CASES = {
    "text+1 image": (["Look at", None, "what is it?"], [(130, 90, 1)]),
    "text+2 images": (["compare", None, "with", None, "and tell me which one is brighter"],
                      [(60, 200, 2), (100, 100, 3)]),
    "image alone": ([None], [(120, 80, 4)]),
}
CACHE_TEXT = [None, "Describe this picture in great detail, please, and then name its colours."]


@dataclass
class Deployment:
    backend: str
    bootstrap: Proc
    prefill: Proc
    decode: Proc
    gateway: Proc
    model_dir: Path

    @property
    def model(self) -> str:
        return self.model_dir.name

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{self.gateway.address}/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def chat(self, parts: list, urls: list[str], max_tokens: int = NEW, **kwargs):
        content, images = [], iter(urls)
        for part in parts:
            content.append({"type": "image_url", "image_url": {"url": next(images)}} if part is None
                           else {"type": "text", "text": part})
        return self.client().chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
            temperature=0, extra_body={"ignore_eos": True}, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.models.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-vl", preset="tiny-vl", seed=0)


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[str, str]:
    """transformers' greedy text for each case (its own image processor and chat template)."""
    return {name: hf_reference(model_dir, parts, [image(*p) for p in pictures])
            for name, (parts, pictures) in CASES.items()}


# nixl in `make test-all`: images cross nixl in tests/e2e/test_epd.py, and PD's KV over it in
# test_pd_services.py.
@pytest.fixture(scope="module", params=["mooncake", pytest.param("nixl", marks=pytest.mark.long)])
def pd(request, model_dir, tmp_path_factory) -> Iterator[Deployment]:
    backend = request.param
    conditional = ("--conditional-disaggregation", "--local-prefill-max-tokens",
                   str(LOCAL_MAX_TOKENS)) if backend == "mooncake" else ()
    with Cluster(tmp_path_factory.mktemp(f"vl-pd-{backend}")) as cluster:
        try:
            bootstrap = cluster.bootstrap()
            prefill, decode = cluster.start_many([
                ("prefill", worker_args(str(model_dir), "prefill", backend=backend, bootstrap=bootstrap,
                                        extra=WORKER_FLAGS)),
                ("decode", worker_args(str(model_dir), "decode", backend=backend, bootstrap=bootstrap,
                                       extra=(*WORKER_FLAGS, *conditional)))], 180)
            gateway = cluster.start("gateway", ["launch-router", "--model-path", str(model_dir),
                                                "--port", "0", "--bootstrap", bootstrap.address])
            deployment = Deployment(backend, bootstrap, prefill, decode, gateway, model_dir)
            # ready once the gateway knows both workers: a long prompt must reach the prefill
            wait_until(lambda: _serves_pd(deployment), 60, "the gateway to serve through prefill and decode")
            yield deployment
        except BaseException:
            print(cluster.logs())
            raise


def _serves_pd(pd: Deployment) -> bool:
    try:
        pd.chat(["hello " * 80], [], max_tokens=1)
    except openai.APIError:
        return False
    return pd.prefill.metric("pdserve:prefix_cache_query_tokens_total") > 0


@pytest.mark.parametrize("case", list(CASES))
def test_output_matches_transformers(pd: Deployment, expected, case):
    parts, pictures = CASES[case]
    local_before = pd.decode.metric("pdserve:local_prefill_requests_total")
    answer = pd.chat(parts, [data_url(image(*p)) for p in pictures])
    assert answer.choices[0].message.content == expected[case]
    ran_locally = pd.decode.metric("pdserve:local_prefill_requests_total") - local_before
    prompt_tokens = answer.usage.prompt_tokens  # the workers' count: each image its own tokens
    assert prompt_tokens == expanded_length(pd, parts, pictures)
    short = pd.backend == "mooncake" and prompt_tokens <= LOCAL_MAX_TOKENS
    assert ran_locally == (1 if short else 0), (prompt_tokens, ran_locally)


def test_a_large_image_reaches_prefill_as_its_pixels(pd: Deployment, expected):
    """An image over 1 MB reaches decode through its image drop (services/common/image_drop.py) as
    views into the bytes received, and decode writes them into its Prefill call's bytes
    (services/worker/images_apart.py): the prefill gets the same image (a PNG carrying a 2 MB private
    chunk: the same pixels), so the same answer."""
    parts, pictures = CASES["text+2 images"]
    urls = [data_url(image(*p)) for p in pictures]
    png = base64.b64decode(urls[0].split(",", 1)[1])
    urls[0] = "data:image/png;base64," + base64.b64encode(with_private_chunk(png, 2_000_000)).decode()
    local_before = pd.decode.metric("pdserve:local_prefill_requests_total")
    uploads = pd.decode.metric("pdserve:image_drop_uploads")
    assert pd.chat(parts, urls).choices[0].message.content == expected["text+2 images"]
    assert pd.decode.metric("pdserve:local_prefill_requests_total") == local_before  # prefill ran it
    assert pd.decode.metric("pdserve:image_drop_uploads") == uploads + 1


def test_conditional_disaggregation_ran_some_locally(pd: Deployment):
    """A guard on CASES' prompt lengths: with conditional disaggregation on, the cases above took
    both paths (the per-case check says which took which)."""
    if pd.backend != "mooncake":
        pytest.skip("conditional disaggregation is on for the mooncake deployment only")
    assert pd.decode.metric("pdserve:local_prefill_requests_total", reason="short_prompt") >= 1


def expanded_length(pd: Deployment, parts: list, pictures: list[tuple[int, int, int]]) -> int:
    """The prompt's length on the workers: the rendered prompt holds one image-pad token per image,
    the workers expand each to its image's tokens (its patch grid, merged 2x2)."""
    config = ImageProcessorConfig.from_dir(pd.model_dir)
    factor = config.patch_size * config.merge_size
    sizes = [smart_resize(h, w, factor, config.min_pixels, config.max_pixels) for w, h, _seed in pictures]
    return len(_rendered(pd.model_dir, parts)) + sum(h // factor * (w // factor) - 1 for h, w in sizes)


def _rendered(model_dir: Path, parts: list) -> list[int]:
    """The prompt's token ids as the gateway renders them (one image-pad token per image)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text)["input_ids"]


def _first_pad(model_dir: Path, parts: list) -> int:
    """Where the first image-pad token sits in the rendered prompt."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return _rendered(model_dir, parts).index(tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def _hits(pd: Deployment) -> tuple[float, float]:
    return (pd.decode.metric("pdserve:prefix_cache_hit_tokens_total"),
            pd.prefill.metric("pdserve:prefix_cache_hit_tokens_total"))


def test_image_enters_the_page_hashes(pd: Deployment, model_dir):
    first, other = data_url(image(200, 200, 10)), data_url(image(200, 200, 11))
    shared_text_tokens = _first_pad(model_dir, CACHE_TEXT) // PAGE * PAGE  # pages before the image
    answer = pd.chat(CACHE_TEXT, [first])
    prompt_tokens = answer.usage.prompt_tokens
    assert prompt_tokens == expanded_length(pd, CACHE_TEXT, [(200, 200, 10)])
    assert prompt_tokens > LOCAL_MAX_TOKENS  # shipped to the prefill on both deployments

    before = _hits(pd)
    pd.chat(CACHE_TEXT, [other])  # same text, same image size (same tokens), another image
    decode_hits, prefill_hits = (b - a for a, b in zip(before, _hits(pd), strict=True))
    assert decode_hits <= shared_text_tokens and prefill_hits <= shared_text_tokens, \
        (decode_hits, prefill_hits)

    before = _hits(pd)
    saved_before = pd.decode.metric("pdserve:kv_transfer_bytes_saved_total")
    again = pd.chat(CACHE_TEXT, [first])
    decode_hits, prefill_hits = (b - a for a, b in zip(before, _hits(pd), strict=True))
    assert again.choices[0].message.content == answer.choices[0].message.content
    # every full prompt page from decode's cache (none crosses), and prefill's lookup stops one
    # token short of the prompt (the last token is computed for the first token's logits)
    assert decode_hits == prompt_tokens // PAGE * PAGE, (decode_hits, prompt_tokens)
    assert prefill_hits == (prompt_tokens - 1) // PAGE * PAGE, (prefill_hits, prompt_tokens)
    assert pd.decode.metric("pdserve:kv_transfer_bytes_saved_total") > saved_before


def _forged_prefill(pd: Deployment, room: str, prompt: list[int], images: list[bytes],
                    dst_page_ids: list[int]) -> tuple[grpc.StatusCode, str]:
    async def call() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(pd.bootstrap.address) as channel:
            listed = await bootstrap_pb2_grpc.BootstrapStub(channel).List(
                bootstrap_pb2.ListRequest(role=common_pb2.WORKER_ROLE_DECODE), timeout=10)
        async with grpc.aio.insecure_channel(pd.prefill.address) as channel:
            request = worker_pb2.PrefillRequest(
                room=room, prompt_token_ids=prompt, images=images, model=pd.model, dst_page_ids=dst_page_ids,
                dst=listed.workers[0].transfer_endpoint,
                sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=1))
            try:
                await worker_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=30)
                return grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()

    return asyncio.run(call())


def test_forged_prefill_images_are_refused(pd: Deployment, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    png = base64.b64decode(data_url(image(64, 64, 7)).split(",", 1)[1])
    text = [5, 6, 7, 8]
    bytes_before = pd.prefill.metric("pdserve:kv_transfer_bytes_total")
    for room, prompt, images, dst, message in [
        ("forged-pads", [*text, *[pad] * 4], [], [0], "image-pad tokens (id"),
        ("forged-extra", [*text, pad], [png, png], [0], "1 image placeholders but 2 images"),
        ("forged-bytes", [*text, pad], [b"not an image"], [0], "is not a PNG, JPEG or WebP image"),
        # well formed images, but the pages do not match the expanded prompt (4 + 4 tokens: 1 page)
        ("forged-pages", [*text, pad], [png], [0, 1, 2], "3 destination pages for a prompt that needs 1"),
    ]:
        code, details = _forged_prefill(pd, room, prompt, images, dst)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, (room, code, details)
    assert pd.prefill.metric("pdserve:kv_transfer_bytes_total") == bytes_before
    assert_pages_idle(pd.prefill, pd.decode)


def test_clients_cut_off_mid_stream_leave_no_page_in_use(pd: Deployment):
    aborts = pd.gateway.metric("pdserve:gateway_aborts_total")
    for seed in (20, 21):
        stream = pd.chat(CACHE_TEXT, [data_url(image(150, 110, seed))], max_tokens=400, stream=True)
        chunks = 0
        for _chunk in stream:
            chunks += 1
            if chunks == 3:
                break
        stream.close()  # the client goes away mid-stream
        assert chunks == 3
    # the gateway saw both clients leave before the end, and told the workers
    wait_until(lambda: pd.gateway.metric("pdserve:gateway_aborts_total") - aborts == 2, 30,
               "the gateway's aborts")
    assert_pages_idle(pd.prefill, pd.decode)
    # and the deployment still serves
    assert pd.chat(CACHE_TEXT, [data_url(image(150, 110, 20))], max_tokens=2).usage.completion_tokens == 2


def test_migration_carries_the_images(cluster: Cluster, model_dir):
    """A decode killed mid-stream: the gateway continues the request on the other decode, sending
    the images again with the prompt plus the tokens already delivered (services/gateway/
    migration.py); the text equals a fault-free run's and no page stays in use."""
    bootstrap = cluster.bootstrap()
    prefill, *decodes = cluster.start_many(
        [("prefill", worker_args(str(model_dir), "prefill", backend="mooncake", bootstrap=bootstrap,
                                 extra=WORKER_FLAGS))]
        + [(f"decode-{i}", worker_args(str(model_dir), "decode", backend="mooncake", bootstrap=bootstrap,
                                       extra=WORKER_FLAGS)) for i in range(2)], 180)
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(model_dir), "--port", "0",
                                        "--bootstrap", bootstrap.address])
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).json().get("workers")
               == {"prefill": 1, "decode": 2, "colocated": 0}, 60, "the gateway to see every worker")
    deployment = Deployment("mooncake", bootstrap, prefill, decodes[0], gateway, model_dir)
    url = data_url(image(130, 90, 30))

    def stream(kill_after: int | None) -> str:
        text, received = "", 0
        for chunk in deployment.chat(CACHE_TEXT, [url], max_tokens=300, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                received += 1
            if received == kill_after:
                (serving,) = [d for d in decodes if d.metric("pdserve:num_running_reqs") > 0]
                serving.kill(signal.SIGKILL)
                decodes.remove(serving)
                kill_after = None
        return text

    expected = stream(None)
    assert stream(8) == expected
    assert gateway.metric("pdserve:gateway_migrations_total") == 1
    assert_pages_idle(prefill, *decodes, timeout_s=60)
