"""pdserve / Gateway: routing and resilience, as the gateway sees its workers."""

from __future__ import annotations

from tools.dashboards.panels import RATE_INTERVAL as RATE
from tools.dashboards.panels import Json, Target, dashboard, timeseries

FILENAME = "gateway.json"
CIRCUIT_STATES = {
    "0": {"text": "closed", "color": "green"},
    "1": {"text": "half-open", "color": "yellow"},
    "2": {"text": "open", "color": "red"},
}


def build() -> Json:
    return dashboard(
        "pdserve-gateway",
        "pdserve / Gateway",
        "Routing and resilience: retries, circuit breakers, per-worker load, admission control.",
        [
            timeseries(
                "Retries/s by reason",
                "Attempts the gateway retried on another (prefill, decode) pair before any token reached"
                " the client.",
                "reqps",
                Target(f"sum by (reason) (rate(pdserve:gateway_retries_total{RATE}))", "{{reason}}"),
            ),
            timeseries(
                "Circuit state per worker",
                "0 closed (routed to), 1 half-open (one trial), 2 open (no traffic until a health probe"
                " passes).",
                "short",
                Target("max by (worker, role) (pdserve:gateway_worker_circuit_state)", "{{role}} {{worker}}"),
                min=0,
                max=2,
                mappings=[{"type": "value", "options": CIRCUIT_STATES}],
            ),
            timeseries(
                "In-flight requests per worker",
                "Requests this gateway has open on each worker.",
                "short",
                Target("sum by (worker, role) (pdserve:gateway_worker_inflight_requests)",
                       "{{role}} {{worker}}"),
            ),
            timeseries(
                "Attempts routed per worker",
                "Attempts sent to each worker per second (a retried request counts once per attempt).",
                "reqps",
                Target(f"sum by (worker, role) (rate(pdserve:gateway_worker_requests_total{RATE}))",
                       "{{role}} {{worker}}"),
            ),
            timeseries(
                "Shed requests/s",
                "Requests refused with 429 by admission control: queue_full (the wait queue was full),"
                " queue_timeout (waited too long).",
                "reqps",
                Target(f"sum by (reason) (rate(pdserve:gateway_shed_requests_total{RATE}))", "{{reason}}"),
            ),
            timeseries(
                "Admission: running slots and waiting requests",
                "Generation slots held by admitted requests and requests waiting for one.",
                "short",
                Target("sum by (model) (pdserve:gateway_admission_running_slots)", "running {{model}}"),
                Target("sum by (model) (pdserve:gateway_admission_waiting_requests)", "waiting {{model}}"),
            ),
            timeseries(
                "Client aborts/s",
                "Requests the client left early (the gateway cancelled Generate and sent Worker.Abort).",
                "reqps",
                Target(f"sum(rate(pdserve:gateway_aborts_total{RATE}))", "aborts"),
            ),
            timeseries(
                "Worker queues (as the workers report)",
                "Requests queued or running on each worker, all PD queues together.",
                "short",
                Target("sum by (role, instance) (pdserve:queue_requests)", "{{role}} {{instance}}"),
            ),
        ],
    )
