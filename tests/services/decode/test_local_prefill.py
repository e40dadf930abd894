"""Conditional disaggregation's decision: which reason runs a prompt on the decode worker, in order."""

from __future__ import annotations

import pytest

from services.decode.servicer import local_prefill_reason
from services.worker.config import LocalPrefillRule


def test_local_prefill_rule_order_and_switch() -> None:
    rule = LocalPrefillRule(enabled=True, max_tokens=32, max_prefill_queue=2)
    assert local_prefill_reason(rule, 1000, "", 0) == "no_prefill"
    assert local_prefill_reason(rule, 32, "p:1", 0) == "short_prompt"
    assert local_prefill_reason(rule, 33, "p:1", 1) is None
    assert local_prefill_reason(rule, 33, "p:1", 2) == "prefill_queue"
    assert local_prefill_reason(LocalPrefillRule(enabled=True, max_tokens=0), 5, "p:1", 99) is None  # queue rule off
    assert local_prefill_reason(LocalPrefillRule(enabled=False), 1, "", 0) is None
    with pytest.raises(ValueError, match="--local-prefill-max-tokens"):
        LocalPrefillRule(max_tokens=-1)
