"""Generate the bundled traces in ``traces/`` from distributions fitted to the public traces.

    python tools/make_traces.py --raw-dir DIR [--out-dir traces] [--num-requests 3000]

DIR holds the public trace files (names, repositories and licences in traces/README.md, "Public sources").

No row of a public file is copied. For each public file we keep only a summary -- quantiles of the output
lengths, and quantiles of the prompt lengths within each of 20 equal-count bins of output length -- and draw
new (prompt, output) pairs from the piecewise-linear quantile functions. Pairs over a trace's token cap are
redrawn. Arrivals are Poisson at a stated rate, except ``azure-code``, whose arrivals
follow an on/off process fitted to the public code trace (idle stretches, then bursts).
Everything is seeded: running the script again gives byte-identical files.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bullet.request import Request
from bullet.traces import arrivals, read_table, save_trace, trace_stats

# Probabilities at which the length quantile functions are kept (denser in the tails).
QUANTILE_PROBS = np.unique(np.concatenate([
    np.linspace(0.0, 0.01, 3), np.linspace(0.01, 0.99, 99), np.linspace(0.99, 1.0, 6)]))


@dataclass(frozen=True)
class Spec:
    name: str  # output file traces/<name>.csv
    source: str  # public file the lengths are fitted to
    rate: float  # mean arrival rate of the bundled file (req/s); load_trace(rate=...) rescales it
    max_total: int | None  # cap on prompt + output tokens
    seed: int
    bursty: bool = False  # on/off arrivals fitted to the source's own timestamps


SPECS = (
    Spec("sharegpt", "sharegpt_8k_filtered_stats_llama2_tokenizer.csv", 8.0, 8192, 1),
    Spec("azure-conv", "AzureLLMInferenceTrace_conv.csv", 15.0, None, 2),
    Spec("azure-code", "AzureLLMInferenceTrace_code.csv", 10.0, None, 3, bursty=True),
    Spec("arxiv", "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", 8.0, 4096, 4),
)


@dataclass(frozen=True)
class LengthModel:
    """Output lengths from their quantile function; prompt lengths from a quantile function conditional on
    the output's bin (``BINS`` equal-count bins of output rank), which keeps the dependence between the two
    (in arXiv, for instance, the longest summaries come with short papers)."""

    output_q: np.ndarray  # (len(QUANTILE_PROBS),)
    prompt_q: np.ndarray  # (BINS, len(QUANTILE_PROBS)): prompt quantiles within each output bin

    BINS = 20

    @classmethod
    def fit(cls, prompts: np.ndarray, outputs: np.ndarray) -> LengthModel:
        bins = np.array_split(np.argsort(outputs, kind="stable"), cls.BINS)
        return cls(np.quantile(outputs, QUANTILE_PROBS),
                   np.stack([np.quantile(prompts[idx], QUANTILE_PROBS) for idx in bins]))

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        k = rng.integers(0, self.BINS, size=n)
        u_out = (k + rng.random(n)) / self.BINS
        u_in = rng.random(n)
        outputs = np.interp(u_out, QUANTILE_PROBS, self.output_q)
        prompts = np.array([np.interp(u, QUANTILE_PROBS, self.prompt_q[b]) for u, b in zip(u_in, k)])
        return (np.maximum(np.rint(prompts), 1).astype(np.int64),
                np.maximum(np.rint(outputs), 1).astype(np.int64))

    def draw_capped(self, n: int, rng: np.random.Generator, max_total: int | None):
        prompts, outputs = self.draw(n, rng)
        for _ in range(1000):
            bad = np.flatnonzero(prompts + outputs > max_total) if max_total else np.array([], int)
            if len(bad) == 0:
                return prompts, outputs
            prompts[bad], outputs[bad] = self.draw(len(bad), rng)
        raise RuntimeError(f"could not draw lengths under the cap {max_total}")


@dataclass(frozen=True)
class OnOffModel:
    """Bursts separated by idle stretches, in units where the mean rate is 1 request per second.

    A gap longer than ``IDLE_GAPS`` mean gaps is an idle stretch; the rest is busy time, in which arrivals are
    a gamma renewal process with the busy gaps' CV. Busy and idle stretch lengths are exponential."""

    busy_fraction: float  # share of the span that is busy
    busy_len: float  # mean busy stretch, in mean gaps
    idle_len: float  # mean idle stretch, in mean gaps
    busy_cv: float  # CV of gaps inside busy stretches

    IDLE_GAPS = 25.0

    @classmethod
    def fit(cls, times: np.ndarray) -> OnOffModel:
        gaps = np.diff(np.sort(times))
        mean_gap = gaps.mean()
        idle = gaps > cls.IDLE_GAPS * mean_gap
        span = gaps.sum()
        busy_time = span - gaps[idle].sum()
        stretches = int(idle.sum())
        return cls(busy_fraction=busy_time / span, busy_len=busy_time / stretches / mean_gap,
                   idle_len=gaps[idle].sum() / stretches / mean_gap,
                   busy_cv=float(gaps[~idle].std() / gaps[~idle].mean()))

    def arrivals(self, n: int, rate: float, seed: int) -> np.ndarray:
        rng = np.random.default_rng([seed, 2])
        # Busy-time arrivals: rate 1 / busy_fraction inside busy time keeps the overall mean rate at 1.
        busy = arrivals(n, 1.0 / self.busy_fraction, "gamma", self.busy_cv, seed)
        t = np.empty(n)
        busy_end, shift, i = 0.0, 0.0, 0
        while i < n:
            busy_end += rng.exponential(self.busy_len)
            j = int(np.searchsorted(busy, busy_end, side="left"))
            t[i:j] = busy[i:j] + shift
            i = j
            shift += rng.exponential(self.idle_len)
        t -= t[0]
        return t * ((n - 1) / t[-1] / rate)  # exact mean rate (n - 1) / span


def make(spec: Spec, raw_dir: Path, out_dir: Path, n: int) -> list[Request]:
    table = read_table(raw_dir / spec.source)
    rng = np.random.default_rng([spec.seed, 1])  # a stream apart from the arrivals' one
    prompts, outputs = LengthModel.fit(table.prompt_lens, table.output_lens).draw_capped(n, rng, spec.max_total)
    if spec.bursty:
        assert table.arrivals is not None
        times = OnOffModel.fit(table.arrivals).arrivals(n, spec.rate, spec.seed)
    else:
        times = arrivals(n, spec.rate, "poisson", seed=spec.seed)
    requests = [Request(i, t, p, o) for i, (t, p, o) in
                enumerate(zip(times.tolist(), prompts.tolist(), outputs.tolist()))]
    save_trace(requests, out_dir / f"{spec.name}.csv")
    return requests


def _row(name: str, s: dict) -> str:
    fmt = (lambda v, d: "-" if v is None else f"{v:,.{d}f}")
    return (f"| {name} | {s['count']:,} | {fmt(s['span_s'], 0)} | {fmt(s['rate'], 2)} | "
            f"{fmt(s['interarrival_cv'], 2)} | {s['input_mean']:.0f} / {s['input_p50']:.0f} / "
            f"{s['input_p99']:.0f} / {s['input_max']} | {s['output_mean']:.0f} / {s['output_p50']:.0f} / "
            f"{s['output_p99']:.0f} / {s['output_max']} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw-dir", type=Path, required=True,
                        help="folder with the public trace files (see traces/README.md, 'Public sources')")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "traces", help="where to write (default: traces/)")
    parser.add_argument("--num-requests", type=int, default=3000, help="requests per trace (default: 3000)")
    args = parser.parse_args(argv)
    print("| trace | requests | span s | rate req/s | inter-arrival CV | input mean / p50 / p99 / max "
          "| output mean / p50 / p99 / max |")
    print("|---|---:|---:|---:|---:|---|---|")
    for spec in SPECS:
        source = trace_stats(read_table(args.raw_dir / spec.source))
        made = trace_stats(make(spec, args.raw_dir, args.out_dir, args.num_requests))
        print(_row(f"{spec.name}.csv", made))
        print(_row(f"(source: {spec.source})", source))


if __name__ == "__main__":
    main()
