"""A test matrix `make test` covers in part and `make test-all` runs whole.

An e2e test over models x backends x layouts starts a deployment per combination; most of what a
combination can break shows with fewer of them. `cover` keeps every combination as a pytest param
and marks `long` (tests/conftest.py: `make test-all` only) those outside a cover in which every
value of every axis appears at least once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest


def cover_of(axes: Sequence[Sequence[Any]]) -> list[tuple]:
    """The combinations `make test` runs, in the order of the full product: greedily, the one that
    brings the most values no kept combination has yet; ties to the one whose values the kept ones
    use least, so that a short axis (backends) alternates along a long one (models)."""
    kept: list[tuple] = []
    full = list(itertools.product(*axes))

    def missing(combo: tuple) -> int:
        return sum(1 for i, value in enumerate(combo) if not any(k[i] == value for k in kept))

    def uses(combo: tuple) -> int:
        return sum(1 for k in kept for i, value in enumerate(combo) if k[i] == value)

    while any(missing(combo) for combo in full):
        kept.append(max((c for c in full if c not in kept), key=lambda c: (missing(c), -uses(c))))
    return [c for c in full if c in kept]


def cover(*axes: Sequence[Any]) -> list:
    """pytest params of every combination of `axes`; those outside `cover_of(axes)` marked long."""
    kept = cover_of(axes)
    return [pytest.param(*combo, marks=() if combo in kept else pytest.mark.long)
            for combo in itertools.product(*axes)]
