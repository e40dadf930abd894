"""A test matrix `make test` covers in part and `make test-all` runs whole.

An e2e test over models x backends x layouts starts a deployment per combination; most of what a
combination can break shows with fewer of them. `cover` keeps every combination as a pytest param
and marks `long` (tests/conftest.py: `make test-all` only) those outside a cover: every value of
every axis at least once (`pairs=False`), or every pair of values of any two axes at least once
(`pairs=True`, for three axes or more).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest


def _covered(combo: tuple, kept: list[tuple], pairs: bool) -> bool:
    if not pairs:
        return all(any(k[i] == v for k in kept) for i, v in enumerate(combo))
    return all(any(k[i] == combo[i] and k[j] == combo[j] for k in kept)
               for i, j in itertools.combinations(range(len(combo)), 2))


def cover_of(axes: Sequence[Sequence[Any]], pairs: bool = False) -> list[tuple]:
    """The combinations `make test` runs, in the order of the full product: greedily, each one
    that brings a value (or pair of values) no kept combination has yet, until all are covered."""
    kept: list[tuple] = []
    full = list(itertools.product(*axes))
    while not all(_covered(c, kept, pairs) for c in full):
        # each value once: ties go to the combination whose values the kept ones use least, so
        # that a short axis (backends) alternates along a long one (models)
        best = max(full, key=lambda c: (_gain(c, kept, pairs), 0 if pairs else -_uses(c, kept)))
        kept.append(best)
    return [c for c in full if c in kept]


def _uses(combo: tuple, kept: list[tuple]) -> int:
    return sum(1 for k in kept for i, v in enumerate(combo) if k[i] == v)


def _gain(combo: tuple, kept: list[tuple], pairs: bool) -> int:
    if combo in kept:
        return -1
    if not pairs:
        return sum(1 for i, v in enumerate(combo) if not any(k[i] == v for k in kept))
    return sum(1 for i, j in itertools.combinations(range(len(combo)), 2)
               if not any(k[i] == combo[i] and k[j] == combo[j] for k in kept))


def cover(*axes: Sequence[Any], pairs: bool = False) -> list:
    """pytest params of every combination of `axes` (one value per param when there is one axis);
    those outside `cover_of(axes, pairs)` are marked long."""
    kept = cover_of(axes, pairs)
    return [pytest.param(*combo, marks=() if combo in kept else pytest.mark.long)
            for combo in itertools.product(*axes)]
