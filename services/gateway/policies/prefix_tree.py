"""A prefix tree over token ids recording which workers have seen which prompt prefixes.

It approximates each worker's prefix cache from the routing decisions alone (the worker is not
asked): a prompt routed to worker W is inserted for W, so a later prompt sharing a prefix with it
matches W. One trie is shared by all workers; a node lists the workers whose routed prompts pass
through it. Each worker may own at most `max_tokens_per_worker` nodes: beyond that, its least
recently routed prompts are evicted, from their ends up to where they share a path with a
prompt still kept (what an LRU radix cache on the worker would drop first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class _Node:
    __slots__ = ("token", "parent", "children", "owners")

    def __init__(self, token: int, parent: _Node | None) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.owners: set[str] = set()


class PrefixTree:
    """Per-worker approximate prefix caches in one trie. Not thread-safe (event loop only)."""

    def __init__(self, max_tokens_per_worker: int = 200_000) -> None:
        if max_tokens_per_worker < 1:
            raise ValueError(f"max_tokens_per_worker must be >= 1, got {max_tokens_per_worker}")
        self.max_tokens_per_worker = max_tokens_per_worker
        self._root = _Node(-1, None)
        self._sizes: dict[str, int] = {}
        # per worker: the end nodes of its routed prompts, least recently routed first
        self._recent: dict[str, OrderedDict[int, _Node]] = {}

    def size(self, worker: str) -> int:
        """Nodes (prefix tokens) owned by `worker`."""
        return self._sizes.get(worker, 0)

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """For every worker sharing a prefix with `tokens`: the length of the longest one."""
        matched: dict[str, int] = {}
        node = self._root
        for depth, token in enumerate(tokens, start=1):
            child = node.children.get(token)
            if child is None:
                break
            for owner in child.owners:
                matched[owner] = depth  # ownership is prefix-closed: deeper overwrites shallower
            node = child
        return matched

    def insert(self, tokens: Sequence[int], worker: str) -> None:
        """Record that `worker` now caches `tokens` (most recently used), then evict over budget."""
        if not tokens:
            return
        node = self._root
        added = 0
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(token, node)
            if worker not in child.owners:
                child.owners.add(worker)
                added += 1
            node = child
        self._sizes[worker] = self._sizes.get(worker, 0) + added
        recent = self._recent.setdefault(worker, OrderedDict())
        recent[id(node)] = node
        recent.move_to_end(id(node))
        self._evict(worker)

    def _evict(self, worker: str) -> None:
        recent = self._recent[worker]
        while self._sizes[worker] > self.max_tokens_per_worker and recent:
            _, end = recent.popitem(last=False)
            self._release_path(end, worker)

    def _release_path(self, node: _Node, worker: str) -> None:
        """Drop `worker` from `node` and its ancestors up to the first one another of its prompts
        still passes through. A node still leading to a kept prompt of `worker` is left alone."""
        current: _Node | None = node
        while current is not None and current is not self._root and worker in current.owners:
            if any(worker in child.owners for child in current.children.values()):
                return
            current.owners.discard(worker)
            self._sizes[worker] -= 1
            parent = current.parent
            if not current.owners and not current.children and parent is not None:
                del parent.children[current.token]
            current = parent

    def remove_worker(self, worker: str) -> None:
        """Forget everything `worker` owned (it left the pool)."""
        self._recent.pop(worker, None)
        self._sizes.pop(worker, None)
        # Post-order walk: drop the owner everywhere, then nodes nobody owns (ownership is
        # prefix-closed, so an ownerless node's children are ownerless too and went first).
        stack: list[tuple[_Node, bool]] = [(self._root, False)]
        while stack:
            node, children_done = stack.pop()
            if not children_done:
                node.owners.discard(worker)
                stack.append((node, True))
                stack.extend((child, False) for child in node.children.values())
                continue
            for token, child in list(node.children.items()):
                if not child.owners and not child.children:
                    del node.children[token]
