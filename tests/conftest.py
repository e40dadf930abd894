"""The `long` tests: what `make test` leaves to `make test-all` (pytest --long).

A test marked `long` is a longer version of a check `make test` already makes in short (the whole
chaos table, a longer fuzz, the full matrix of models x backends x layouts where `make test` runs a
cover of it), a benchmark command run end to end (`make test` keeps its argument checks), or one
whose cost is mostly a cold start (the compose build on a fresh machine); `make test-all` runs them
with everything else. Without --long they are skipped, saying where they run.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the tests marked long (make test-all)")
    parser.addoption("--worker-flags", default="",
                     help="flags added to every `launch-server` an e2e test starts through the launcher, "
                          "e.g. --worker-flags='--speculative-algorithm NGRAM': the same exactness tests "
                          "under another engine setting (make test-spec)")
    parser.addoption("--fresh-workers", action="store_true", default=False,
                     help="start every e2e worker as its own interpreter, not forked from one that imported "
                          "pdserve once (tests/e2e/forked_launch.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long: runs in `make test-all` (pytest --long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
