"""Plots of a run (matplotlib, imported only here): latency distributions and what each lane did over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .metrics import Timeline, write_via_temp


def _save(fig, path: Path) -> None:
    write_via_temp(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def _segments(starts: np.ndarray, ends: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x, y of one horizontal segment per launch, NaN-separated: a gap between launches is drawn as nothing."""
    x = np.column_stack([starts, ends, np.full(starts.size, np.nan)]).ravel()
    y = np.column_stack([values, values, np.full(starts.size, np.nan)]).ravel()
    return x, y


def plot_run(cols: dict[str, np.ndarray], timeline: Timeline, summary: dict, out: Path) -> list[Path]:
    """Write ``latency.png`` (CDFs of TTFT, TPOT and E2E with the SLOs) and ``timeline.png`` (per lane, each
    launch's tokens over its span, idle gaps left empty; requests waiting and running; KV cache used; for
    split lanes, each launch's SM count: the split over time) into ``out``; returns the paths."""
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
    split = lanes != ["all"]  # split lanes: a panel of each launch's SM count (the split over time)
    fig, axes = plt.subplots(3 + split, 1, figsize=(13, 7.5 + 2.2 * split), sharex=True)
    busy = summary.get("lane_busy_frac", {})
    for lane in lanes:
        rows = [r for r in timeline.rows if r[0] == lane]
        starts = np.fromiter((r[6] for r in rows), float, len(rows))
        ends = np.fromiter((r[7][-1] for r in rows), float, len(rows))
        tokens = np.fromiter((r[4] for r in rows), float, len(rows))
        sms = sorted({r[1] for r in rows})
        sm_text = f"{sms[0]} SMs" if len(sms) == 1 else f"{sms[0]}-{sms[-1]} SMs"
        label = f"{lane} ({sm_text}, busy {100 * busy.get(lane, float('nan')):.0f} %)"
        axes[0].plot(*_segments(starts, ends, tokens), label=label, linewidth=1.2)
        if split:
            sm = np.fromiter((r[1] for r in rows), float, len(rows))
            axes[3].plot(*_segments(starts, ends, sm), label=lane, linewidth=1.2)
    axes[0].set_ylabel("tokens in the launch's\nfirst step (gaps: idle)")
    axes[0].set_yscale("log")
    probed = [r for r in timeline.rows if r[9] is not None]
    if probed:
        probed.sort(key=lambda r: r[7][-1])
        t = np.fromiter((r[7][-1] for r in probed), float, len(probed))
        for index, name in ((9, "waiting"), (10, "running")):
            axes[1].step(t, [r[index] for r in probed], where="post", label=name, linewidth=0.8)
        kv = np.fromiter((r[11] for r in probed), float, len(probed))
        axes[2].step(t, 100 * kv / (timeline.kv_blocks or 1), where="post", linewidth=0.8, color="tab:purple")
    axes[1].set_ylabel("requests\n(at launch ends)")
    axes[2].set_ylabel("KV cache used (%)")
    axes[2].set_ylim(0, 105)
    axes[-1].set_xlabel("time (s)")
    if split:
        axes[3].set_ylabel("SMs of each launch")
        axes[3].set_ylim(0, max(r[1] for r in timeline.rows) * 1.05)
        axes[3].legend(loc="upper right")
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        ax.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "timeline.png")
    _save(fig, paths[1])
    plt.close(fig)
    return paths
