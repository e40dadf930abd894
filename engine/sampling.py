"""The batched sampler (the parameters it reads: pdserve.sampling_params.SamplingParams, re-exported here).

The sampler turns one row of fp32 logits per request into one token id per request.

Order of the filters (the order vLLM and HF use): temperature, then top_k, then top_p, then
min_p. top_p keeps the smallest set of most likely tokens whose probability (after temperature
and top_k) reaches top_p; min_p then drops tokens whose probability is below min_p times the most
likely token's. Greedy rows (temperature 0, or top_k 1) take argmax of the raw logits, ties to
the lowest id as torch.argmax does.

Drawing: an exponential race, argmax(p / E) with E ~ Exp(1) per token, which picks token i with
probability p_i (the Gumbel-max trick in another form). Rows without a seed share one vectorized
draw; a row with a seed draws its noise from the request's own torch.Generator (see
`make_generator`), one full-vocabulary draw per step, so its tokens are the same whatever else
is in the batch.

Logprobs are "raw": log_softmax of the logits before temperature and filters (what the OpenAI
API and vLLM's default report), so they describe the model, not the sampling settings. The
chosen token's logprob is reported even when the filters would have given it another value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["MAX_TOP_LOGPROBS", "SamplingParams", "SampleResult", "make_generator", "sample", "sampling_probs"]


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for a seeded request (None for unseeded ones); create it once per
    request and pass it to every `sample` call of that request."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


@dataclass(frozen=True)
class SampleResult:
    """Tokens of one sampling step, row i for request i.

    `logprobs` [B] and `top_ids`/`top_logprobs` [B, N] (N = the largest top_logprobs asked for in
    the batch) are None when no row asked for logprobs; use `logprobs_of(i, params)` for one
    request's view (its own N, None when it asked for none).
    """

    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # float32 [B]
    top_ids: torch.Tensor | None = None  # int64 [B, N]
    top_logprobs: torch.Tensor | None = None  # float32 [B, N]

    def logprobs_of(self, row: int, params: SamplingParams) -> tuple[float | None, list[tuple[int, float]]]:
        if not params.logprobs or self.logprobs is None:
            return None, []
        chosen = float(self.logprobs[row])
        if params.top_logprobs == 0 or self.top_ids is None or self.top_logprobs is None:
            return chosen, []
        ids = self.top_ids[row, : params.top_logprobs].tolist()
        values = self.top_logprobs[row, : params.top_logprobs].tolist()
        return chosen, list(zip(ids, values, strict=True))


# top_k/top_p look among this many most likely tokens first (a topk costs a fraction of a sort:
# 16 x 32000 fp32 on one core, topk 256: 1.7 ms, topk 4096: 7 ms, full sort: 36 ms).
_CANDIDATES = (256, 4096)


def _cut(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         log_normalizer: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the descending `sorted_logits` top_k then top_p remove, and the kept mass.

    `log_normalizer` is the logsumexp the probabilities are taken against when the columns are
    only a row's leading candidates (None: the columns are the whole top_k-filtered row).
    """
    positions = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    remove = positions.unsqueeze(0) >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if log_normalizer is None:
        log_normalizer = sorted_logits.logsumexp(dim=-1)
    probs = (sorted_logits - log_normalizer.unsqueeze(1)).exp()
    # Keep a token if the tokens ranked above it have not yet reached top_p; the first always stays.
    cumulative = probs.cumsum(dim=-1)
    # (top_p 1 keeps all: in fp32 the running mass can round to 1 before the tail ends)
    remove |= ((cumulative - probs) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    remove[:, 0] = False
    return remove, cumulative[:, -1]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top_k set, then outside its top_p set
    (top_k = vocab size means no top_k, top_p = 1 no top_p).

    Fast path: take each row's `width` most likely tokens, width covering every top_k below the
    vocabulary size and at least one of _CANDIDATES. A row limited by top_k keeps only
    candidates; a row limited by top_p alone does too when the candidates' mass reaches top_p.
    If some row's nucleus is wider, try the next width; past the last, sort the full rows.
    """
    vocab = logits.shape[-1]
    limited = top_k < vocab
    untouched = ~limited & (top_p >= 1)
    widest_top_k = int(top_k[limited].max()) if bool(limited.any()) else 0
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    full_normalizer = logits.logsumexp(dim=-1)
    for width in sorted({max(candidates, widest_top_k) for candidates in _CANDIDATES}):
        if width >= vocab:
            break
        values, ids = logits.topk(width, dim=-1)
        top_k_normalizer = values.masked_fill(positions[:, :width] >= top_k.unsqueeze(1),
                                              float("-inf")).logsumexp(dim=-1)
        normalizer = torch.where(limited, top_k_normalizer, full_normalizer)
        remove, kept_mass = _cut(values, top_k, top_p, normalizer)
        if bool((limited | untouched | (kept_mass >= top_p)).all()):
            filtered = torch.full_like(logits, float("-inf"))
            filtered.scatter_(1, ids, values.masked_fill(remove, float("-inf")))
            return torch.where(untouched.unsqueeze(1), logits, filtered)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    remove, _ = _cut(sorted_logits, top_k, top_p, None)
    mask = torch.zeros_like(remove).scatter_(1, sorted_ids, remove)
    return logits.masked_fill(mask, float("-inf"))


def _filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_race(probs: torch.Tensor, rows_generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / E), E = -log(U) ~ Exp(1): token i wins with probability p_i.

    U is in [0, 1), so E is in (0, inf]: no division by zero, and a filtered token (p = 0) never
    wins. -log(rand) is several times faster on CPU than Tensor.exponential_.
    """
    uniform = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(rows_generators) if g is None]
    if len(unseeded) == len(rows_generators):
        uniform.uniform_()
    else:
        if unseeded:
            index = torch.tensor(unseeded, device=probs.device)
            uniform[index] = torch.rand((len(unseeded), probs.shape[1]), device=probs.device)
        for i, generator in enumerate(rows_generators):
            if generator is not None:
                uniform[i].uniform_(generator=generator)
    return (probs / uniform.log_().neg_()).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row is drawn from: softmax after temperature, top_k, top_p, min_p.

    Rows must not be greedy (temperature > 0). Filtered-out tokens have probability exactly 0.
    """
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
        logits = _filter_top_k_top_p(logits, top_k, top_p)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
        logits = _filter_min_p(logits, min_p)
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None] | None = None) -> SampleResult:
    """Pick one token per row of `logits` [B, V] (fp32) following each row's params.

    `generators[i]` is request i's own generator from `make_generator` (None when unseeded);
    omit the list when no request is seeded.
    """
    batch = logits.shape[0]
    if len(params) != batch:
        raise ValueError(f"{batch} rows of logits but {len(params)} sampling params")
    generators = list(generators) if generators is not None else [None] * batch
    if len(generators) != batch:
        raise ValueError(f"{batch} rows of logits but {len(generators)} generators")
    logits = logits.float()

    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(random_rows) == batch:
        token_ids = _exponential_race(sampling_probs(logits, params), generators)
    else:
        token_ids = logits.argmax(dim=-1)
    if 0 < len(random_rows) < batch:
        index = torch.tensor(random_rows, device=logits.device)
        probs = sampling_probs(logits[index], [params[i] for i in random_rows])
        token_ids[index] = _exponential_race(probs, [generators[i] for i in random_rows])

    if not any(p.logprobs for p in params):
        return SampleResult(token_ids=token_ids)
    raw_logprobs = logits.log_softmax(dim=-1)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_n = max(p.top_logprobs for p in params if p.logprobs)
    if top_n == 0:
        return SampleResult(token_ids=token_ids, logprobs=chosen)
    top = raw_logprobs.topk(top_n, dim=-1)
    return SampleResult(token_ids=token_ids, logprobs=chosen, top_ids=top.indices, top_logprobs=top.values)
