"""Builders for the Grafana JSON the dashboards are made of: a dashboard, its panels, their targets.

A panel is a title, a description, a unit and PromQL targets; its grid position is not written by
hand: `dashboard` lays the panels out in order, left to right on Grafana's 24-column grid, starting
a new line when a panel does not fit, and numbers them. The JSON keys come out in the order Grafana
writes them, so the generated files diff cleanly against a dashboard exported from Grafana.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The Prometheus datasource docker/grafana/provisioning/datasources/prometheus.yml provisions.
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
GRID_COLUMNS = 24
# What Grafana fills in for `$__rate_interval`: at least four scrape intervals.
RATE_INTERVAL = "[$__rate_interval]"

Json = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and the legend its series get (`{{label}}` is a label's value)."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """A time series panel; `field_defaults` adds to fieldConfig.defaults (min, max, value mappings)."""

    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    width: int = 12
    height: int = 8
    field_defaults: Json = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """A full-width heading over the panels that follow it."""

    title: str
    width: int = GRID_COLUMNS
    height: int = 1


def timeseries(title: str, description: str, unit: str, *targets: Target, width: int = 12,
               height: int = 8, **field_defaults: Any) -> Panel:
    return Panel(title, description, unit, targets, width, height, field_defaults)


def quantiles(histogram: str, *qs: float, by: str = "") -> tuple[Target, ...]:
    """`histogram_quantile` at each of `qs` over a histogram's buckets, legends p50, p99...; with
    `by` (one label), one series per value of that label."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return tuple(
        Target(f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket{RATE_INTERVAL})))",
               f"p{round(q * 100)}{suffix}")
        for q in qs
    )


def _timeseries_json(panel: Panel) -> Json:
    return {
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": dict(DATASOURCE),
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "custom": {"lineWidth": 1, "fillOpacity": 10},
                **panel.field_defaults,
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": dict(DATASOURCE), "expr": target.expr,
             "legendFormat": target.legend, "range": True}
            for i, target in enumerate(panel.targets)
        ],
    }


def _row_json(row: Row) -> Json:
    return {"type": "row", "title": row.title, "collapsed": False}


def _layout(panels: list[Panel | Row]) -> list[Json]:
    """The panels' JSON with ids from 1 and grid positions flowing left to right, top to bottom."""
    laid_out = []
    x = y = line_height = 0
    for panel_id, panel in enumerate(panels, start=1):
        if x + panel.width > GRID_COLUMNS:
            x, y, line_height = 0, y + line_height, 0
        body = _row_json(panel) if isinstance(panel, Row) else _timeseries_json(panel)
        body["id"] = panel_id
        body["gridPos"] = {"h": panel.height, "w": panel.width, "x": x, "y": y}
        if isinstance(panel, Row):
            body["panels"] = []
        laid_out.append(body)
        x += panel.width
        line_height = max(line_height, panel.height)
    return laid_out


def dashboard(uid: str, title: str, description: str, panels: list[Panel | Row]) -> Json:
    """A whole dashboard as Grafana's file provisioning reads it (tagged and linked as pdserve)."""
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["pdserve"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 38,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "links": [{"title": "pdserve", "type": "dashboards", "tags": ["pdserve"], "asDropdown": True}],
        "panels": _layout(panels),
    }
