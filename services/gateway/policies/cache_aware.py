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
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.page_hash import page_hashes
from services.gateway.policies.base import Policy
from services.gateway.policies.prefix_tree import PrefixTree
from services.gateway.workers import WorkerHandle


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, max_tree_tokens: int = 200_000) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_tree_tokens)

    def imbalanced(self, candidates: Sequence[WorkerHandle]) -> bool:
        loads = [worker.inflight for worker in candidates]
        highest, lowest = max(loads), min(loads)
        return highest - lowest > self.balance_abs_threshold and highest > self.balance_rel_threshold * lowest

    def choose(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int]) -> WorkerHandle:
        chosen = self._pick(candidates, prompt_token_ids)
        if not chosen.kv_cache.synced:  # its real state will not tell: remember the guess
            self.tree.insert(prompt_token_ids, chosen.key)
        return chosen

    def _cache_size(self, worker: WorkerHandle) -> int:
        """Tokens the worker caches (real when known, else the guess)."""
        view = worker.kv_cache
        return len(view.hashes) * view.page_size if view.synced else self.tree.size(worker.key)

    def _pick(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int]) -> WorkerHandle:
        least_loaded = min(candidates, key=lambda worker: (worker.load, self._cache_size(worker)))
        if len(candidates) == 1 or self.imbalanced(candidates):
            return least_loaded
        matched = self.tree.match(prompt_token_ids)
        hashes_by_size: dict[int, list[int]] = {}
        for worker in candidates:
            view = worker.kv_cache
            if view.synced and view.page_size > 0:
                size = view.page_size
                if size not in hashes_by_size:
                    hashes_by_size[size] = page_hashes(prompt_token_ids, size)
                matched[worker.key] = view.cached_pages(hashes_by_size[size]) * size
        best = max(candidates, key=lambda worker: (matched.get(worker.key, 0), [-x for x in worker.load]))
        best_len = matched.get(best.key, 0)
        if best_len > 0 and best_len >= self.cache_threshold * len(prompt_token_ids):
            return best
        return least_loaded

    def forget(self, worker: WorkerHandle) -> None:
        self.tree.remove_worker(worker.key)
