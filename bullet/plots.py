"""Plots of a run (matplotlib, imported only here): latency distributions and what each lane did over time."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .metrics import Timeline


def _save(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def plot_run(cols: dict[str, np.ndarray], timeline: Timeline, summary: dict, out: Path) -> list[Path]:
    """Write ``latency.png`` (CDFs of TTFT, TPOT and E2E with the SLOs) and ``timeline.png`` (tokens per
    step and running sequences per lane over time) into ``out``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    out.mkdir(parents=True, exist_ok=True)
    title = f"{summary['policy']} · {summary['model']} on {summary['gpu']} · {summary['requests']} requests"
    slo = summary["slo"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, name, target in zip(axes, ("ttft", "tpot", "e2e"),
                                (slo["ttft_ms"] if slo["ttft_per_token_ms"] is None else None,
                                 slo["tpot_ms"], None)):
        x = np.sort(cols[name][~np.isnan(cols[name])]) * 1e3
        ax.plot(x, np.arange(1, x.size + 1) / max(1, x.size))
        if target is not None:
            ax.axvline(target, color="tab:red", linestyle="--", label=f"SLO {target:g} ms")
            ax.legend(loc="lower right")
        if x.size and x[0] > 0 and x[-1] / x[0] > 30:  # a log axis only where the values span decades
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    paths = [out / "latency.png"]
    _save(fig, paths[0])
    plt.close(fig)

    lanes = sorted({row[0] for row in timeline.rows})
    fig, axes = plt.subplots(2, 1, figsize=(13, 5.5), sharex=True)
    for lane in lanes:
        rows = [r for r in timeline.rows if r[0] == lane]
        starts = np.fromiter((r[6] for r in rows), float, len(rows))
        tokens = np.fromiter((r[4] for r in rows), float, len(rows))
        seqs = np.fromiter((r[5] for r in rows), float, len(rows))
        sms = rows[0][1]
        axes[0].step(starts, tokens, where="post", label=f"{lane} ({sms} SMs)", linewidth=0.8)
        axes[1].step(starts, seqs, where="post", label=lane, linewidth=0.8)
    axes[0].set_ylabel("tokens in the launch's first step")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("sequences in the launch")
    axes[1].set_xlabel("time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "timeline.png")
    _save(fig, paths[1])
    plt.close(fig)
    return paths
