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
import heapq
import json
import math
import os
import secrets
from array import array
from collections.abc import Callable, Iterator, Sequence
from itertools import chain, pairwise
from operator import attrgetter, itemgetter
from pathlib import Path

import numpy as np

from .batch import StepResult, chunk_tokens
from .config import SloConfig
from .request import Request

PERCENTILES: tuple[float, ...] = (50, 90, 99)  # the summary's default (``--metric-percentiles``)


def request_columns(reqs: Sequence[Request], slo: SloConfig) -> dict[str, np.ndarray]:
    """One array per column, one row per served request (ordered by id; rejected ones are left out). Times
    in seconds."""
    reqs = sorted((r for r in reqs if r.error is None), key=attrgetter("id"))
    n = len(reqs)

    def col(name: str, dtype) -> np.ndarray:
        return np.fromiter(map(attrgetter(name), reqs), dtype, n)

    arrival, first, finish = col("arrival", float), col("first_token_time", float), col("finish_time", float)
    prompt, out = col("prompt_len", np.int64), col("num_output", np.int64)
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
        "id": col("id", np.int64),
        "arrival": arrival, "prompt_tokens": prompt, "output_tokens": out,
        "first_token": first, "finish": finish, "ttft": ttft, "tpot": tpot, "e2e": e2e,
        "ttft_target": ttft_target, "attained": attained,
        "preemptions": col("num_preemptions", np.int64),
        "cached_tokens": col("num_cached_tokens", np.int64),
    }


def inter_token_latencies(reqs: Sequence[Request]) -> np.ndarray:
    """All gaps between consecutive output tokens of each request, pooled (requests without tokens, such as
    rejected ones, add none)."""
    reqs = [r for r in reqs if r.token_times]
    lens = np.fromiter((len(r.token_times) for r in reqs), np.int64, len(reqs))
    times = np.fromiter(chain.from_iterable(r.token_times for r in reqs), float, int(lens.sum()))
    gaps = np.diff(times)
    keep = np.ones(gaps.size, bool)
    keep[np.cumsum(lens)[:-1] - 1] = False  # the step from one request's last token to the next's first
    return gaps[keep]


PACK = 4096  # TokenGaps: launches whose step ends are packed into one array


class TokenGaps:
    """The pooled inter-token latencies of a run kept without per-token lists: each distinct gap of a launch
    once, with how many requests had it. A fused launch's steps end at the same times for every request in
    it, so its gaps between steps are stored once per launch (with the count of its requests), and the gaps
    from each request's previous token to the launch's first step once per distinct previous-token time.
    Memory grows with launches and steps, not with output tokens; :meth:`stats` gives the same percentiles as
    :func:`inter_token_latencies` over the per-token lists (and the mean to rounding: a different order of
    summation)."""

    def __init__(self) -> None:
        self.values = array("d")  # single gaps
        self.counts = array("q")
        self.steps: list[np.ndarray] = []  # the launches' step ends, end to end, PACK launches an array
        self._recent: list[Sequence[float]] = []  # ... the launches' since (a short stretch's: a list)
        self.step_lens = array("q")  # each launch's steps
        self.step_counts = array("q")  # ... and the requests that had every step

    def add(self, gap: float, count: int) -> None:
        self.values.append(gap)
        self.counts.append(count)

    def add_steps(self, ends: Sequence[float], count: int) -> None:
        """The gaps between consecutive ``ends``, ``count`` times each."""
        # A short stretch's ends come as a list of floats: packed into an array PACK launches at a time, 8 bytes
        # a step (a list keeps 32; bullet's whole Azure conversation run peaked 9 MB higher), at one pass
        # (array("d", ends) per launch costs ~1 us, a tenth of a decode launch's simulation).
        # A long stretch's come as an array: kept as it is (after the lists before it, so the order holds), not
        # read element by element (~80 ns each, a numpy scalar apiece).
        self.step_lens.append(len(ends))
        self.step_counts.append(count)
        if type(ends) is not list:
            self._pack()
            self.steps.append(np.array(ends, float))  # (a copy: the array may be a view of a memoised one)
            return
        recent = self._recent
        recent.append(ends)
        if len(recent) >= PACK:
            self._pack()

    def _pack(self) -> None:
        if self._recent:
            self.steps.append(np.fromiter(chain.from_iterable(self._recent), float))
            self._recent.clear()

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(gaps, counts)."""
        lens = np.frombuffer(self.step_lens, np.int64)
        self._pack()
        ends = np.concatenate(self.steps, dtype=float, casting="safe") if self.steps else np.zeros(0)
        keep = np.ones(max(ends.size - 1, 0), bool)
        keep[np.cumsum(lens)[:-1] - 1] = False  # from one launch's last step to the next launch's first
        counts = np.repeat(np.frombuffer(self.step_counts, np.int64), lens - 1)
        return (np.concatenate((np.frombuffer(self.values, float), np.diff(ends)[keep])),
                np.concatenate((np.frombuffer(self.counts, np.int64), counts)))

    def stats(self, percentiles: Sequence[float] = PERCENTILES) -> dict[str, float]:
        """Mean and percentiles, as :func:`_stats` gives them over every gap one by one."""
        values, counts = self.arrays()
        return weighted_stats(values, counts, percentiles)


def weighted_stats(values: np.ndarray, counts: np.ndarray, percentiles: Sequence[float] = PERCENTILES
                   ) -> dict[str, float]:
    """:func:`_stats` of ``np.repeat(values, counts)`` without building it: numpy's default ('linear')
    percentile -- virtual index ``(n - 1) * q`` over the sorted values, interpolated between its two
    neighbours as ``numpy.lib``'s ``_lerp`` does -- so equal to the last bit (tests compare the two); the mean
    as ``sum(value * count) / n``."""
    keep = ~np.isnan(values) & (counts > 0)
    if not keep.all():
        values, counts = values[keep], counts[keep]
    n = int(counts.sum())
    if not n:
        return {"mean": float("nan"), **{percentile_key(p): float("nan") for p in percentiles}}
    # Without a sign bit set (inter-token gaps: none), floats order as their bit patterns do, equal ones tie
    # alike, and a stable sort of those integers is the same permutation at two thirds of the float sort's time
    # (a whole trace's ~560,000 gaps: 46 against 70 ms)
    bits = values.dtype == np.float64 and not np.signbit(values).any()
    order = np.argsort(values.view(np.int64) if bits else values, kind="stable")
    values, counts = values[order], counts[order]
    ends = np.cumsum(counts)  # values[i] fills sorted positions < ends[i]

    def at(i: int) -> float:
        return float(values[np.searchsorted(ends, i, side="right")])

    return {"mean": float(np.dot(values, counts) / n), **_percentiles(at, n, percentiles)}


def _percentiles(at: Callable[[int], float], n: int, percentiles: Sequence[float]) -> dict[str, float]:
    """numpy's default ('linear') percentiles of ``n`` sorted values, ``at(i)`` the i-th (n >= 1): the virtual
    index ``(n - 1) * q``, interpolated between its two neighbours as ``numpy.lib``'s ``_lerp`` does."""
    out = {}
    for p in percentiles:
        q = float(np.true_divide(p, 100))
        vi = (n - 1) * q
        lo = math.floor(vi)
        if vi >= n - 1:
            out[percentile_key(p)] = at(n - 1)
            continue
        lo = max(lo, 0)
        a, b, g = at(lo), at(lo + 1), vi - lo
        d = b - a
        out[percentile_key(p)] = b - d * (1 - g) if g >= 0.5 else a + d * g
    return out


def percentile_key(p: float) -> str:
    """The summary's key of a percentile: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{p:g}"


def _stats(x: np.ndarray, percentiles: Sequence[float] = PERCENTILES) -> dict[str, float]:
    x = x[~np.isnan(x)]
    if not x.size:
        return {"mean": float("nan"), **{percentile_key(p): float("nan") for p in percentiles}}
    # np.percentile's numbers (tests), without its call: its quantile path imports numpy.ma, ~10 ms of every
    # bullet simulate run
    s = np.sort(x)
    return {"mean": float(x.mean()), **_percentiles(lambda i: float(s[i]), s.size, percentiles)}


def summarize(reqs: Sequence[Request], slo: SloConfig, lane_busy: dict[str, float] | None = None,
              cols: dict[str, np.ndarray] | None = None, percentiles: Sequence[float] = PERCENTILES,
              gaps: TokenGaps | None = None) -> dict:
    """The run's summary; latencies in milliseconds (mean and ``percentiles``), throughputs per second of the
    run (first arrival to last completion), busy time per lane in seconds and as a fraction of the run.
    ``gaps``: the run's inter-token gaps where the requests kept no per-token times."""
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
        summary[f"{name}_ms"] = {k: v * 1e3 for k, v in _stats(cols[name], percentiles).items()}
    itl = gaps.stats(percentiles) if gaps is not None else _stats(inter_token_latencies(reqs), percentiles)
    summary["itl_ms"] = {k: v * 1e3 for k, v in itl.items()}
    if lane_busy is not None:
        summary["lane_busy_s"] = dict(lane_busy)
        summary["lane_busy_frac"] = {k: v / duration for k, v in lane_busy.items()}
    return summary


class Timeline:
    """Every launch as it came back: lane, SMs, layers, tokens and sequences per step, step end times, the
    prompt tokens its newly admitted requests found in the prefix cache, and -- when a ``probe`` is given --
    the server's state when the launch ended (before its results were applied): requests waiting, requests
    running, KV blocks held. ``on_step`` plugs into ``serve(on_step=...)``. With ``keep=False`` it only counts
    launches and busy time (what a summary needs; a sweep's runs keep no rows)."""

    def __init__(self, probe: Callable[[], tuple[int, int, int]] | None = None, kv_blocks: int | None = None,
                 keep: bool = True) -> None:
        self.rows: list[tuple] = []
        self.busy: dict[str, float] = {}
        self.launches = 0
        self.probe = probe
        self.kv_blocks = kv_blocks  # the pool's size, for the KV-used percentage
        self.keep = keep

    def on_step(self, res: StepResult) -> None:
        b = res.batch
        lane = b.partition.lane
        self.busy[lane] = self.busy.get(lane, 0.0) + (res.end - res.start)
        self.launches += 1
        if not self.keep:
            return
        state = self.probe() if self.probe is not None else (None, None, None)
        self.rows.append((lane, b.partition.num_sms, b.layers.start, b.layers.stop,
                          chunk_tokens(b.chunks),  # b.num_tokens, without the property
                          len(b.chunks), res.start, res.step_ends, b.cached_tokens, *state))

    HEADER = ("lane", "state", "sms", "layer_start", "layer_stop", "tokens", "seqs", "cached_tokens", "start_s",
              "end_s", "waiting_reqs", "running_reqs", "kv_used_blocks", "kv_used_pct")

    def csv_rows(self) -> Iterator[tuple]:
        """One row per step (a fused launch of k steps gives k rows, with the state sampled at its end) and
        one ``idle`` row per gap between a lane's launches (and before its first), ordered by start time."""
        return heapq.merge(*(self._lane_rows(lane) for lane in sorted(self.busy)), key=lambda row: row[8])

    def _lane_rows(self, lane: str) -> Iterator[tuple]:
        free_since = 0.0
        pct = (lambda used: f"{100 * used / self.kv_blocks:.2f}") if self.kv_blocks else (lambda used: "")
        for row in self.rows:
            if row[0] != lane:
                continue
            _, sms, l0, l1, tokens, seqs, start, ends, cached, waiting, running, kv = row
            if start > free_since:
                yield (lane, "idle", 0, "", "", 0, 0, 0, free_since, start, "", "", "", "")
            state = ("" if waiting is None else waiting, "" if running is None else running,
                     "" if kv is None else kv, "" if kv is None else pct(kv))
            yield (lane, "run", sms, l0, l1, tokens, seqs, cached, start, ends[0], *state)
            # a fused launch's later steps decode one token of every sequence
            for s, e in pairwise(ends):
                yield (lane, "run", sms, l0, l1, seqs, seqs, 0, s, e, *state)
            free_since = ends[-1]

    def write_csv(self, path: Path) -> None:
        """``timeline.csv``: :meth:`csv_rows` with times in seconds, as ``csv.writer`` writes them (no field needs
        quoting: numbers and plain words), each line formatted here: a launch's fused steps share all but their two
        times. 601,260 rows of bullet on the Azure conversation trace took 1.75 s through ``csv.writer`` (more than
        half the simulation's 2.7 s) and take about a third of it so."""
        with atomic_write(path) as f:
            f.write(",".join(self.HEADER) + "\r\n")
            lanes = [self._lane_lines(lane) for lane in sorted(self.busy)]
            lines = heapq.merge(*lanes, key=itemgetter(0)) if len(lanes) > 1 else (lanes[0] if lanes else ())
            f.writelines(map(itemgetter(1), lines))

    def _lane_lines(self, lane: str) -> Iterator[tuple[float, str]]:
        """:meth:`_lane_rows` as (start, CSV line) pairs."""
        free_since = 0.0
        kv_blocks = self.kv_blocks
        for row in self.rows:
            if row[0] != lane:
                continue
            _, sms, l0, l1, tokens, seqs, start, ends, cached, waiting, running, kv = row
            if start > free_since:
                yield free_since, f"{lane},idle,0,,,0,0,0,{free_since:.6f},{start:.6f},,,,\r\n"
            state = ("" if waiting is None else waiting, "" if running is None else running,
                     "" if kv is None else kv,
                     "" if kv is None or not kv_blocks else f"{100 * kv / kv_blocks:.2f}")
            tail = f",{state[0]},{state[1]},{state[2]},{state[3]}\r\n"
            yield start, f"{lane},run,{sms},{l0},{l1},{tokens},{seqs},{cached},{start:.6f},{ends[0]:.6f}{tail}"
            if len(ends) > 1:  # a fused launch's later steps decode one token of every sequence
                head = f"{lane},run,{sms},{l0},{l1},{seqs},{seqs},0,"
                for s, e in pairwise(ends):
                    yield s, f"{head}{s:.6f},{e:.6f}{tail}"
            free_since = ends[-1]


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


class atomic_write:
    """Write a text file through a temporary file in the same folder, renamed into place on success. The file
    gets the permissions of any file the user creates (0666 less the umask), not mkstemp's 0600."""

    def __init__(self, path: Path | str, mode: str = "w") -> None:
        self.path = Path(path)
        self.mode = mode

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _temp_name(self.path)
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self.file = os.fdopen(fd, self.mode, newline="" if "b" not in self.mode else None)
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.file.close()
        finally:
            if exc_type is None:
                os.replace(self.tmp, self.path)
            else:
                os.unlink(self.tmp)


def write_via_temp(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` a file that a library writes by name (Parquet, PNG), then rename it to ``path``; the
    temporary file is removed if writing fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# Exported per-request columns: (name in request_columns, name in the file, factor): times since the first
# arrival in seconds, latencies in milliseconds, lengths in tokens.
EXPORT_COLUMNS: tuple[tuple[str, str, float], ...] = (
    ("id", "id", 1), ("arrival", "arrival_s", 1), ("prompt_tokens", "prompt_tokens", 1),
    ("output_tokens", "output_tokens", 1), ("cached_tokens", "cached_tokens", 1),
    ("first_token", "first_token_s", 1), ("finish", "finish_s", 1), ("ttft", "ttft_ms", 1e3),
    ("tpot", "tpot_ms", 1e3), ("e2e", "e2e_ms", 1e3), ("ttft_target", "ttft_slo_ms", 1e3),
    ("attained", "attained", 1), ("preemptions", "preemptions", 1),
)


def export_columns(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-request table as written: units in the column names (see ``EXPORT_COLUMNS``)."""
    return {out: (cols[name] * factor if factor != 1 else cols[name]) for name, out, factor in EXPORT_COLUMNS}


def write_requests(cols: dict[str, np.ndarray], path: Path) -> None:
    """Per-request table (:func:`export_columns`) as CSV, or Parquet when ``path`` ends in .parquet (needs
    pandas + pyarrow)."""
    path = Path(path)
    table = export_columns(cols)
    if path.suffix == ".parquet":
        import pandas as pd

        write_via_temp(path, lambda tmp: pd.DataFrame(table).to_parquet(tmp, index=False))
        return
    names = list(table)
    with atomic_write(path) as f:
        w = csv.writer(f)
        w.writerow(names)
        fmt = [(lambda v: f"{v:.6f}") if table[k].dtype.kind == "f" else str for k in names]
        for row in zip(*(table[k] for k in names)):
            w.writerow([f(v) for f, v in zip(fmt, row)])


def json_safe(obj):
    """``obj`` with every NaN or infinite float replaced by None: JSON has no such numbers (``json.dump``
    would write ``NaN``, which JSON readers refuse)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        return json_safe(obj.item())
    return obj


def write_json(obj: dict, path: Path) -> None:
    with atomic_write(path) as f:
        json.dump(json_safe(obj), f, indent=2, allow_nan=False)
        f.write("\n")
