"""pdserve / PD pipeline: inside prefill/decode disaggregation, and the store tier under it."""

from __future__ import annotations

from tools.dashboards.panels import RATE_INTERVAL as RATE
from tools.dashboards.panels import Json, Panel, Row, Target, dashboard, quantiles, timeseries

FILENAME = "pd-pipeline.json"
PER_WORKER = "{{role}} {{instance}}"


def _spec_rate(name: str) -> str:
    return f"sum by (role, instance) (rate(pdserve:spec_{name}_total{RATE}))"


def _pd_panels() -> list[Panel | Row]:
    return [
        timeseries(
            "Prefill queues",
            "Requests in each prefill queue: bootstrap (waiting for decode's handshake), waiting (for a"
            " forward pass), inflight (KV transfer not finished).",
            "short",
            Target('sum by (queue) (pdserve:queue_requests{role="prefill"})', "{{queue}}"),
        ),
        timeseries(
            "Decode queues",
            "Requests in each decode queue: prealloc (waiting for free pages), transfer (waiting for KV),"
            " waiting (not batched yet), running (in the decode batch).",
            "short",
            Target('sum by (queue) (pdserve:queue_requests{role="decode"})', "{{queue}}"),
        ),
        timeseries(
            "KV transfer throughput",
            "KV bytes prefill workers wrote into decode workers' memory, per prefill worker.",
            "Bps",
            Target(f'sum by (instance) (rate(pdserve:kv_transfer_bytes_total{{role="prefill"}}{RATE}))',
                   "{{instance}}"),
        ),
        timeseries(
            "KV transfer speed per request (GB/s)",
            "Each request's KV bytes over its transfer time.",
            "none",
            *quantiles("pdserve:kv_transfer_speed_gb_s", 0.1, 0.5, 0.9),
        ),
        timeseries(
            "KV transfer latency",
            "From a request's first KV write to its last completing.",
            "s",
            *quantiles("pdserve:kv_transfer_latency_seconds", 0.5, 0.99),
        ),
        timeseries(
            "Bootstrap / transfer failures",
            "PD failures by role and stage: bootstrap (handshake or model/layout mismatch), grant (a write"
            " refused), transfer, prefill (peer failed), prealloc (no pages in time), checksum (a page"
            " arrived wrong).",
            "short",
            Target(f"sum by (role, stage) (increase(pdserve:pd_failures_total{RATE}))", "{{role}} {{stage}}"),
        ),
        timeseries(
            "KV pages used per worker",
            "Pages held by requests or reserved, as a fraction of each worker's pool.",
            "percentunit",
            Target("pdserve:kv_pages_used / pdserve:kv_pages_total", PER_WORKER),
        ),
        timeseries(
            "Running requests per worker",
            "Requests in each worker's decode batch.",
            "short",
            Target("pdserve:num_running_reqs", PER_WORKER),
        ),
        timeseries(
            "KV leak detector firings",
            "Pages held with no live request, found by each worker's leak detector"
            " (pdserve:kv_leak_detections_total). Anything above 0 is a bug.",
            "short",
            Target(f"sum by (role, instance) (increase(pdserve:kv_leak_detections_total{RATE}))", PER_WORKER),
        ),
        timeseries(
            "Structured outputs",
            "Grammars compiled and served from the cache per second, refusals (did not compile, or not in"
            " time), seconds spent compiling per second, and tokens sampled under a grammar mask.",
            "short",
            Target(f"sum(rate(pdserve:grammar_compiles_total{RATE}))", "compiles/s"),
            Target(f"sum(rate(pdserve:grammar_cache_hits_total{RATE}))", "cache hits/s"),
            Target(f"sum(rate(pdserve:grammar_refused_total{RATE}))", "refused/s"),
            Target(f"sum(rate(pdserve:grammar_compile_seconds_total{RATE}))", "compile s/s"),
            Target(f"sum(rate(pdserve:grammar_constrained_steps_total{RATE}))", "masked tokens/s"),
        ),
        timeseries(
            "Quarantined rooms (decode)",
            "Failed requests whose pages wait for their prefill to confirm no KV write can still land.",
            "short",
            Target("pdserve:kv_quarantined_rooms", "{{instance}}"),
        ),
        timeseries(
            "Retractions/s",
            "Requests a worker took out of its batch under memory pressure (resumed later).",
            "short",
            Target(f"sum by (role, instance) (rate(pdserve:retractions_total{RATE}))", PER_WORKER),
        ),
        timeseries(
            "Speculative decoding: drafted and accepted tokens/s",
            "Per worker: tokens drafted and tokens the target accepted (their ratio is the acceptance rate;"
            " SGLang's accept length, 1 + accepted / verifies, is in the decode log line). Zero with"
            " speculation off.",
            "short",
            Target(_spec_rate("drafted_tokens"), "drafted {{instance}}"),
            Target(_spec_rate("accepted_tokens"), "accepted {{instance}}"),
        ),
        timeseries(
            "Registry: workers and expired leases",
            "Workers registered with the bootstrap registry, and leases expired for missed heartbeats.",
            "short",
            Target("sum by (role) (pdserve:bootstrap_workers)", "{{role}}"),
            Target(f"sum(increase(pdserve:bootstrap_lease_expiries_total{RATE}))", "lease expiries"),
        ),
        timeseries(
            "Registry store up",
            "Per registry process: 1 while its view of its store is current (etcd: its watch is up), 0"
            " otherwise.",
            "short",
            Target("min by (instance) (pdserve:bootstrap_store_up)", "{{instance}}"),
        ),
    ]


def _store_panels() -> list[Panel | Row]:
    return [
        Row("Store tier (hierarchical cache: Mooncake Store)"),
        timeseries(
            "Store hits: pages/s",
            "KV pages fetched from the store instead of computed (pdserve:hicache_hit_pages_total), per"
            " worker. Workers with --enable-hierarchical-cache only.",
            "short",
            Target(f"sum by (role, instance) (rate(pdserve:hicache_hit_pages_total{RATE}))", PER_WORKER),
        ),
        timeseries(
            "Store bytes read / written",
            "KV bytes fetched from and written through to the store, all workers.",
            "Bps",
            Target(f"sum(rate(pdserve:hicache_read_bytes_total{RATE}))", "read"),
            Target(f"sum(rate(pdserve:hicache_written_bytes_total{RATE}))", "written"),
        ),
        timeseries(
            "Store fetch latency",
            "One fetch on a local prefix-cache miss: exists check, get, checks, copy into the pool"
            " (pdserve:hicache_fetch_latency_seconds, fetches that found pages).",
            "s",
            *quantiles("pdserve:hicache_fetch_latency_seconds", 0.5, 0.99),
        ),
        timeseries(
            "Store errors, corrupt entries, dropped pages",
            "Store calls that failed or timed out (probes included), fetched entries that failed their"
            " check (used as misses, never as answers) and pages offered but not written (write queue"
            " full, or the store down), per worker.",
            "short",
            Target(f"sum by (role, instance) (increase(pdserve:hicache_store_errors_total{RATE}))",
                   f"errors {PER_WORKER}"),
            Target(f"sum by (role, instance) (increase(pdserve:hicache_corrupt_entries_total{RATE}))",
                   f"corrupt {PER_WORKER}"),
            Target(f"sum by (role, instance) (increase(pdserve:hicache_dropped_pages_total{RATE}))",
                   f"dropped {PER_WORKER}"),
        ),
        timeseries(
            "Store up",
            "1 while a worker's store answers, 0 while it is down (its requests are computed without it).",
            "short",
            Target("min by (role, instance) (pdserve:hicache_store_up)", PER_WORKER),
        ),
    ]


def build() -> Json:
    return dashboard(
        "pdserve-pd-pipeline",
        "pdserve / PD pipeline",
        "Inside prefill/decode disaggregation: the queues of each side, KV transfer speed and failures,"
        " KV memory, leaks, the store tier (hierarchical cache).",
        _pd_panels() + _store_panels(),
    )
