"""``bullet validate``: the same requests through a real executor and through the simulator, with the same
arrival times, the same policy code and the same latency model; the simulator's error per metric and per
launch kind.

The real run goes through ``serve()`` on the executor (a GpuExecutor, or anything implementing the protocol);
the simulated run through :func:`simulator.run.simulate`. Errors are ``(simulated - real) / real``. The gate
(``max_error``) applies to the mean and p90 of TTFT and TPOT, the points the latency model is judged on; every
other row is shown for information.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .batch import StepResult
from .config import CacheConfig, GpuSpec, ModelSpec, SchedulerConfig, SloConfig
from .engine import serve
from .kvcache import BlockManager
from .metrics import request_columns, summarize
from .perfmodel import LatencyModel, Work, work_of
from .perfmodel.base import CachedLatency, ScaledLatency, partly_co_run, step_times
from .policies import make_scheduler
from .request import Request

METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99")
GATED = {("ttft", "mean"), ("ttft", "p90"), ("tpot", "mean"), ("tpot", "p90")}


@dataclass
class Report:
    real: dict  # summaries (metrics.summarize)
    sim: dict
    rows: list[dict] = field(default_factory=list)  # metric, stat, real, sim, error, gated
    launches: list[dict] = field(default_factory=list)  # kind, launches, measured ms, error p10/p50/p90
    launch_rows: list[dict] = field(default_factory=list)  # each real launch: its work, measured and predicted
    real_cdf: dict = field(default_factory=dict)  # metric -> sorted values (ms)
    sim_cdf: dict = field(default_factory=dict)
    # the run simulated again at its own launch speed (:func:`launch_speed`): factors and error rows
    speed: tuple[float, float] = (1.0, 1.0)
    speed_rows: list[dict] = field(default_factory=list)

    def worst(self, rows: list[dict] | None = None) -> float:
        """The largest gated |error| (fraction) of ``rows`` (the simulation's: :attr:`rows`)."""
        rows = self.rows if rows is None else rows
        return max((abs(r["error"]) for r in rows if r["gated"] and np.isfinite(r["error"])), default=0.0)

    def to_json(self) -> dict:
        return {"real": self.real, "sim": self.sim, "errors": self.rows, "launches": self.launches,
                "stalls": stalls(self.launch_rows), "worst_gated_error": self.worst(),
                "at_launch_speed": {"prefill": self.speed[0], "decode": self.speed[1], "errors": self.speed_rows,
                                    "worst_gated_error": self.worst(self.speed_rows)}}


def error(real: float, sim: float) -> float:
    """(sim - real) / real; nan where real is 0 or either is not finite."""
    if not (np.isfinite(real) and np.isfinite(sim)) or real == 0:
        return float("nan")
    return (sim - real) / real


def compare(real: dict, sim: dict) -> list[dict]:
    """Error rows of two run summaries: latency stats, throughput, duration."""
    rows = []
    for m in METRICS:
        for s in STATS:
            a, b = real[f"{m}_ms"][s], sim[f"{m}_ms"][s]
            rows.append({"metric": f"{m.upper()} {s} (ms)", "real": a, "sim": b, "error": error(a, b),
                         "gated": (m, s) in GATED})
    for key, name in (("output_throughput", "output tokens/s"), ("duration_s", "duration (s)"),
                      ("slo_attainment", "SLO attainment")):
        rows.append({"metric": name, "real": real[key], "sim": sim[key], "error": error(real[key], sim[key]),
                     "gated": False})
    return rows


# launches.csv (``bullet validate --out``, ``bullet run --launch-log``): start (executor clock, s), lane/kind, the
# launch's SMs and work, its fused steps, the other lane's SMs and tokens where it overlapped, the overlapped
# fraction of the launch, measured and predicted ms
LAUNCH_COLUMNS = ("start_s", "kind", "sms", "layers", "tokens", "seqs", "attn_pairs", "kv_read", "max_kv", "samples",
                  "steps", "co_sms", "co_tokens", "overlap", "measured_ms", "predicted_ms")


HOST_GAP_KIND = "host gap"  # launch_errors' row of the engine's own time between launches
BACK_TO_BACK = 5e-3  # a lane relaunched within this after its launch ended was relaunched at once
# a launch that starts within this of the one before it was queued behind it (async scheduling): no host time
# between them. On the H200 the synchronous engine's gaps were never under 0.18 ms (44 lanes of 32 validate
# runs); in two async runs 250 launches started under 20 us after the one before, 3 more under 50 us, the rest
# over 0.1 ms
QUEUED = 5e-5


class Launch(NamedTuple):
    """What :func:`launch_errors` needs of one launch: its lane, SMs, layer range, fused steps, work, start
    and end (executor clock). 340-360 bytes a launch kept, where a kept StepResult holds its Batch's chunks and
    block ids alive: 6.5-10.7 KB (``python3 bench/launch_log_memory.py``)."""

    lane: str
    sms: int
    layers: range
    steps: int
    work: Work
    start: float
    end: float


def launch_of(res: StepResult, num_layers: int, work: Work | None = None) -> Launch:
    """``res`` as a :class:`Launch` (``work``: its batch's work if already computed)."""
    b = res.batch
    return Launch(b.lane, b.partition.num_sms, b.layers, b.steps, work or work_of(b, num_layers), res.start, res.end)


def launch_errors(launches: Sequence[Launch], latency: LatencyModel, num_layers: int,
                  rows: list[dict] | None = None, host_gap: tuple[float, float] | None = None) -> list[dict]:
    """Per launch kind (lane/kind, "beside" where the other lane overlapped most of it): the latency model's
    prediction for each real launch against its measured duration, per launch (percentiles) and summed (the
    busy time a queue sees). A launch the other lane overlapped for a fraction ``o`` of its time is predicted
    as the fitted model reads a co-run point: next to the other lane's launch that overlapped it most for that
    fraction and alone for the rest (:func:`~bullet.perfmodel.base.partly_co_run`), so a decode stretch that a
    prefill joined near its end is not taken for a whole co-run. ``launches`` in start order; ``rows``, if
    given, gets one dict per launch (``overlap`` = ``o``). A last row, :data:`HOST_GAP_KIND`, puts the
    latency model's ``host_gap`` (or ``host_gap`` given: ``a + b x requests``; none: 0) against each lane's measured gaps between
    back-to-back launches (under :data:`BACK_TO_BACK`: the engine relaunched at once, no waiting for work)."""
    kinds: dict[str, list[tuple[float, float]]] = {}
    for i, x in enumerate(launches):
        w = x.work
        co, co_sms, best, covered = None, 0, 0.0, 0.0
        for other in launches[max(0, i - 8):i + 8]:
            if other.lane == x.lane:
                continue
            overlap = min(x.end, other.end) - max(x.start, other.start)
            covered += max(0.0, overlap)  # (one lane's launches do not overlap each other)
            if overlap > best:
                co, co_sms, best = other.work, other.sms, overlap
        o = min(1.0, covered / max(x.end - x.start, 1e-12))
        pred = alone = _predicted(latency, x, num_layers, None, 0)
        if co is not None:
            pred = partly_co_run(alone, _predicted(latency, x, num_layers, co, co_sms), o)
        kind = "decode" if w.tokens == w.seqs else ("prefill" if w.tokens > 4 * w.seqs else "mixed")
        kind += " (sliced)" if x.layers.stop != num_layers or x.layers.start else ""
        side = " beside" if o > 0.5 else ""  # the other lane ran for most of it: contention's share
        kinds.setdefault(f"{x.lane}/{kind}{side}", []).append((x.end - x.start, pred))
        if rows is not None:
            rows.append(dict(zip(LAUNCH_COLUMNS, (
                x.start, f"{x.lane}/{kind}", x.sms, w.num_layers, w.tokens, w.seqs, w.attn_pairs, w.kv_read,
                w.max_kv, w.samples, x.steps, co_sms, co.tokens if co else 0, round(o, 4),
                (x.end - x.start) * 1e3, pred * 1e3), strict=True)))
    a, b = host_gap if host_gap is not None else (getattr(latency, "host_gap", None) or (0.0, 0.0))
    for g, seqs in back_to_back((x.lane, x.start, x.end, x.work.seqs) for x in launches):
        kinds.setdefault(HOST_GAP_KIND, []).append((g, a + b * seqs))
    out = []
    for kind, pairs in sorted(kinds.items(), key=lambda kv: (kv[0] == HOST_GAP_KIND, kv[0])):  # the gap last
        m = np.array([p[0] for p in pairs])
        pr = np.array([p[1] for p in pairs])
        e = 100 * (pr - m) / np.maximum(m, 1e-12)
        out.append({"kind": kind, "launches": len(pairs), "measured_ms_p50": float(np.median(m) * 1e3),
                    "error_pct_p10": float(np.percentile(e, 10)), "error_pct_p50": float(np.median(e)),
                    "error_pct_p90": float(np.percentile(e, 90)),
                    "error_pct_sum": float(100 * (pr.sum() / max(m.sum(), 1e-12) - 1))})
    return out


STALL_FACTOR, STALL_S = 2.0, 0.020  # a stall: this many times the run's typical measured / predicted, this much over


def stalls(launch_rows: Sequence[dict]) -> list[dict]:
    """Launches (rows of :data:`LAUNCH_COLUMNS`, with their index ``n`` in the run) that took over
    :data:`STALL_FACTOR` times what the run's median measured / predicted ratio makes of their prediction, and
    :data:`STALL_S` more: what no latency model predicts, such as a kernel compiled or an attention plan built
    in the middle of the run (one 2,048-token launch of 130 requests took 680 ms against 65 predicted on the
    H200: bench/RESULTS.md, fourteenth session). Relative to the run's own ratio, so a model of another
    device (the H200's on the CPU) does not make every launch one."""
    if not launch_rows:
        return []
    typical = float(np.median([r["measured_ms"] / max(r["predicted_ms"], 1e-9) for r in launch_rows]))
    return [{"n": i, "typical_ratio": typical, **r} for i, r in enumerate(launch_rows)
            if r["measured_ms"] > STALL_FACTOR * typical * r["predicted_ms"]
            and r["measured_ms"] - typical * r["predicted_ms"] > 1e3 * STALL_S]


def launch_speed(launch_rows: Sequence[dict]) -> tuple[float, float]:
    """The run's measured over predicted launch time, summed, for launches with prompt rows and for
    decode-only launches (1.0 where there are none): how much faster or slower this card ran the model's
    launches. :func:`validate` simulates the run again with its predictions scaled by these
    (:class:`~bullet.perfmodel.base.ScaledLatency`), which tells a card's speed from the rest of an error."""
    out = []
    for prompt in (True, False):
        rs = [r for r in launch_rows if (r["tokens"] > r["seqs"]) == prompt]
        pred = sum(r["predicted_ms"] for r in rs)
        out.append(sum(r["measured_ms"] for r in rs) / pred if rs and pred > 0 else 1.0)
    return out[0], out[1]


def at_speed_of(latency: LatencyModel, prefill: float, decode: float) -> LatencyModel:
    """``latency`` with its launch times scaled (:func:`launch_speed`'s factors): a fitted model's own
    :meth:`~bullet.perfmodel.fitted.FittedModel.scaled` (what ``--save-scaled`` writes), any other wrapped."""
    scaled = getattr(latency, "scaled", None)
    return scaled(prefill, decode) if scaled is not None else ScaledLatency(latency, prefill, decode)


def back_to_back(spans: Iterable[tuple[str, float, float, int]]) -> list[tuple[float, int]]:
    """Of launches given as (lane, start, end, requests): each lane's gap before a launch that was not waiting
    for work (the engine relaunched the lane as soon as its host work allowed: its own time between them), with
    that launch's requests; a launch queued behind the one before it (under :data:`QUEUED`) has no such time. A decode lane gets new work only from the other lane (a launch that completes
    prompts), so its gap counts unless a launch of another lane ended inside it; a lane fed by arrivals
    (``prefill``, ``all``) counts under :data:`BACK_TO_BACK`, arrivals not being in the log. On 28 H200 validate
    runs (bench/data/validate-h200-2026-12-01): chunked's lane, 4,814 gaps, 4,767 under 5 ms and none between
    5 and 50 ms; static-split's decode lane, 2,713 gaps with no prefill ending inside, all under 20 ms (151 of
    1.5-20 ms: the one host thread busy with the prefill lane), and 155 with one, 139 of them over 20 ms."""
    lanes: dict[str, list[tuple[float, float, int]]] = {}
    for lane, start, end, seqs in spans:
        lanes.setdefault(lane, []).append((start, end, seqs))
    out = []
    for lane, runs in lanes.items():
        runs.sort()
        others = sorted(end for other, rs in lanes.items() if other != lane for _, end, _ in rs)
        for (_, end, _), (start, _, seqs) in itertools.pairwise(runs):
            gap = start - end
            if gap < QUEUED:  # (queued behind it, or overlapping: clock skew)
                continue
            if lane == "decode":  # waiting for a prefill to hand over requests: another lane ended inside
                if bisect.bisect_right(others, start) == bisect.bisect_right(others, end):
                    out.append((gap, seqs))
            elif gap < BACK_TO_BACK:
                out.append((gap, seqs))
    return out


def fit_gap(gaps: Sequence[tuple[float, int]]) -> tuple[float, float]:
    """``a + b x requests`` (both >= 0) by least squares on (gap, requests) pairs: the mean gap at each batch
    size, as the simulator spends it (a run's gaps add up; a median would leave out the slow tail)."""
    if not gaps:
        raise ValueError("no gaps between back-to-back launches to fit")
    g = np.array([x[0] for x in gaps], float)
    n = np.array([x[1] for x in gaps], float)
    if len(set(n)) > 1:
        b, a = np.polyfit(n, g, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
        # the optimum is on an edge: a = 0 (through the origin) or b = 0 (the mean), whichever fits better
        b0 = max(0.0, float(n @ g / (n @ n)))
        if float(((g - b0 * n) ** 2).sum()) < float(((g - g.mean()) ** 2).sum()):
            return 0.0, b0
    return max(0.0, float(g.mean())), 0.0


def serving_gap(runs: Sequence[Sequence[dict]]) -> dict:
    """The engine's host time between a lane's launches in serving, from each run's launch rows
    (:data:`LAUNCH_COLUMNS`: ``bullet validate``'s launches.csv or :attr:`Report.launch_rows`): the gaps
    :func:`back_to_back` counts, pooled over the runs and fitted as :func:`fit_gap`; the model file's
    ``serving_gap`` entry (:func:`~bullet.perfmodel.fitted.host_gap_of` reads it)."""
    gaps = []
    for rows in runs:
        gaps += back_to_back((r["kind"].split("/")[0], float(r["start_s"]),
                              float(r["start_s"]) + float(r["measured_ms"]) / 1e3, int(r["seqs"])) for r in rows)
    a, b = fit_gap(gaps)
    g = np.array([x[0] for x in gaps])
    return {"fixed_s": a, "per_request_s": b, "gaps": len(gaps), "mean_s": float(g.mean()),
            "median_s": float(np.median(g)), "mean_requests": float(np.mean([x[1] for x in gaps]))}


def _predicted(latency: LatencyModel, x: Launch, num_layers: int, co: Work | None, co_sms: int) -> float:
    """Seconds the model gives launch ``x`` next to ``co`` on ``co_sms`` SMs (None: alone)."""
    if x.layers.stop == num_layers:
        return float(step_times(latency, x.work, x.steps, x.sms, co, co_sms).sum())
    return float(latency.predict(x.work, x.sms, co, co_sms))


def validate(make_requests: Callable[[], list[Request]], executor, model: ModelSpec, gpu: GpuSpec,
             sched: SchedulerConfig, slo: SloConfig, latency: LatencyModel, num_blocks: int, block_size: int,
             prefix_caching: bool = False, host_gap: tuple[float, float] | None = None) -> Report:
    """Serve ``make_requests()`` on ``executor`` (arrivals shifted to its clock), then simulate a fresh copy
    with the same scheduler config, KV pool and latency model (and ``host_gap``: None, the model's); compare."""
    from simulator.run import simulate

    reqs = make_requests()
    shift = executor.now() + 0.05  # a real executor's clock started at its creation
    for r in reqs:
        r.arrival += shift
    kv = BlockManager(num_blocks, block_size, prefix_caching)
    scheduler = make_scheduler(sched, model, gpu, kv, CachedLatency(latency), slo=slo)
    results: list[StepResult] = []
    done = serve(reqs, scheduler, executor, on_step=results.append)
    busy: dict[str, float] = {}
    for res in results:
        busy[res.batch.lane] = busy.get(res.batch.lane, 0.0) + res.end - res.start
    real_cols = request_columns(done, slo)
    real = summarize(done, slo, busy, real_cols)
    sim_run = simulate(make_requests(), model, gpu, sched,
                       CacheConfig(num_blocks=num_blocks, block_size=block_size, prefix_caching=prefix_caching),
                       slo, latency, host_gap=host_gap)
    rows: list[dict] = []
    rep = Report(real, sim_run.summary, compare(real, sim_run.summary),
                 launch_errors([launch_of(r, model.num_layers) for r in results], latency, model.num_layers, rows,
                               tuple(sim_run.summary["config"]["host_gap_s"])),
                 launch_rows=rows)
    rep.speed = launch_speed(rows)
    at_speed = simulate(make_requests(), model, gpu, sched,
                        CacheConfig(num_blocks=num_blocks, block_size=block_size, prefix_caching=prefix_caching),
                        slo, at_speed_of(latency, *rep.speed), host_gap=host_gap, timeline=False)
    rep.speed_rows = compare(real, at_speed.summary)
    for name, cols in (("real", real_cols), ("sim", sim_run.columns)):
        cdf = rep.real_cdf if name == "real" else rep.sim_cdf
        for m in ("ttft", "tpot"):
            x = np.asarray(cols[m], float)
            cdf[m] = np.sort(x[np.isfinite(x)] * 1e3)
    return rep


def simulated_capacity(requests_at: Callable[[float], list[Request]], model: ModelSpec, gpu: GpuSpec,
                       sched: SchedulerConfig, slo: SloConfig, latency: LatencyModel, num_blocks: int,
                       block_size: int, prefix_caching: bool = False, target: float = 0.9,
                       guess: float = 1.0, host_gap: tuple[float, float] | None = None) -> float:
    """The highest request rate at which at least ``target`` of ``requests_at(rate)`` meet both SLOs in the
    simulator, with this policy, KV pool and latency model (bisection to 2 %, ``simulator.capacity``): what
    ``bullet validate --load`` scales its rates by, so that "light, medium, near capacity" mean that for the
    policy and trace at hand. Infinite when the SLOs hold even with every request arriving at once."""
    from simulator.capacity import capacity
    from simulator.run import simulate

    cache = CacheConfig(num_blocks=num_blocks, block_size=block_size, prefix_caching=prefix_caching)

    def attainment(rate: float) -> float:
        return simulate(requests_at(rate), model, gpu, sched, cache, slo, latency, timeline=False,
                        host_gap=host_gap).summary["slo_attainment"]

    if attainment(1e9) >= target:  # every request at once still meets the SLOs
        return float("inf")
    return capacity(attainment, guess, target)[0]


def write_launch_rows(rows: list[dict], path) -> None:
    """:func:`launch_errors`' rows (every launch: its work, the fraction of it the other lane overlapped,
    measured and predicted ms) as a CSV file, through a temporary file; a header only when there are none."""
    import csv

    from .metrics import atomic_write

    with atomic_write(path) as f:
        w = csv.DictWriter(f, fieldnames=LAUNCH_COLUMNS)
        w.writeheader()
        w.writerows(rows)


def plot_cdfs(rep: Report, path, title: str) -> None:
    """TTFT and TPOT CDFs, real against simulated (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, m in zip(axes, ("ttft", "tpot")):
        for name, cdf, style in (("real", rep.real_cdf, "-"), ("simulated", rep.sim_cdf, "--")):
            x = cdf.get(m, np.zeros(0))
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, style, label=name)
        ax.set_xlabel(f"{m.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
