"""Per-request latencies, SLO attainment, goodput and summaries, with ``vllm bench serve``'s definitions:

- TTFT: first token time - arrival; E2E: last token time - arrival;
- TPOT of a request: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL: every gap between consecutive output tokens of a request, pooled over requests;
- a request attains when TTFT <= its TTFT target (absolute, or per prompt token as in the Bullet paper)
  and TPOT <= the TPOT target; goodput = attaining requests per second of the run;
- a request rejected unserved (too long) has no latencies; it counts against attainment.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Sequence
from itertools import chain, pairwise
from pathlib import Path

import numpy as np

from .batch import StepResult
from .config import SloConfig
from .request import Request

PERCENTILES = (50, 90, 99)


def request_columns(reqs: Sequence[Request], slo: SloConfig) -> dict[str, np.ndarray]:
    """One array per column, one row per served request (ordered by id; rejected ones are left out). Times
    in seconds."""
    reqs = sorted((r for r in reqs if r.error is None), key=lambda r: r.id)
    n = len(reqs)
    arrival = np.fromiter((r.arrival for r in reqs), float, n)
    first = np.fromiter((r.first_token_time for r in reqs), float, n)
    finish = np.fromiter((r.finish_time for r in reqs), float, n)
    prompt = np.fromiter((r.prompt_len for r in reqs), np.int64, n)
    out = np.fromiter((r.num_output for r in reqs), np.int64, n)
    ttft, e2e = first - arrival, finish - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), np.nan)
    if slo.ttft_per_token is not None:
        ttft_target = prompt * slo.ttft_per_token
    else:
        ttft_target = np.full(n, np.inf if slo.ttft is None else slo.ttft)
    tpot_target = np.inf if slo.tpot is None else slo.tpot
    attained = (ttft <= ttft_target) & ((out <= 1) | (tpot <= tpot_target))
    return {
        "id": np.fromiter((r.id for r in reqs), np.int64, n),
        "arrival": arrival, "prompt_tokens": prompt, "output_tokens": out,
        "first_token": first, "finish": finish, "ttft": ttft, "tpot": tpot, "e2e": e2e,
        "ttft_target": ttft_target, "attained": attained,
        "preemptions": np.fromiter((r.num_preemptions for r in reqs), np.int64, n),
        "cached_tokens": np.fromiter((r.num_cached_tokens for r in reqs), np.int64, n),
    }


def inter_token_latencies(reqs: Sequence[Request]) -> np.ndarray:
    """All gaps between consecutive output tokens of each request, pooled."""
    lens = np.fromiter((len(r.token_times) for r in reqs), np.int64, len(reqs))
    times = np.fromiter(chain.from_iterable(r.token_times for r in reqs), float, int(lens.sum()))
    gaps = np.diff(times)
    keep = np.ones(gaps.size, bool)
    keep[np.cumsum(lens)[:-1] - 1] = False  # the step from one request's last token to the next's first
    return gaps[keep]


def _stats(x: np.ndarray) -> dict[str, float]:
    x = x[~np.isnan(x)]
    if not x.size:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    ps = np.percentile(x, PERCENTILES)
    return {"mean": float(x.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, ps)}}


def summarize(reqs: Sequence[Request], slo: SloConfig, lane_busy: dict[str, float] | None = None,
              cols: dict[str, np.ndarray] | None = None) -> dict:
    """The run's summary; latencies in milliseconds, throughputs per second of the run (first arrival to
    last completion), busy time per lane in seconds and as a fraction of the run."""
    cols = cols if cols is not None else request_columns(reqs, slo)
    n = len(cols["id"])
    rejected = [r for r in reqs if r.error is not None]
    if n == 0:
        why = f" ({len(rejected)} rejected: {rejected[0].error})" if rejected else ""
        raise ValueError(f"no finished requests to summarise{why}")
    duration = float(cols["finish"].max() - cols["arrival"].min())
    duration = duration if duration > 0 else float("nan")
    out_tokens = int(cols["output_tokens"].sum())
    in_tokens = int(cols["prompt_tokens"].sum())
    good = int(cols["attained"].sum())
    summary = {
        "requests": n,
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": n / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "slo": {"ttft_ms": None if slo.ttft is None else slo.ttft * 1e3,
                "ttft_per_token_ms": None if slo.ttft_per_token is None else slo.ttft_per_token * 1e3,
                "tpot_ms": None if slo.tpot is None else slo.tpot * 1e3},
        "rejected": len(rejected),
        "rejected_example": rejected[0].error if rejected else None,
        "slo_attainment": good / (n + len(rejected)),  # a rejected request met no SLO
        "goodput": good / duration,
        "preemptions": int(cols["preemptions"].sum()),
        "cached_prompt_tokens": int(cols["cached_tokens"].sum()),
    }
    for name in ("ttft", "tpot", "e2e"):
        summary[f"{name}_ms"] = {k: v * 1e3 for k, v in _stats(cols[name]).items()}
    summary["itl_ms"] = {k: v * 1e3 for k, v in _stats(inter_token_latencies(reqs)).items()}
    if lane_busy is not None:
        summary["lane_busy_s"] = dict(lane_busy)
        summary["lane_busy_frac"] = {k: v / duration for k, v in lane_busy.items()}
    return summary


class Timeline:
    """Every launch as it came back: lane, SMs, layers, tokens and sequences per step, step end times, and
    the prompt tokens its newly admitted requests found in the prefix cache. ``on_step`` plugs into
    ``serve(on_step=...)``."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.busy: dict[str, float] = {}

    def on_step(self, res: StepResult) -> None:
        b = res.batch
        lane = b.partition.lane
        self.busy[lane] = self.busy.get(lane, 0.0) + (res.end - res.start)
        self.rows.append((lane, b.partition.num_sms, b.layers.start, b.layers.stop, b.num_tokens,
                          len(b.chunks), res.start, res.step_ends, b.cached_tokens))

    def write_csv(self, path: Path) -> None:
        """One row per step (a fused launch of k steps gives k rows)."""
        header = ["lane", "sms", "layer_start", "layer_stop", "tokens", "seqs", "start", "end", "cached_tokens"]
        with atomic_write(path) as f:
            w = csv.writer(f)
            w.writerow(header)
            for lane, sms, l0, l1, tokens, seqs, start, ends, cached in self.rows:
                w.writerow((lane, sms, l0, l1, tokens, seqs, f"{start:.6f}", f"{ends[0]:.6f}", cached))
                # a fused launch's later steps decode one token of every sequence
                w.writerows((lane, sms, l0, l1, seqs, seqs, f"{s:.6f}", f"{e:.6f}", 0)
                            for s, e in pairwise(ends))


class atomic_write:
    """Write a text file through a temporary file in the same folder, renamed into place on success."""

    def __init__(self, path: Path | str, mode: str = "w") -> None:
        self.path = Path(path)
        self.mode = mode

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        self.file = os.fdopen(fd, self.mode, newline="" if "b" not in self.mode else None)
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        self.file.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)


def write_requests(cols: dict[str, np.ndarray], path: Path) -> None:
    """Per-request table as CSV, or Parquet when ``path`` ends in .parquet (needs pandas + pyarrow)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pandas as pd

        tmp = path.with_name(f".{path.name}.tmp")
        pd.DataFrame(cols).to_parquet(tmp, index=False)
        os.replace(tmp, path)
        return
    names = list(cols)
    with atomic_write(path) as f:
        w = csv.writer(f)
        w.writerow(names)
        fmt = [(lambda v: f"{v:.6f}") if cols[k].dtype.kind == "f" else str for k in names]
        for row in zip(*(cols[k] for k in names)):
            w.writerow([f(v) for f, v in zip(fmt, row)])


def write_json(obj: dict, path: Path) -> None:
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
