"""cache_aware: send a prompt where its prefix is cached, unless load is lopsided.

Per request (SGLang's router does the same, on a guess; llm-d and Dynamo on KV events):
1. If the candidates' in-flight counts are imbalanced (max - min > balance_abs_threshold AND
   max > balance_rel_threshold x min), take the least loaded: cache hits are not worth a queue.
2. Otherwise take the candidate with the longest cached prefix of this prompt, if it covers at
   least `cache_threshold` of the prompt.
3. Otherwise (nothing useful cached) the least loaded, ties to the one caching the least (most
   room for a new prefix).

"Cached" is the worker's real prefix cache wherever the worker publishes KV events (its
`kv_cache` view is synced, kv_events.py): the prompt's chained page hashes with that worker's
page size, counted until the first page it does not hold. Prefill and decode workers are matched
each on their own caches (one policy instance per role). Only for a worker whose state is not known
(no stream yet, or one that publishes none) does the policy fall back to a guess: a prefix tree of
the prompts routed to it, updated after every choice.

LoRA: a prompt under an adapter is hashed with the key that worker hashes the adapter's pages under
(from the registry, pdserve/page_hash.py with_adapter), so it matches only that adapter's pages
there, never the base model's or another adapter's; the guessing tree keeps each adapter's prompts
apart the same way (a leading token of the adapter's own). A worker whose adapter key is not known
is scored by the guess.

Tiers: a worker's own pool counts in full; pages after its local run that it could fetch from the
cluster-wide store (--enable-hierarchical-cache: pages any candidate on the same store reports as
in it, KV events of medium STORE) count `store_weight` (default 0.5) each. A fetch is cheaper than
computing but not free, and every worker on the store can make it: a prefix held only in the store
gives every such candidate the same score, so it attracts no routing to one worker (load decides),
while a worker holding it locally still wins (L + w(S - L) > wS whenever L > 0 and w < 1).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.page_hash import PageHashMemo, adapter_salt, iter_page_hashes, page_hashes, with_adapter
from services.gateway.kv_view import PageSet, leading_run, leading_runs
from services.gateway.policies.base import Policy
from services.gateway.policies.prefix_tree import PrefixTree
from services.gateway.workers import WorkerHandle


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, max_tree_tokens: int = 200_000,
                 store_weight: float = 0.5) -> None:
        if not 0.0 <= store_weight < 1.0:
            raise ValueError("store_weight must be in [0, 1): a store hit counts below a local one, got "
                             f"{store_weight}")
        self.cache_threshold = cache_threshold
        self.store_weight = store_weight
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_tree_tokens)
        self.page_hash_memo = PageHashMemo()  # hot prefixes are hashed once, not per request

    def imbalanced(self, candidates: Sequence[WorkerHandle]) -> bool:
        loads = [worker.inflight for worker in candidates]
        highest, lowest = max(loads), min(loads)
        return highest - lowest > self.balance_abs_threshold and highest > self.balance_rel_threshold * lowest

    def choose(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
               lora: str | None = None) -> WorkerHandle:
        chosen = self._pick(candidates, prompt_token_ids, lora)
        if not _knows_cache(chosen, lora):  # its real state will not tell: remember the guess
            self.tree.insert(_tree_tokens(prompt_token_ids, lora), chosen.key)
        return chosen

    def _cache_size(self, worker: WorkerHandle) -> int:
        """Tokens the worker caches (real when known, else the guess)."""
        view = worker.kv_cache
        return len(view.hashes) * view.page_size if view.synced else self.tree.size(worker.key)

    def _least_loaded(self, candidates: Sequence[WorkerHandle]) -> WorkerHandle:
        return min(candidates, key=lambda worker: (worker.load, self._cache_size(worker)))

    def _pick(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
              lora: str | None) -> WorkerHandle:
        if len(candidates) == 1 or self.imbalanced(candidates):
            return self._least_loaded(candidates)
        guessed = self.tree.match(_tree_tokens(prompt_token_ids, lora))
        # (an adapter's leading token is no token of the prompt)
        matched: dict[str, float] = {worker: max(length - (lora is not None), 0)
                                     for worker, length in guessed.items()}
        matched.update(self._matched_by_events(candidates, prompt_token_ids, lora))
        best_len = max(matched.get(worker.key, 0) for worker in candidates)
        if best_len > 0 and best_len >= self.cache_threshold * len(prompt_token_ids):
            # Ties (a prefix only in the store scores the same on every worker on it) go as load does.
            return min((worker for worker in candidates if matched.get(worker.key, 0) == best_len),
                       key=lambda worker: (worker.load, self._cache_size(worker)))
        return self._least_loaded(candidates)

    def _matched_by_events(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
                           lora: str | None) -> dict[str, float]:
        """Tokens of the prompt each worker whose KV events tell caches (local pages in full, store
        pages after them at store_weight). Workers that hash alike (page size, adapter key) are
        matched together: the prompt is hashed once for them, page by page, only as far as one of
        them still holds every page so far (leading_runs)."""
        groups: dict[tuple[int, str | None], list[WorkerHandle]] = {}
        for worker in candidates:  # (a loop over every candidate: kept to attribute reads)
            view = worker.kv_cache
            if not view.synced or view.page_size <= 0:
                continue
            adapter_key = None if lora is None else worker.lora_cache_key(lora)
            if lora is not None and adapter_key is None:
                continue  # its pages of this adapter are hashed under a key not known here
            group = groups.get((view.page_size, adapter_key))
            if group is None:
                groups[view.page_size, adapter_key] = [worker]
            else:
                group.append(worker)
        matched: dict[str, float] = {}
        for (size, adapter_key), workers in groups.items():
            salts = with_adapter([], adapter_key)
            if any(worker.kv_cache.store for worker in workers):
                matched.update(self._matched_with_store(candidates, workers, prompt_token_ids, size, salts))
                continue
            pages = iter_page_hashes(prompt_token_ids, size, salts=salts, memo=self.page_hash_memo)
            runs = leading_runs(pages, [worker.kv_cache.hashes for worker in workers])
            matched.update((worker.key, run * size) for worker, run in zip(workers, runs, strict=True))
        return matched

    def _matched_with_store(self, candidates: Sequence[WorkerHandle], workers: Sequence[WorkerHandle],
                            prompt_token_ids: Sequence[int], size: int, salts: list[int]) -> dict[str, float]:
        """_matched_by_events for workers of which some share a cluster-wide store: every page hashed,
        since a page may be fetchable from the store past the end of every local run."""
        stores: dict[str, list[PageSet]] = {}  # store -> what each synced candidate on it reports in it
        for worker in candidates:
            view = worker.kv_cache
            if view.synced and view.store:
                stores.setdefault(view.store, []).append(view.store_hashes)
        hashes = page_hashes(prompt_token_ids, size, salts=salts)
        matched: dict[str, float] = {}
        for worker in workers:
            view = worker.kv_cache
            local = view.cached_pages(hashes) if hashes and hashes[0] in view.hashes else 0
            fetchable = leading_run(hashes, stores[view.store], local) if view.store else 0
            matched[worker.key] = (local + self.store_weight * fetchable) * size
        return matched

    def forget(self, worker: WorkerHandle) -> None:
        self.tree.remove_worker(worker.key)


def _knows_cache(worker: WorkerHandle, lora: str | None) -> bool:
    """Whether the worker's KV events tell what it caches of a prompt under `lora`: its stream is
    synced and, for an adapter, the key its pages of that adapter are hashed under is known."""
    return worker.kv_cache.synced and (lora is None or worker.lora_cache_key(lora) is not None)


def _tree_tokens(prompt_token_ids: Sequence[int], lora: str | None) -> Sequence[int]:
    """The prompt as the guessing tree keys it: under an adapter, after a token of the adapter's own
    (negative: no vocabulary id), so no guess matches across adapters or with the base model."""
    return prompt_token_ids if lora is None else [-1 - (adapter_salt(lora) >> 1), *prompt_token_ids]
