"""Speculative decoding (NGRAM; NEXTN on a DeepSeek checkpoint) on real workers: greedy output
identical to HF transformers (and so to speculation off) colocated and through PD, where decode drafts
and verifies, and the drafted and accepted counters move; every KV page is back after the requests.
(The "Decode batch" line's `accept len` is checked in tests/services/decode/test_log_line.py: a line
is written every --decode-log-interval while busy, so whether a short run writes one depends on time.)

Prompts: mixed lengths of random tokens (drafts mostly rejected), and prompts that repeat a short
run (the tiny model's answers to those repeat too, so drafts are accepted), decoded in one batch.
"""

from __future__ import annotations

import pytest

from tests.e2e.cluster import Cluster, worker_args
from tests.e2e.hf import hf_greedy
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import run_all
from tools.models.agreeing_mtp import make_mtp_agree
from tools.models.tiny_model import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NEW_TOKENS = 16
SPEC = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
        "--chunked-prefill-size", "64", "--num-pages", "256", "--decode-log-interval", "0.2")


def _prompts() -> list[list[int]]:
    runs = prompts_of([1, 4, 8], seed=5)
    return prompts_of([3, 17, 70, 130], seed=4) + [(run * 40)[:n] for run, n in zip(runs, [30, 48, 90],
                                                                                     strict=True)]


def _check(got, prompts, tiny_model) -> None:
    expected = hf_greedy(tiny_model, prompts, NEW_TOKENS)
    for prompt, result, hf_tokens in zip(prompts, got, expected, strict=True):
        assert result.code is None, f"prompt of {len(prompt)} tokens failed: {result.code} {result.details}"
        assert result.tokens == hf_tokens, f"prompt of {len(prompt)} tokens: NGRAM output differs from HF"


@pytest.mark.parametrize("layout", ["colocated", "mooncake", pytest.param("nixl", marks=pytest.mark.long)])
def test_ngram_greedy_output_matches_hf(layout, cluster: Cluster, tiny_model):
    prompts = _prompts()
    if layout == "colocated":
        decode = cluster.worker("colocated", tiny_model, "null", extra=SPEC)
        workers = [decode]
        got = run_all(decode.address, prompts, max_new_tokens=NEW_TOKENS)
    else:
        bootstrap = cluster.bootstrap()
        prefill, decode = cluster.start_many([
            ("prefill", worker_args(tiny_model, "prefill", backend=layout, bootstrap=bootstrap, extra=SPEC)),
            ("decode", worker_args(tiny_model, "decode", backend=layout, bootstrap=bootstrap, extra=SPEC)),
        ])
        workers = [prefill, decode]
        got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    _check(got, prompts, tiny_model)
    accepted = decode.metric("pdserve:spec_accepted_tokens_total")
    assert 0 < accepted < decode.metric("pdserve:spec_drafted_tokens_total")
    assert_pages_idle(*workers)


def test_decode_with_another_draft_config_is_refused_naming_the_field(cluster: Cluster, tiny_model):
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap)),
        ("decode", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap, extra=SPEC)),
    ])
    (result,) = run_all(decode.address, [[5, 6, 7, 8]], [prefill.address], max_new_tokens=4)
    assert result.code is not None and "speculative_algorithm: None vs 'NGRAM'" in result.details, result
    assert_pages_idle(prefill, decode)


@pytest.fixture(scope="session")
def mtp_model(tmp_path_factory):
    """tiny-deepseek with its MTP layer made to nearly agree with the target (drafts mostly accepted)."""
    folder = write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "deepseek-mtp", preset="tiny-deepseek",
                              seed=3)
    return make_mtp_agree(folder)


NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "4",
         "--chunked-prefill-size", "64", "--num-pages", "256", "--page-size", "16")


def _accept_rate(worker) -> float:
    drafted = worker.metric("pdserve:spec_drafted_tokens_total")
    return worker.metric("pdserve:spec_accepted_tokens_total") / drafted


@pytest.mark.parametrize("backend", ["mooncake", pytest.param("nixl", marks=pytest.mark.long)])
def test_nextn_greedy_output_through_pd_matches_hf(backend, cluster: Cluster, mtp_model):
    """Through PD, NEXTN's greedy output is HF's (tests/engine/test_speculative_nextn.py shows the
    colocated engine's is too). Prefill writes the MTP layer's K/V of the prompt into the pages it
    sends, so decode drafts from it about as well as a colocated worker (which accepts about 80% of
    this checkpoint's drafts); without it, decode's MTP layer attends to no prompt and about 10% are."""
    prompts = prompts_of([3, 17, 70, 130], seed=4)
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(mtp_model, "prefill", backend=backend, bootstrap=bootstrap, extra=NEXTN)),
        ("decode", worker_args(mtp_model, "decode", backend=backend, bootstrap=bootstrap, extra=NEXTN)),
    ])
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    expected = hf_greedy(mtp_model, prompts, NEW_TOKENS)
    for prompt, result, hf_tokens in zip(prompts, got, expected, strict=True):
        assert result.code is None, f"prompt of {len(prompt)} tokens failed: {result.code} {result.details}"
        assert result.tokens == hf_tokens, f"prompt of {len(prompt)} tokens: NEXTN output differs from HF"
    # decode skips drafting on a request's first step (the prompt's last hidden state stays on prefill)
    assert _accept_rate(decode) > 0.5, _accept_rate(decode)
    assert_pages_idle(prefill, decode)


@pytest.mark.parametrize("backend", ["mooncake", pytest.param("nixl", marks=pytest.mark.long)])
# NEXTN's rows take the same TP 2 verify path as NGRAM's, and its MTP K/V and hidden-state broadcast
# besides; the other drafters run in `make test-all`.
@pytest.mark.parametrize("algorithm", [pytest.param("NGRAM", marks=pytest.mark.long), "NEXTN",
                                       pytest.param("STANDALONE", marks=pytest.mark.long)])
def test_pd_tp1_to_tp2_with_drafts_matches_hf(algorithm, backend, cluster: Cluster, tiny_model, mtp_model):
    """Prefill at TP 1, decode at TP 2 drafting (the KV re-sharded on the way; under NEXTN the MTP layer's
    latent K/V of the prompt travels in the pages' extra layer to both decode ranks; STANDALONE's draft,
    the target itself, runs whole on decode's rank 0), a batch of mixed prompts then prefix-cache hits:
    greedy output is HF's, and so speculation off's, and drafts are accepted."""
    model, flags = (mtp_model, NEXTN) if algorithm == "NEXTN" else (tiny_model, SPEC)
    if algorithm == "STANDALONE":
        flags = (*SPEC[2:], "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                 str(tiny_model))
    prompts = prompts_of([3, 17, 70, 130], seed=4) if algorithm == "NEXTN" else _prompts()
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(model, "prefill", backend=backend, bootstrap=bootstrap,
                                extra=(*flags, "--tp-size", "1"))),
        ("decode", worker_args(model, "decode", backend=backend, bootstrap=bootstrap,
                               extra=(*flags, "--tp-size", "2"))),
    ])
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    # then the two longest again: prefix-cache hits on both sides (under NEXTN the cached pages hold
    # the MTP layer's K/V too)
    again = sorted(prompts, key=len)[-2:]
    got += run_all(decode.address, again, [prefill.address] * len(again), max_new_tokens=NEW_TOKENS)
    prompts = prompts + again
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    for prompt, result, hf_tokens in zip(prompts, got, expected, strict=True):
        assert result.code is None, f"prompt of {len(prompt)} tokens failed: {result.code} {result.details}"
        assert result.tokens == hf_tokens, f"prompt of {len(prompt)} tokens: {algorithm} PD 1 -> 2 differs"
    assert prefill.metric("pdserve:prefix_cache_hit_tokens_total") > 0
    if algorithm != "NGRAM":  # NEXTN: the prompt's MTP K/V arrived; STANDALONE: the draft is the target
        assert _accept_rate(decode) > 0.5, _accept_rate(decode)
    else:
        assert 0 < decode.metric("pdserve:spec_accepted_tokens_total") < \
            decode.metric("pdserve:spec_drafted_tokens_total")
    assert_pages_idle(prefill, decode)
