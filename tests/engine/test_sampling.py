"""Sampler: greedy, filters on hand-made distributions, seeds independent of the batch, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import SamplingParams, make_generator, sample, sampling_probs

GREEDY = SamplingParams(temperature=0.0)


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def _random_logits(rows: int, vocab: int = 257, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_ties_to_lowest_id():
    logits = _random_logits(6)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1.0
    result = sample(logits, [GREEDY] * 6)
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))
    assert result.token_ids[2] == 10
    assert result.logprobs is None and result.top_ids is None


def test_top_k_1_equals_greedy_even_with_temperature_and_seed():
    logits = _random_logits(5)
    params = [SamplingParams(temperature=t, top_k=1, seed=s) for t, s in
              [(1.0, None), (2.0, 3), (0.7, None), (1.5, 9), (1.0, 1)]]
    generators = [make_generator(p) for p in params]
    assert torch.equal(sample(logits, params, generators).token_ids, logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = _random_logits(4)
    params = [GREEDY, SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=1.0, seed=1)]
    result = sample(logits, params, [make_generator(p) for p in params])
    assert result.token_ids[0] == logits[0].argmax() and result.token_ids[2] == logits[2].argmax()


def _seeded_tokens(batch_builder, steps: int = 12) -> list[int]:
    """Tokens of the request seeded 1234 over `steps` steps, in the batch layout batch_builder gives."""
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    generator = make_generator(target)
    others = {}
    tokens = []
    for step in range(steps):
        params, position = batch_builder(target)
        generators = []
        for i, p in enumerate(params):
            if i == position:
                generators.append(generator)
            else:  # other requests keep their own generators across steps too
                generators.append(others.setdefault(i, make_generator(p)))
        rows = _random_logits(len(params), seed=100 + step)
        rows[position] = _random_logits(1, seed=step)[0]  # the target's logits depend only on the step
        tokens.append(int(sample(rows, params, generators).token_ids[position]))
    return tokens


def test_seed_gives_same_tokens_whatever_the_batch():
    alone = _seeded_tokens(lambda t: ([t], 0))
    crowded = _seeded_tokens(lambda t: ([SamplingParams(temperature=0.8), GREEDY,
                                         SamplingParams(temperature=1.0, seed=5), t,
                                         SamplingParams(temperature=1.2, top_k=5, min_p=0.1)], 3))
    first = _seeded_tokens(lambda t: ([t, SamplingParams(temperature=1.0, seed=1234)], 0))
    assert alone == crowded == first
    assert len(set(alone)) > 3  # it really sampled, not a degenerate distribution


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, 1000)
    runs = []
    for seed in (1, 2):
        params = SamplingParams(seed=seed)
        generator = make_generator(params)
        runs.append([int(sample(logits, [params], [generator]).token_ids[0]) for _ in range(10)])
    assert runs[0] != runs[1]


def test_top_p_keeps_smallest_set_reaching_p():
    logits = _logits_of([0.10, 0.50, 0.15, 0.25])  # sorted: 1 (0.5), 3 (0.25), 2 (0.15), 0 (0.1)
    probs = sampling_probs(logits.repeat(3, 1), [SamplingParams(top_p=p) for p in (0.4, 0.7, 0.8)])
    assert probs[0].tolist() == pytest.approx([0, 1, 0, 0])
    assert probs[1].tolist() == pytest.approx([0, 0.5 / 0.75, 0, 0.25 / 0.75])
    assert probs[2].tolist() == pytest.approx([0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9])
    assert (probs[:, 0] == 0).all()  # filtered tokens are exactly zero


def test_top_k_then_top_p_then_min_p():
    logits = _logits_of([0.05, 0.40, 0.30, 0.15, 0.10])
    params = [
        SamplingParams(top_k=3),  # keeps 1, 2, 3
        SamplingParams(min_p=0.3),  # threshold 0.12: keeps 1, 2, 3
        SamplingParams(min_p=0.5),  # threshold 0.20: keeps 1, 2
        SamplingParams(top_k=4, top_p=0.6),  # top_k keeps 1,2,3,4 (mass 0.95); top_p: 0.4/0.95 < 0.6 -> 1, 2
        SamplingParams(top_k=3, min_p=0.45),  # top_k: 0.40/0.85, 0.30/0.85, 0.15/0.85; min_p drops 3
    ]
    probs = sampling_probs(logits.repeat(len(params), 1), params)
    kept = [set(torch.nonzero(row).flatten().tolist()) for row in probs]
    assert kept == [{1, 2, 3}, {1, 2, 3}, {1, 2}, {1, 2}, {1, 2}]
    assert probs[0].tolist() == pytest.approx([0, 0.40 / 0.85, 0.30 / 0.85, 0.15 / 0.85, 0])
    assert probs.sum(dim=-1).tolist() == pytest.approx([1.0] * len(params))


def test_temperature_scales_before_filters():
    logits = _logits_of([0.5, 0.3, 0.2])
    hot = sampling_probs(logits, [SamplingParams(temperature=2.0)])[0]
    expected = torch.tensor([0.5, 0.3, 0.2]).sqrt()
    assert hot.tolist() == pytest.approx((expected / expected.sum()).tolist())


def test_draws_follow_the_distribution_and_respect_filters():
    logits = _logits_of([0.5, 0.3, 0.15, 0.05]).repeat(4000, 1)
    params = [SamplingParams(top_k=3, seed=None)] * 4000
    torch.manual_seed(0)
    tokens = sample(logits, params).token_ids
    counts = torch.bincount(tokens, minlength=4).float() / 4000
    assert counts[3] == 0
    assert counts[:3].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95], abs=0.04)


def test_seeded_draws_follow_the_distribution():
    params = SamplingParams(seed=42)
    generator = make_generator(params)
    logits = _logits_of([0.6, 0.3, 0.1])
    tokens = torch.tensor([int(sample(logits, [params], [generator]).token_ids[0]) for _ in range(1500)])
    counts = torch.bincount(tokens, minlength=3).float() / 1500
    assert counts.tolist() == pytest.approx([0.6, 0.3, 0.1], abs=0.05)


def test_logprobs_are_raw_log_softmax():
    logits = _random_logits(3)
    params = [SamplingParams(temperature=0.5, logprobs=True, top_logprobs=5, seed=3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)]
    result = sample(logits, params, [make_generator(p) for p in params])
    expected = logits.log_softmax(dim=-1)
    assert torch.allclose(result.logprobs, expected.gather(1, result.token_ids.unsqueeze(1)).squeeze(1))

    chosen, top = result.logprobs_of(0, params[0])
    assert chosen == pytest.approx(float(expected[0, result.token_ids[0]]), abs=1e-6)
    values, ids = expected[0].topk(5)
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert result.logprobs_of(1, params[1]) == (None, [])
    chosen, top = result.logprobs_of(2, params[2])
    assert len(top) == 2 and top[0][0] == int(result.token_ids[2]) == int(logits[2].argmax())
    assert chosen == pytest.approx(top[0][1]) and math.isfinite(chosen)


def test_logprobs_without_top():
    logits = _random_logits(2)
    result = sample(logits, [SamplingParams(temperature=0.0, logprobs=True)] * 2)
    assert result.top_ids is None
    assert result.logprobs_of(0, SamplingParams(logprobs=True))[1] == []


def test_lists_become_tuples():
    params = SamplingParams(stop=["\n\n", "END"], stop_token_ids=[7])
    assert params.stop == ("\n\n", "END") and params.stop_token_ids == (7,)
    assert hash(params) == hash(SamplingParams(stop=("\n\n", "END"), stop_token_ids=(7,)))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_validate_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_edges():
    for params in (SamplingParams(), SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0,
                                                    max_new_tokens=1, top_logprobs=20, logprobs=True)):
        assert params.validate() is params


def test_batch_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="sampling params"):
        sample(_random_logits(2), [GREEDY])


def _reference_kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens top_k then top_p keep, by the definition: sort everything, in float64."""
    probs = (logits.double() / params.temperature).softmax(dim=-1)
    order = probs.argsort(descending=True).tolist()
    if params.top_k > 0:
        order = order[:params.top_k]
    kept_probs = probs[order] / probs[order].sum()
    kept, mass = set(), 0.0
    for token, p in zip(order, kept_probs.tolist(), strict=True):
        if kept and params.top_p < 1 and mass >= params.top_p:
            break
        kept.add(token)
        mass += p
    return kept


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])  # wide nucleus (full sort) .. narrow (topk 256)
def test_top_k_top_p_match_the_definition_on_a_large_vocab(scale):
    vocab = 6000
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=40), SamplingParams(top_k=300, top_p=0.5),
              SamplingParams(), SamplingParams(top_p=0.99, temperature=0.7), SamplingParams(top_k=5000),
              SamplingParams(top_p=0.2, top_k=1000)]
    logits = _random_logits(len(params), vocab, seed=int(scale * 10)) / 3 * scale
    probs = sampling_probs(logits, params)
    for row, p in enumerate(params):
        assert set(torch.nonzero(probs[row]).flatten().tolist()) == _reference_kept(logits[row], p), p
    assert probs.sum(dim=-1).tolist() == pytest.approx([1.0] * len(params))
