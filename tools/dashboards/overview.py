"""pdserve / Overview: what clients get, as the gateway measures it, and token throughput."""

from __future__ import annotations

from tools.dashboards.panels import RATE_INTERVAL as RATE
from tools.dashboards.panels import Json, Target, dashboard, quantiles, timeseries

FILENAME = "overview.json"
ERRORS = 'pdserve:gateway_requests_total{status=~"[45].."}'


def build() -> Json:
    return dashboard(
        "pdserve-overview",
        "pdserve / Overview",
        "What clients get: request rate, errors, latency percentiles as the gateway measures them,"
        " token throughput.",
        [
            timeseries(
                "Requests/s by endpoint and status",
                "HTTP requests answered by the gateway (pdserve:gateway_requests_total).",
                "reqps",
                Target(f"sum by (endpoint, status) (rate(pdserve:gateway_requests_total{RATE}))",
                       "{{endpoint}} {{status}}"),
            ),
            timeseries(
                "Errors/s (4xx, 5xx)",
                "Requests answered with an error status; 429 is admission control shedding load.",
                "reqps",
                Target(f"sum by (status) (rate({ERRORS}{RATE}))", "{{status}}"),
                Target(f"sum(rate({ERRORS}{RATE})) / sum(rate(pdserve:gateway_requests_total{RATE}))",
                       "error ratio"),
            ),
            timeseries(
                "Time to first token (gateway)",
                "Arrival at the gateway to the first token handed to the client: tokenization, routing,"
                " retries, prefill, KV transfer included.",
                "s",
                *quantiles("pdserve:gateway_time_to_first_token_seconds", 0.5, 0.9, 0.99),
            ),
            timeseries(
                "Inter-token latency (gateway)",
                "Time between tokens handed to the client.",
                "s",
                *quantiles("pdserve:gateway_inter_token_latency_seconds", 0.5, 0.9, 0.99),
            ),
            timeseries(
                "Tokens/s",
                "Prompt tokens processed and tokens generated, by worker role (in PD a prompt is counted"
                " by its prefill and its decode worker).",
                "short",
                Target(f"sum by (role) (rate(pdserve:generation_tokens_total{RATE}))",
                       "generated ({{role}})"),
                Target(f"sum by (role) (rate(pdserve:prompt_tokens_total{RATE}))", "prompt ({{role}})"),
            ),
            timeseries(
                "End-to-end request latency (gateway)",
                "Arrival at the gateway to the last token.",
                "s",
                *quantiles("pdserve:gateway_e2e_request_latency_seconds", 0.5, 0.99),
            ),
            timeseries(
                "Finished requests/s by finish reason",
                "Requests the workers finished (stop, length, abort).",
                "reqps",
                Target(f"sum by (finish_reason) (rate(pdserve:request_success_total{RATE}))",
                       "{{finish_reason}}"),
            ),
            timeseries(
                "Time to first token by worker role (p99)",
                "As each worker measures it, from the request's arrival at that worker.",
                "s",
                *quantiles("pdserve:time_to_first_token_seconds", 0.99, by="role"),
            ),
            timeseries(
                "Workers known to the gateway",
                "By role: routable workers of the served model.",
                "short",
                Target("sum by (role) (pdserve:gateway_workers)", "{{role}}"),
                width=24,
                height=6,
            ),
        ],
    )
