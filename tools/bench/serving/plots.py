"""PNG figures of serving benchmarks (matplotlib, Agg: no display needed).

`run_figure`: one run: CDFs of TTFT and ITL per request class, and the ITL timeline (every gap at
the time its token arrived, long-prompt arrivals marked) where prefill interruption shows as spikes.
`sweep_figure`: `bench pd-vs-colocated`: goodput, mean and p99 ITL and TTFT against request rate,
one line per deployment.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: Sequence[float], label: str, color: str) -> None:
    if not values:
        return
    ordered = np.sort(np.asarray(values))
    ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label, color=color)


def run_figure(requests: Sequence[dict], path: Path, title: str) -> Path:
    """Write the figure of one run; `requests` is report.requests_detail's list."""
    plt = _pyplot()
    classes = sorted({r["class"] for r in requests if r["ok"]})
    fig, (ax_ttft, ax_itl, ax_time) = plt.subplots(1, 3, figsize=(16, 4.5))
    for color, name in zip(_COLORS * 4, classes, strict=False):
        ok = [r for r in requests if r["ok"] and r["class"] == name]
        _cdf(ax_ttft, [r["ttft_ms"] for r in ok], name, color)
        _cdf(ax_itl, [gap for r in ok for gap in r["itl_ms"]], name, color)
        times, gaps = [], []
        for r in ok:
            offset = r["start_s"] + r["ttft_ms"] / 1e3
            for gap in r["itl_ms"]:
                offset += gap / 1e3
                times.append(offset)
                gaps.append(gap)
        ax_time.scatter(times, gaps, s=3, color=color, label=name, alpha=0.6)
    if len(classes) > 1:  # mark when the requests of the rarer classes arrived
        counts = {name: sum(1 for r in requests if r["class"] == name) for name in classes}
        rare = min(counts, key=counts.get)
        for r in requests:
            if r["class"] == rare:
                ax_time.axvline(r["start_s"], color="grey", linewidth=0.6, linestyle=":")
    ax_ttft.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax_itl.set(xlabel="inter-token latency (ms)", ylabel="fraction of gaps", title="ITL CDF", xscale="log")
    ax_time.set(xlabel="time since start (s)", ylabel="ITL (ms)",
                title="ITL timeline (dotted: arrivals of the rarest class)", yscale="log")
    return _save(plt, fig, (ax_ttft, ax_itl, ax_time) if classes else (), path, title)


_SWEEP_PANELS = (("goodput", "goodput (req/s)"), ("mean_itl_ms", "mean ITL (ms)"),
                 ("p99_itl_ms", "p99 ITL (ms)"), ("mean_ttft_ms", "mean TTFT (ms)"),
                 ("p99_ttft_ms", "p99 TTFT (ms)"))


def sweep_figure(rows: Sequence[dict], path: Path, title: str) -> Path:
    """`rows`: one per (deployment, rate) with `deployment`, `rate` and the summary keys above."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(_SWEEP_PANELS), figsize=(4 * len(_SWEEP_PANELS), 4))
    deployments = list(dict.fromkeys(r["deployment"] for r in rows))
    for color, name in zip(_COLORS, deployments, strict=False):
        mine = sorted((r for r in rows if r["deployment"] == name), key=lambda r: r["rate"])
        for ax, (key, _) in zip(axes, _SWEEP_PANELS, strict=True):
            ax.plot([r["rate"] for r in mine], [r.get(key, 0.0) for r in mine], marker="o", label=name,
                    color=color)
    for ax, (_, label) in zip(axes, _SWEEP_PANELS, strict=True):
        ax.set(xlabel="short-request rate (req/s)", ylabel=label)
    return _save(plt, fig, axes, path, title)


def _save(plt, fig, legend_axes, path: Path, title: str) -> Path:
    """Grid and legend on `legend_axes`, the title, then write the PNG and free the figure."""
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
    for ax in legend_axes:
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
