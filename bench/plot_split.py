"""Plot the SM split over time of one run from ``bench/policy_real.py``'s timeline.csv: the real GPU run above,
its simulation below (each launch a horizontal segment at its SM count, prefill and decode lanes).

    python3 bench/plot_split.py TIMELINE.csv --trace sharegpt --rate 10 --policy bullet --out split.png [--until 8]
    python3 bench/plot_split.py TIMELINE.csv --trace azure-code --rate 3 --since 28.9 --until 31 --out split.png
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--policy", default="bullet")
    ap.add_argument("--since", type=float, default=0.0, help="first second shown (bursty traces idle for long)")
    ap.add_argument("--until", type=float, default=None, help="last second shown (default: the whole run)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in csv.DictReader(args.timeline.open())
            if r["trace"] == args.trace and float(r["rate"]) == args.rate and r["policy"] == args.policy]
    if not rows:
        raise SystemExit(f"{args.timeline}: no rows for {args.trace} at {args.rate:g} req/s with {args.policy}")
    fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    for ax, source in zip(axes, ("real", "sim")):
        for lane, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
            xs, ys = [], []
            for r in rows:
                if r["source"] == source and r["lane"] == lane:
                    xs += [float(r["start_s"]), float(r["end_s"]), None]
                    ys += [int(r["sms"]), int(r["sms"]), None]
            ax.plot(xs, ys, color=color, lw=1.2, label=f"{lane} lane")
        ax.set_ylabel("SMs")
        ax.set_ylim(0, 140)
        ax.set_title(f"{'H200' if source == 'real' else 'simulated'}: {args.policy}, {args.trace} at {args.rate:g} req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[1].set_xlabel("time since the first arrival (s)")
    if args.until or args.since:
        axes[1].set_xlim(args.since, args.until)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
