"""`pdserve bench serving-spec`: the systems it compares, the flags their workers get, and the table of
figures with their ratios to the run without speculation."""

from __future__ import annotations

import pytest

from tools.bench.serving import deployments, spec_pd
from tools.bench.serving.spec_pd import BASELINE, FIGURES, System
from tools.bench.serving.workload import WorkloadError

DRAFT = "--speculative-draft-model-path"


def test_systems_are_the_baseline_then_each_spec_with_its_flags_split_as_a_shell_would() -> None:
    systems = spec_pd.parse_systems(["ngram=--speculative-algorithm NGRAM",
                             f"standalone=--speculative-algorithm STANDALONE {DRAFT} '/m/a draft'"])
    assert systems == [System(BASELINE, ()), System("ngram", ("--speculative-algorithm", "NGRAM")),
                       System("standalone", ("--speculative-algorithm", "STANDALONE", DRAFT, "/m/a draft"))]
    assert [s.name for s in spec_pd.parse_systems(None)] == [BASELINE, "ngram"]  # NGRAM when no --spec


@pytest.mark.parametrize("spec, message", [
    ("ngram", "expected NAME=FLAGS"), ("=--speculative-algorithm NGRAM", "expected NAME=FLAGS"),
    ("off=--speculative-algorithm NGRAM", "name of the baseline"), ("ngram=", "no flags"),
    ("ngram=--x 'unclosed", "quotation"),
])
def test_bad_specs_are_refused_naming_the_flag(spec, message) -> None:
    with pytest.raises(WorkloadError, match=message):
        spec_pd.parse_systems([spec])
    with pytest.raises(WorkloadError, match="names must differ"):
        spec_pd.parse_systems(["a=--x", "a=--y"])


def test_concurrencies_parse_and_bad_ones_are_refused() -> None:
    assert spec_pd.parse_concurrencies("1,8") == [1, 8]
    for bad in ("0,8", "one", ""):
        with pytest.raises(WorkloadError, match="--concurrencies"):
            spec_pd.parse_concurrencies(bad)


def test_every_worker_of_a_deployment_gets_the_systems_flags() -> None:
    settings = deployments.WorkerSettings(model_path="m", worker_flags=("--speculative-algorithm", "NGRAM"))
    for mode, extra in (("prefill", ()), ("decode", ("--conditional-disaggregation",))):
        args = deployments._worker_args(settings, mode, 1, extra)
        assert args[-2:] == ["--speculative-algorithm", "NGRAM"]
        assert args[args.index("--disaggregation-mode") + 1] == mode
    plain = deployments._worker_args(deployments.WorkerSettings("m"), "decode", 1)
    assert "--speculative-algorithm" not in plain


def _payload(scale: float) -> dict:
    return {"completed": 8, "failed": 0, **{key: scale * (i + 1) for i, (key, _) in enumerate(FIGURES)}}


def test_ratios_are_each_system_over_the_baseline_at_the_same_concurrency() -> None:
    none = {"pdserve:spec_drafted_tokens_total": 0.0, "pdserve:spec_accepted_tokens_total": 0.0,
            "pdserve:spec_verify_rows_total": 0.0}
    drafts = {"pdserve:spec_drafted_tokens_total": 40.0, "pdserve:spec_accepted_tokens_total": 30.0,
              "pdserve:spec_verify_rows_total": 10.0}
    # runs 1 and 2 share a concurrency (--concurrencies 1,8,8): each pairs with its own baseline
    rows = [spec_pd.row_of(system, concurrency, _payload(scale), drafts if system == "ngram" else none, run)
            for run, system, concurrency, scale in ((0, BASELINE, 1, 1.0), (0, "ngram", 1, 0.5),
                                                    (1, BASELINE, 8, 2.0), (1, "ngram", 8, 3.0),
                                                    (2, "ngram", 8, 2.0), (2, BASELINE, 8, 4.0))]
    ratios = spec_pd.ratio_rows(rows)
    assert [(r["system"], r["run"], r["concurrency"]) for r in ratios] == [("ngram", 0, 1), ("ngram", 1, 8),
                                                                         ("ngram", 2, 8)]
    for ratio, expected in zip(ratios, (0.5, 1.5, 0.5), strict=True):
        assert all(ratio[key] == pytest.approx(expected) for key, _ in FIGURES)
    assert rows[1]["accept_len"] == pytest.approx(4.0) and rows[0]["accept_len"] is None
    text = spec_pd.table(rows, ratios)
    assert "| ngram | 1 | 0.50 |" in text and "| ngram | 8 | 1.50 |" in text
    assert "| ngram | 1 | 0.5 | 1.0 |" in text and "| 40 | 30 | 4.00 |" in text
