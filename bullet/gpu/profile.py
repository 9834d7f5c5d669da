"""``bullet profile``: measure what the executor really runs, through its own launch path, on every partition
size of the menu, alone and next to the other lane, and write the points a latency model is fitted to.

A point is one launch shape: a prefill (one or several chunks, fresh or after a cached prefix, all layers or a
slice) on a prefill partition or the whole GPU; a run of fused decode steps from the decode graphs (batch size x
context lengths, uniform or skewed) on a decode partition or the whole GPU; a mixed chunked-prefill step (decode
rows plus a prompt chunk) on the whole GPU; and co-runs, a prefill on one partition while fused decode steps run on
the complementary one, which give one point for each side with the other as its co-runner. Each is run once to
warm up (graph capture, attention plans), then ``reps`` times; a row holds the median GPU time (CUDA events), the
host time spent in ``GpuExecutor.launch``, and the launch's :class:`~bullet.perfmodel.Work` features. Co-runs are
measured as loaded serving runs them (:data:`CORUN_PROTOCOL`): both lanes relaunched without a pause for a few
seconds before the timed runs, so the GPU is at its power cap as it is in serving.

Last, the engine's own host time between launches (:func:`measure_host_gaps`): ``serve()`` with the chunked
policy on this executor, one decode step a launch, for several batch sizes; the time from one launch's end to
the next one's start (results read back, the scheduler's bookkeeping and plan, inputs prepared) is what a
simulation adds before each launch (``bullet fit`` fits it as a fixed and a per-request term).

Output folder: ``points.csv`` (one row per point, appended and flushed as each is measured, so an interrupted
profile keeps what it measured and a rerun skips it), ``gaps.csv`` (batch size, median / p10 / p90 gap,
launches) and ``metadata.json`` (GPU, SMs, power limit, clocks, driver, CUDA, torch, Triton, bullet version and
commit, date, grid). ``device="cpu"`` runs the same code on the
host (tests; the tiny model), where lanes do not overlap.
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import json
import os
import platform
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from ..batch import Batch, Chunk, Partition, StepResult
from ..config import ModelSpec
from ..kvcache import BlockManager
from ..perfmodel import work_of
from .partitions import PartitionMenu

PROFILE_VERSION = 1
Sizes = Literal["alternate", "all"]  # which menu sizes the solo lines cover (``grid``)
# How co-run points are measured (metadata.json): both lanes relaunched without a pause, ``sustain_s`` seconds
# before the timed prefills. Points of another protocol are not mixed in one profile (``--redo-coruns``).
CORUN_PROTOCOL = {"name": "continuous", "sustain_s": 2.0}
COLUMNS = ("id", "kind", "lane", "sms", "layers", "seqs", "tokens", "decode_seqs", "attn_pairs", "kv_read",
           "max_ctx", "samples", "embed", "steps", "co_kind", "co_sms", "co_tokens", "co_seqs", "co_kv_read",
           "co_attn_pairs", "co_layers", "overlap", "gpu_s", "first_s", "step_s", "host_s", "gpu_s_min",
           "gpu_s_max", "reps")


@dataclass(frozen=True, slots=True)
class Shape:
    """What one launch computes: prefill chunks ``(new tokens, cached prefix)`` and decode rows (context each,
    counting the new token); ``layers`` of the model (prefill slices); ``steps`` fused decode steps."""

    prefill: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, ...] = ()
    layers: int | None = None  # None: all
    steps: int = 1

    @property
    def kind(self) -> str:
        return "mixed" if self.prefill and self.decode else ("prefill" if self.prefill else "decode")

    def key(self) -> str:
        pre = "+".join(f"{n}@{p}" for n, p in self.prefill)
        dec = _runs(self.decode)
        return f"{self.kind}[{pre}|{dec}|L{self.layers or 'all'}|s{self.steps}]"


@dataclass(frozen=True, slots=True)
class Point:
    """A shape on a partition (``lane`` and its SM count), alone or next to ``co`` on ``co_sms`` SMs."""

    shape: Shape
    lane: str
    sms: int
    co: Shape | None = None
    co_sms: int = 0

    @property
    def id(self) -> str:
        co = f" || {self.co.key()}@{self.co_sms}" if self.co else ""
        return f"{self.shape.key()}@{self.lane}{self.sms}{co}"


def _runs(ctx: tuple[int, ...]) -> str:
    """Run-length form of decode contexts: 64x1024 or 1x8192,63x512."""
    if not ctx:
        return ""
    out, cur, n = [], ctx[0], 0
    for c in ctx:
        if c == cur:
            n += 1
        else:
            out.append(f"{n}x{cur}")
            cur, n = c, 1
    out.append(f"{n}x{cur}")
    return ",".join(out)


# ---------------------------------------------------------------------------------------------- the grid

def grid(spec: ModelSpec, menu_sizes: tuple[Sequence[int], Sequence[int]], quick: bool, cpu: bool = False,
         kv_tokens: int | None = None, sizes: Sizes | None = None, twins: bool = False,
         corun_min: int = 0, corun_sweep: bool = False, corun_splits: bool = False) -> list[Point]:
    """Points to measure on a menu of ``menu_sizes`` (prefill sizes, decode sizes; each ending with the whole GPU).
    The full grid covers every partition size of the menu on both lanes; ``quick`` every other one. ``sizes``
    overrides which sizes the solo lines cover (``"all"``: every menu size, with the quick grid's lengths);
    everything else (co-run splits, random launches) stays the grid's own, so a grid with more sizes holds the
    other's points, ids unchanged. ``twins``: each co-run shape also measured alone on its own partition.
    ``corun_min``: seeded co-run pairs added on each decode size the co-runs use until it has that many
    (:func:`fill_coruns`); ``corun_splits``: on every decode size of the menu, so that every prefill size has
    co-runs beside the decode size that complements it. ``corun_sweep``: the co-runner sweeps of :func:`swept_coruns`. Solo points come first (co-runs size their decode stretch from them). Decode
    batches whose KV would not fit ``kv_tokens`` are left out."""
    num_sms = menu_sizes[0][-1]
    if cpu:  # the tiny model on the host: the code paths, not the numbers
        pre_sizes, dec_sizes, new, prefixes, batches, ctxs = [num_sms], [num_sms], [16, 64], [0, 32], [1, 4], [32]
        co_pairs, co_new, co_batches, co_ctx = [(68, 64)], [64], [4], 32
    else:
        pre_sizes, dec_sizes = list(menu_sizes[0][:-1]), list(menu_sizes[1][:-1])
        if quick:
            pre_sizes, dec_sizes = pre_sizes[::2], dec_sizes[::2]
        new = [256, 1024, 4096, 8192] if quick else [128, 512, 1024, 2048, 4096, 8192]
        prefixes = [0, 8192] if quick else [0, 2048, 8192, 16384]
        batches = [1, 8, 32, 64, 128, 256] if quick else [1, 4, 8, 16, 32, 64, 96, 128, 192, 256]
        ctxs = [512, 2048, 8192] if quick else [256, 1024, 2048, 4096, 8192]
        # co-runs on complementary pairs (decode takes the rest): those a split policy runs most
        co_pre = [min(pre_sizes, key=lambda p, t=t: abs(p - t)) for t in (64, 96)] if quick else pre_sizes[::2]
        co_pairs = [(p, num_sms - p) for p in co_pre]
        co_new, co_batches, co_ctx = [2048, 8192], [32, 128], 2048
    if sizes is not None and not cpu:  # the solo lines' sizes
        solo_pre, solo_dec = (list(menu_sizes[0][:-1]), list(menu_sizes[1][:-1])) if sizes == "all" else \
            (list(menu_sizes[0][:-1:2]), list(menu_sizes[1][:-1:2]))
    else:
        solo_pre, solo_dec = pre_sizes, dec_sizes
    pts: list[Point] = []
    for lane, lane_sizes in (("all", [num_sms]), ("prefill", solo_pre if not cpu else [])):
        for sms in lane_sizes:
            for n in new:
                for p in prefixes:
                    if n + p <= spec.max_position:
                        pts.append(Point(Shape(((n, p),)), lane, sms))
            if not cpu:  # several prompts in one launch, and a layer slice
                pts.append(Point(Shape(((1024, 0),) * 4), lane, sms))
                pts.append(Point(Shape(((256, 0),) * 16), lane, sms))
                pts.append(Point(Shape(((4096, 0),), layers=max(1, spec.num_layers // 4)), lane, sms))
                # launches a prefill graph serves (<= 512 tokens): several short prompts, a bucket's padding
                # (400 tokens run as 512), a short slice
                pts.append(Point(Shape(((32, 0),) * 8), lane, sms))
                pts.append(Point(Shape(((96, 0),) * 5), lane, sms))
                pts.append(Point(Shape(((400, 0),)), lane, sms))
                pts.append(Point(Shape(((128, 0),) * 2, layers=max(1, spec.num_layers // 4)), lane, sms))
    # chunked prefill's later chunks: a chunk over the prompt's earlier chunks (whole GPU)
    if not cpu:
        for n, p in ((512, 1536), (2048, 2048), (2048, 6144)):
            pts.append(Point(Shape(((n, p),)), "all", num_sms))
    steps = 4 if cpu else 8
    for lane, lane_sizes in (("all", [num_sms]), ("decode", solo_dec if not cpu else [])):
        for sms in lane_sizes:
            for bs in batches:
                shapes = [(c,) * bs for c in ctxs]
                if bs >= 8:  # skewed: one long context among short ones
                    shapes.append((max(ctxs),) + (min(ctxs),) * (bs - 1))
                for ctx in shapes:
                    if kv_tokens is None or sum(ctx) + 600 * bs <= 0.9 * kv_tokens:  # co-runs add steps
                        pts.append(Point(Shape(decode=ctx, steps=steps), lane, sms))
    for rows in ([2] if cpu else [16, 64, 128]):  # chunked prefill's mixed steps, whole GPU
        for n in ([16] if cpu else [512, 2048, 8192 - rows]):
            pts.append(Point(Shape(((n, 0),), decode=(min(ctxs[-1], 1024),) * rows), "all", num_sms))
        if not cpu:  # a later chunk over a prefix, and a small (graphed) mixed step
            pts.append(Point(Shape(((2048 - rows, 2048),), decode=(1024,) * rows), "all", num_sms))
            if rows < 64:
                pts.append(Point(Shape(((64, 0),), decode=(1024,) * rows), "all", num_sms))
    if not cpu:
        pts += sampled(spec, pre_sizes, num_sms, 24 if quick else 64, kv_tokens)
        pts += sampled_mixed(num_sms, 16 if quick else 48, kv_tokens)
    for p, d in co_pairs:
        for n in co_new:
            for bs in co_batches:
                dec = Shape(decode=(co_ctx,) * bs, steps=steps)
                pre = Shape(((n, 0),))
                pts.append(Point(pre, "prefill", p, dec, d))
                pts.append(Point(dec, "decode", d, pre, p))
    if not cpu:
        pts += sampled_coruns(spec, menu_sizes[0][:-1], menu_sizes[1][:-1], num_sms, 8 if quick else 24, kv_tokens)
        # long-prompt workloads (azure-code): a few decode rows of long contexts beside the prompt; the
        # co-run families were 5 % short on them in `bullet validate` (static-split, bench/RESULTS.md)
        pts += sampled_coruns(spec, menu_sizes[0][:-1], menu_sizes[1][:-1], num_sms, 12 if quick else 24,
                              kv_tokens, seed=3, batches=(1, 2, 4, 8, 16), contexts=(1024, 2048, 4096, 8192))
        pts += sampled_mixed(num_sms, 16 if quick else 32, kv_tokens, seed=4)  # more of chunked's steps
        # static-split on azure-code: several long prompts in one prefill beside 1-4 decode rows. Its decode
        # launches ran 4-7 % slower, relative to the model, than 17-64-row ones beside the same prefills, where
        # the co-runs above (one prompt each) show 2-3 % (bench/corun_decode_ratio.py, bench/RESULTS.md)
        p = min(menu_sizes[0][:-1], key=lambda x: abs(x - 92))  # static-split's default split, 92 / 40 on the H200
        for k, n in ((2, 1536), (3, 2048), (4, 1792)):
            for bs in (1, 2, 4):
                dec, pre = Shape(decode=(2048,) * bs, steps=steps), Shape(((n, 0),) * k)
                pts += [Point(pre, "prefill", p, dec, num_sms - p), Point(dec, "decode", num_sms - p, pre, p)]
    if corun_min and not cpu:
        pts += fill_coruns(spec, pts, menu_sizes[0][:-1], num_sms, corun_min, kv_tokens,
                           menu_sizes[1][:-1] if corun_splits else ())
    if corun_sweep and not cpu:
        pts += swept_coruns(menu_sizes[0][:-1], menu_sizes[1][:-1], num_sms)
    co = [pt for pt in pts if pt.co is not None]
    solo = [pt for pt in pts if pt.co is None] + ([twin(pt) for pt in co] if twins else [])
    return list({pt.id: pt for pt in solo + co}.values())  # once each (the full grid meets some shapes twice)


# The co-runner sweeps (issue 9: co-run prefill held out at 3.2 % against a 3 % gate). The random co-runs give each
# split 3-9 points from different co-runners, so the scatter of short prompts beside 2-8 decode rows could not be
# told from structure (bench/RESULTS.md, "Co-run prefill and the eager ramps"): at a few splits, one prompt beside
# decode batches of 1-128 rows, and one decode batch beside prompts of 256-8,192 tokens.
SWEEP_SPLITS = (36, 44, 68, 92)  # prefill SMs; decode takes the rest (96, 88, 64, 40 on the H200)
SWEEP_ROWS, SWEEP_PROMPT = (1, 2, 4, 8, 16, 32, 64, 128), 2048  # decode rows beside one 2,048-token prompt
SWEEP_PROMPTS, SWEEP_BESIDE = (256, 512, 1024, 4096, 8192), 8  # prompts beside 8 decode rows
SWEEP_CTX = 2048  # every decode row's context


def swept_coruns(pre_sizes: Sequence[int], dec_sizes: Sequence[int], num_sms: int) -> list[Point]:
    """Each split of :data:`SWEEP_SPLITS` (the menu's prefill size nearest to it, decode on the rest where the
    menu has that size): one fresh prompt of :data:`SWEEP_PROMPT` tokens beside each of :data:`SWEEP_ROWS`
    decode rows, and one of :data:`SWEEP_BESIDE` rows beside each prompt of :data:`SWEEP_PROMPTS`; contexts
    :data:`SWEEP_CTX`, all layers, 8 fused steps; each pair measured from both sides."""
    pts: list[Point] = []
    for target in SWEEP_SPLITS:
        p = min(pre_sizes, key=lambda s, t=target: abs(s - t))
        d = num_sms - p
        if d not in dec_sizes:
            continue
        shapes = [(SWEEP_PROMPT, rows) for rows in SWEEP_ROWS] + [(n, SWEEP_BESIDE) for n in SWEEP_PROMPTS]
        for n, rows in shapes:
            pre, dec = Shape(((n, 0),)), Shape(decode=(SWEEP_CTX,) * rows, steps=8)
            pts += [Point(pre, "prefill", p, dec, d), Point(dec, "decode", d, pre, p)]
    return pts


def twin(pt: Point) -> Point:
    """A co-run point's shape alone on its own partition (its stand-alone time, measured)."""
    return Point(pt.shape, pt.lane, pt.sms)


FILL_KV_TOKENS = 500_000  # (Llama-3.1-8B on an H200 at 0.85 of its memory: about 700,000)


def fill_coruns(spec: ModelSpec, pts: Sequence[Point], pre_sizes: Sequence[int], num_sms: int, minimum: int,
                kv_tokens: int | None, more: Sequence[int] = ()) -> list[Point]:
    """Seeded co-run pairs (:func:`sampled_coruns`, seed ``1000 + d``) on each decode size ``d`` that the
    co-runs of ``pts`` use, and on the decode sizes ``more``, until each has ``minimum`` pairs; each pair is measured from both sides, and the
    prefill side sits on the largest prefill size beside ``d``, so the prefill sizes the co-runs use get as
    many. The draws fit a KV pool of at most :data:`FILL_KV_TOKENS`, so that cards whose pools differ a little
    (the free memory after start-up) draw the same points and resume each other's profiles."""
    kv_tokens = min(kv_tokens or FILL_KV_TOKENS, FILL_KV_TOKENS)
    have = Counter(pt.co_sms for pt in pts if pt.co is not None and pt.lane == "prefill")
    ids, out = {pt.id for pt in pts}, []
    for d in sorted(set(have) | set(more)):
        need, draws = minimum - have[d], minimum
        while need > 0:  # the draws of a seed are a prefix of a longer run of it: ask for more until enough
            drawn = sampled_coruns(spec, pre_sizes, [d], num_sms, draws, kv_tokens, seed=1000 + d)
            new = [pair for pair in zip(drawn[::2], drawn[1::2]) if pair[0].id not in ids]
            if len(new) >= need:
                for pair in new[:need]:
                    out += pair
                    ids.update(pt.id for pt in pair)
                need = 0
            draws *= 2
    return out


def sampled_coruns(spec: ModelSpec, pre_sizes: Sequence[int], dec_sizes: Sequence[int], num_sms: int, pairs: int,
                   kv_tokens: int | None, seed: int = 1, batches: Sequence[int] = (16, 32, 64, 128, 192),
                   contexts: Sequence[int] = (512, 1024, 2048, 4096)) -> list[Point]:
    """Seeded random co-runs of the kind a split policy makes, ``pairs`` of them, each measured from both
    sides: a decode batch of ``batches`` rows of mixed ``contexts`` on a random decode size of the menu, next
    to one prompt (whole or a layer slice) on the largest prefill size that fits beside it. The grid's
    co-runs cover two splits."""
    rng = np.random.default_rng(seed)
    L, pts = spec.num_layers, []
    while len(pts) < 2 * pairs:
        d = int(rng.choice(list(dec_sizes)))
        fits = [p for p in pre_sizes if p + d <= num_sms]
        if not fits:
            continue
        p = max(fits)
        new = int(rng.choice((512, 1024, 2048, 4096, 8192)))
        pre = Shape(((new, 0),), layers=[None, L // 4, L // 2][int(rng.integers(3))])
        bs = int(rng.choice(batches))
        ctx = tuple(sorted((int(c) for c in rng.choice(contexts, bs)), reverse=True))
        if sum(ctx) + 600 * bs + new > 0.5 * (kv_tokens or 10**9):
            continue
        dec = Shape(decode=ctx, steps=8)
        pts += [Point(pre, "prefill", p, dec, d), Point(dec, "decode", d, pre, p)]
    return pts


def sampled(spec: ModelSpec, pre_sizes: Sequence[int], num_sms: int, count: int, kv_tokens: int | None,
            seed: int = 0) -> list[Point]:
    """Seeded random launches of the kinds serving runs, off the grid's lines: chunked prefill's steps on the
    whole GPU (a token budget of 512-8192 filled with decode rows of mixed contexts, perhaps a later chunk
    over a prefix, then fresh prompts of ShareGPT-like lengths, the last one cut), and a split policy's
    prefill launches (several fresh prompts, whole or in layer slices) on a random prefill partition. Two
    thirds are chunked steps."""
    rng = np.random.default_rng(seed)
    ctx_levels, pts = (256, 512, 1024, 2048, 4096), []
    while len(pts) < count:
        chunked = len(pts) % 3 != 2
        budget = int(rng.choice((256, 512, 2048, 2048, 4096, 8192) if chunked else (1024, 2048, 4096, 8192)))
        rows = int(rng.integers(0, min(192, budget // 4) + 1)) if chunked else 0
        decode = tuple(sorted((int(c) for c in rng.choice(ctx_levels, rows)), reverse=True))
        left, prefill = budget - rows, []
        if chunked and rng.random() < 0.5:  # a later chunk of a long prompt
            n = int(rng.integers(left // 4, left + 1))
            prefill.append((n, 512 * int(rng.integers(1, 13))))
            left -= n
        while left > 0:
            n = min(left, max(16, int(rng.lognormal(6.5, 0.9))))  # median ~660 tokens
            prefill.append((n, 0))
            left -= n
        if sum(n + p for n, p in prefill) + sum(decode) > 0.5 * (kv_tokens or 10**9) or not prefill:
            continue
        layers = None if chunked else [None, spec.num_layers // 4, spec.num_layers // 2][int(rng.integers(3))]
        shape = Shape(tuple(prefill), decode, layers=layers)
        lane, sms = ("all", num_sms) if chunked else ("prefill", int(rng.choice(list(pre_sizes))))
        pts.append(Point(shape, lane, sms))
    return pts


def sampled_mixed(num_sms: int, count: int, kv_tokens: int | None, budget: int = 2048, seed: int = 2) -> list[Point]:
    """Seeded random steps of chunked prefill at vLLM's usual token budget, the launch serving runs most
    (issue 9: predicted 8 % too long in `bullet validate`): 2-80 decode rows of contexts drawn from 256-4096,
    then one prompt chunk (fresh, or a later chunk over a prefix of up to 8k) and perhaps the start of the next
    prompt, filling ``budget`` tokens on the whole GPU."""
    rng = np.random.default_rng(seed)
    pts: list[Point] = []
    while len(pts) < count:
        rows = int(rng.integers(2, 81))
        decode = tuple(sorted((int(c) for c in rng.integers(256, 4097, rows)), reverse=True))
        left = budget - rows
        prefix = 0 if rng.random() < 0.5 else 512 * int(rng.integers(1, 17))
        first = left if rng.random() < 0.6 else int(rng.integers(left // 3, left))
        prefill = [(first, prefix)] + ([(left - first, 0)] if left > first else [])
        if sum(n + p for n, p in prefill) + sum(decode) > 0.5 * (kv_tokens or 10**9):
            continue
        pts.append(Point(Shape(tuple(prefill), decode), "all", num_sms))
    return pts


# ---------------------------------------------------------------------------------------------- measuring

class Profiler:
    """Runs points on a :class:`~bullet.gpu.executor.GpuExecutor`, with its own block tables."""

    def __init__(self, executor, reps: int = 3, prefill_graphs: bool = True,
                 sustain_s: float = CORUN_PROTOCOL["sustain_s"]) -> None:
        self.ex, self.reps, self.prefill_graphs, self.sustain_s = executor, reps, prefill_graphs, sustain_s
        self.spec: ModelSpec = executor.spec
        self.kv = BlockManager(executor.kv.num_blocks, executor.kv.block_size)
        self._rid = 1 << 40  # request ids of our own, far from any real ones
        self.solo: dict[str, float] = {}  # id -> median GPU s (co-runs size the decode stretch from it)

    def _chunks(self, shape: Shape, extra_steps: int) -> list[Chunk]:
        rng = np.random.default_rng(len(self.solo))
        vocab = self.spec.vocab_size
        chunks = []
        for ctx in shape.decode:  # decode rows first, as the executor orders them
            rid = self._new_rid()
            table = self.kv.allocate(rid, ctx + extra_steps)
            chunks.append(Chunk(rid, ctx - 1, 1, table, True, (int(rng.integers(vocab)),)))
        for n, prefix in shape.prefill:
            rid = self._new_rid()
            table = self.kv.allocate(rid, prefix + n + extra_steps)
            ids = tuple(int(x) for x in rng.integers(0, vocab, n))
            chunks.append(Chunk(rid, prefix, n, table, shape.layers is None, ids))
        return chunks

    def _new_rid(self) -> int:
        self._rid += 1
        return self._rid

    def _release(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            self.kv.free(c.req_id)
            self.ex.release(c.req_id)

    def _batch(self, shape: Shape, lane: str, sms: int, chunks: list[Chunk], steps: int | None = None) -> Batch:
        L = self.spec.num_layers
        layers = range(shape.layers or L)
        return Batch(Partition(lane, sms), layers, tuple(chunks), steps or shape.steps)  # type: ignore[arg-type]

    def _launch(self, batch: Batch) -> float:
        t = time.perf_counter()
        self.ex.launch(batch)
        self.ex.flush()  # host time = the whole launch enqueued, as before the executor did it in pieces
        return time.perf_counter() - t

    def _drain(self) -> list[StepResult]:
        out = []
        while self.ex.busy("all") or self.ex.busy("prefill") or self.ex.busy("decode"):
            out.extend(self.ex.wait(None))
        return out

    def measure(self, pt: Point) -> dict:
        """Warm up, then ``reps`` runs; returns the CSV row."""
        if pt.co is not None:
            return self._measure_corun(pt)
        runs = self.solo_runs(pt)
        row = self._row(pt, runs[0][0].batch, runs)
        self.solo[pt.id] = row["gpu_s"]
        return row

    def solo_runs(self, pt: Point) -> list[tuple[StepResult, float]]:
        """A stand-alone point's ``reps`` timed runs after one warm-up run: each one's result and host seconds."""
        runs = []
        for rep in range(self.reps + 1):
            chunks = self._chunks(pt.shape, pt.shape.steps)
            batch = self._batch(pt.shape, pt.lane, pt.sms, chunks)
            if not rep and self.prefill_graphs:  # as serving does at start-up, where a graph serves it
                self.ex.capture_prefill_for(batch)
            host = self._launch(batch)
            (res,) = self._drain()
            self._release(chunks)
            if rep:  # the first run warms up (graph capture, attention plans)
                runs.append((res, host))
        return runs

    def _measure_corun(self, pt: Point) -> dict:
        """``pt.shape`` on its lane while ``pt.co`` runs on the other, both lanes kept busy as loaded serving keeps
        them (:data:`CORUN_PROTOCOL`): the decode lane relaunches stretches of fresh rows and the prefill lane
        relaunches the prefill, each as soon as its last launch returns, for ``sustain_s`` seconds (the GPU
        settles at its power cap: a co-run prefill measured in a single burst was 3-5 % faster than after a
        few seconds of it on the H200, bench/RESULTS.md), then ``reps`` timed prefills. A prefill point is
        the median of those; a decode point the median step among those covered by the timed prefills."""
        pre_pt, dec_pt = (pt, Point(pt.co, "decode", pt.co_sms)) if pt.lane == "prefill" else \
            (Point(pt.co, "prefill", pt.co_sms), Point(pt.shape, "decode", pt.sms))
        stretch = dec_pt.shape.steps
        step_t = self.solo.get(dec_pt.id)  # s a step, from the solo point if measured
        if step_t is not None:
            step_t /= stretch
            stretch = self._stretch(stretch, step_t)
        if self.prefill_graphs:
            pchunks = self._chunks(pre_pt.shape, 1)
            self.ex.capture_prefill_for(self._batch(pre_pt.shape, "prefill", pre_pt.sms, pchunks))
            self._release(pchunks)
        pending: dict[str, tuple[Batch, float, bool]] = {}  # lane -> batch, host s, timed
        timed: list[tuple[StepResult, float]] = []  # the timed prefills and their host times
        decodes: list[StepResult] = []
        dec_host: list[float] = []  # host s of each decode launch
        t_timed = time.perf_counter() + (self.sustain_s if self.ex.cuda else 0.0)
        pre_t = self.solo.get(Point(pre_pt.shape, "prefill", pre_pt.sms).id, 0.05)
        warm, deadline = False, None  # warm: one prefill ran (graphs, attention plans)
        while True:
            timing = warm and time.perf_counter() >= t_timed
            if timing and deadline is None:  # a prefill much shorter than a step may never cover one
                deadline = time.perf_counter() + max(2.0, 20 * (pre_t + (step_t or 0.0)))
            if len(timed) >= self.reps and (pt.lane == "prefill" or not self.ex.cuda or time.perf_counter() > deadline
                                            or len(_covered(decodes, timed)[0]) >= self.reps):
                break
            if "decode" not in pending:
                chunks = self._chunks(dec_pt.shape, stretch)
                b = self._batch(dec_pt.shape, "decode", dec_pt.sms, chunks, stretch)
                pending["decode"] = (b, self._launch(b), timing)
            if "prefill" not in pending:
                b = self._batch(pre_pt.shape, "prefill", pre_pt.sms, self._chunks(pre_pt.shape, 1))
                pending["prefill"] = (b, self._launch(b), timing)
            for res in self.ex.wait(None):
                b, host, is_timed = pending.pop(res.batch.lane)
                self._release(list(b.chunks))
                if res.batch.lane == "prefill":
                    if is_timed:
                        timed.append((res, host))
                    warm = True
                    continue
                if step_t is None and not decodes:  # no solo step time: size the stretches from this one
                    step_t = float(np.median(np.diff([res.start, *res.step_ends])))
                    stretch = self._stretch(stretch, step_t)
                decodes.append(res)
                dec_host.append(host)
        while pending:  # let the launches in flight end
            for res in self.ex.wait(None):
                b, host, _ = pending.pop(res.batch.lane)
                self._release(list(b.chunks))
                if res.batch.lane == "decode":
                    decodes.append(res)
                    dec_host.append(host)
        if pt.lane == "prefill":
            batch = timed[0][0].batch
            runs = timed
            cover = [_cover(p.start, p.end, [(d.start, d.end) for d in decodes]) for p, _ in timed]
        else:  # a decode point: the steps the timed prefills covered; none (on the CPU, lanes take turns; on
            # the GPU, a prefill much shorter than a step): the solo step, overlap 0 (the fit skips it)
            steps, cover = _covered(decodes, timed)
            batch = decodes[-1].batch
            step = float(np.median(steps)) if steps else float("nan")
            runs = [(_Steps(decodes[-1], step, len(steps)), float(np.median(dec_host)))]
        row = self._row(pt, batch, runs)
        row["overlap"] = float(np.median(cover)) if cover else 0.0
        if pt.lane == "decode":  # steps: of each stretch (the fit takes the KV at its middle); reps: steps timed
            row.update(steps=stretch, reps=len(steps) or len(timed))
            if not steps:
                row["step_s"] = step_t if step_t is not None else float("nan")
        return row

    @staticmethod
    def _stretch(steps: int, step_s: float) -> int:
        """Fused steps of a co-run's decode launches: the point's, or enough to outlast an eager prefill's host
        part (~15-25 ms on the H200) so the decode lane does not idle while the prefill is enqueued."""
        return int(min(512, max(steps, np.ceil(0.04 / max(step_s, 1e-6)))))

    def _row(self, pt: Point, batch: Batch, runs: list) -> dict:
        L = self.spec.num_layers
        w = work_of(batch, L)
        gpu = np.array([r.end - r.start for r, _ in runs])
        first = np.array([r.step_ends[0] - r.start for r, _ in runs])
        steps = batch.steps
        if isinstance(runs[0][0], _Steps):
            step = np.array([r.step for r, _ in runs])
            steps = int(np.median([r.count for r, _ in runs]))
        elif steps > 1:
            step = np.array([(r.end - r.step_ends[0]) / (steps - 1) for r, _ in runs])
        else:
            step = gpu
        shape = pt.shape
        row = {
            "id": pt.id, "kind": shape.kind, "lane": pt.lane, "sms": self._actual_sms(pt.lane, pt.sms),
            "layers": w.num_layers, "seqs": w.seqs, "tokens": w.tokens, "decode_seqs": len(shape.decode),
            "attn_pairs": w.attn_pairs, "kv_read": w.kv_read,
            "max_ctx": max([c for c in shape.decode] + [n + p for n, p in shape.prefill]),
            "samples": w.samples, "embed": int(w.embed), "steps": steps,
            "co_kind": "", "co_sms": 0, "co_tokens": 0, "co_seqs": 0, "co_kv_read": 0, "co_attn_pairs": 0.0,
            "co_layers": 0, "overlap": 0.0,
            "gpu_s": float(np.median(gpu)), "first_s": float(np.median(first)),
            "step_s": float(np.median(step[~np.isnan(step)])) if (~np.isnan(step)).any() else float("nan"),
            "host_s": float(np.median([h for _, h in runs])), "gpu_s_min": float(gpu.min()),
            "gpu_s_max": float(gpu.max()), "reps": len(runs),
        }
        if pt.co is not None:
            co_chunks = [Chunk(0, c - 1, 1, (), True) for c in pt.co.decode] + \
                [Chunk(0, p, n, (), pt.co.layers is None) for n, p in pt.co.prefill]
            cw = work_of(Batch(Partition("all", pt.co_sms), range(pt.co.layers or L), tuple(co_chunks)), L)
            row.update(co_kind=pt.co.kind, co_sms=self._actual_sms("decode" if pt.lane == "prefill" else "prefill",
                                                                   pt.co_sms),
                       co_tokens=cw.tokens, co_seqs=cw.seqs, co_kv_read=cw.kv_read, co_attn_pairs=cw.attn_pairs,
                       co_layers=cw.num_layers)
        return row

    def _actual_sms(self, lane: str, sms: int) -> int:
        menu = getattr(self.ex, "menu", None)
        if menu is None:
            return sms
        return menu.side(lane, sms).num_sms


@dataclass(slots=True)
class _Steps:
    """A decode launch's result reduced to the steps that ran next to the co-runner."""

    res: StepResult
    step: float
    count: int

    @property
    def start(self) -> float:
        return self.res.start

    @property
    def end(self) -> float:
        return self.res.end

    @property
    def step_ends(self):
        return self.res.step_ends


def _cover(start: float, end: float, windows: list[tuple[float, float]]) -> float:
    """The fraction of [start, end] inside the union of ``windows`` (disjoint: one lane's launches)."""
    inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in windows)
    return min(1.0, inside / max(end - start, 1e-12))


def _covered(decodes: list[StepResult], prefills: list[tuple[StepResult, float]],
             at_least: float = 0.8) -> tuple[list[float], list[float]]:
    """The decode steps (durations) that ran at least ``at_least`` next to the timed prefills, and their
    coverage; back-to-back prefills leave host gaps between them, so a step longer than one prefill counts."""
    windows = [(p.start, p.end) for p, _ in prefills]
    steps, cover = [], []
    for d in decodes:
        ends = np.asarray(d.step_ends)
        for s, e in zip(np.concatenate(([d.start], ends[:-1])), ends):
            c = _cover(float(s), float(e), windows)
            if c >= at_least:
                steps.append(float(e - s))
                cover.append(c)
    return steps, cover


# ---------------------------------------------------------------------------------------------- host gaps
GAP_SIZES = (1, 8, 16, 32, 64, 96, 128, 192, 256)  # decode batch sizes whose launch-to-launch host time is measured
GAP_STEPS, GAP_PROMPT = 32, 64  # tokens each request generates, and its prompt
GAP_COLUMNS = ("seqs", "gap_s", "gap_p10_s", "gap_p90_s", "launches")


def measure_host_gaps(executor, sizes: Sequence[int] = GAP_SIZES, steps: int = GAP_STEPS, prompt: int = GAP_PROMPT,
                      first_id: int = 1 << 40) -> list[dict]:
    """Per batch size ``n``: ``n`` requests of ``prompt`` tokens arrive at once and each generates ``steps``
    tokens under the chunked policy with one decode step a launch (``serve()``, the engine every executor
    runs under); the gaps between back-to-back decode launches of all ``n`` (one's end to the next one's
    start, on the executor's clock) are summarised (median, p10, p90, count)."""
    from ..config import GPUS, SchedulerConfig
    from ..engine import serve
    from ..perfmodel.base import CachedLatency
    from ..perfmodel.roofline import RooflineModel
    from ..policies import make_scheduler
    from ..request import Request

    spec = executor.spec
    num_sms = (executor.menu or PartitionMenu.fallback()).num_sms
    gpu = next((g for g in GPUS.values() if g.num_sms == num_sms), GPUS["h200"])
    rows, rid = [], first_id
    for n in sizes:
        kv = BlockManager(executor.kv.num_blocks, executor.kv.block_size)
        cfg = SchedulerConfig(policy="chunked", max_num_seqs=n, max_batched_tokens=max(2048, prompt),
                              max_decode_steps=1)
        sched = make_scheduler(cfg, spec, gpu, kv, CachedLatency(RooflineModel(spec, gpu)))
        t = executor.now()
        reqs = [Request(rid + i, t, prompt, steps) for i in range(n)]
        rid += n
        res: list[StepResult] = []
        serve(reqs, sched, executor, on_step=res.append)
        full = [r for r in res if len(r.batch.chunks) == n and all(c.num_tokens == 1 for c in r.batch.chunks)]
        gaps = np.array([b.start - a.end for a, b in itertools.pairwise(full) if b.start >= a.end])
        if len(gaps) < 3:
            continue
        rows.append({"seqs": n, "gap_s": float(np.median(gaps)), "gap_p10_s": float(np.percentile(gaps, 10)),
                     "gap_p90_s": float(np.percentile(gaps, 90)), "launches": len(gaps)})
    return rows


def read_gaps(path: Path) -> list[dict]:
    """The rows of a gaps.csv as numbers (ValueError naming the line and field for a bad one)."""
    if not path.exists():
        return []
    out = []
    with path.open(newline="") as f:
        for i, r in enumerate(csv.DictReader(f), start=2):
            row = {}
            for col in GAP_COLUMNS:
                kind = int if col in ("seqs", "launches") else float
                try:
                    row[col] = v = kind(r.get(col) or "")
                except ValueError:
                    raise ValueError(f"{path}:{i}: field {col!r}: {r.get(col)!r} is not a number") from None
                if not v >= (1 if kind is int else 0) or v == float("inf"):
                    raise ValueError(f"{path}:{i}: field {col!r}: {r.get(col)!r} is out of range") from None
            out.append(row)
    return out


def write_gaps(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=GAP_COLUMNS)
        w.writeheader()
        w.writerows({k: (f"{v:.9g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- files

def read_points(path: Path) -> list[dict]:
    """The rows of a points.csv; a torn last line (an interrupted write) is dropped."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if r.get("reps") not in (None, "")]


def _append(path: Path, row: dict, fields: Sequence[str] = COLUMNS) -> None:
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerow(_formatted(row))
        f.flush()
        os.fsync(f.fileno())


def _write_rows(path: Path, rows: Sequence[dict], fields: Sequence[str] = COLUMNS) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(_formatted(r) for r in rows)
    os.replace(tmp, path)


def _formatted(row: dict) -> dict:
    return {k: (f"{v:.9g}" if isinstance(v, float) else v) for k, v in row.items()}


# A co-run point measured in several passes (``run_profile(corun_passes=K)``): every pass's row, with its number;
# likewise a solo decode point (``decode_passes=K``), in its own file.
PASSES_FILE = "corun_passes.csv"
DECODE_PASSES_FILE = "decode_passes.csv"
PASS_COLUMNS = ("pass", *COLUMNS)
_MEDIAN_COLUMNS = ("gpu_s", "first_s", "step_s", "host_s", "overlap")


def read_passes(path: Path) -> dict[str, list[dict]]:
    """A corun_passes.csv by point id, each point's passes in the order measured (a torn last line dropped)."""
    out: dict[str, list[dict]] = {}
    for r in read_points(path):
        out.setdefault(r["id"], []).append(r)
    return out


def median_row(passes: Sequence[dict]) -> dict:
    """A co-run or solo decode point from its passes: the features of the first; of each time (and the overlap) the median over
    the passes (the measured ones: a decode step no prefill covered is NaN); the fastest and slowest run; the
    runs counted; the median stretch (``steps``; the same in every pass where the decode point was measured
    solo first)."""
    def values(col: str) -> np.ndarray:
        return np.array([float(p[col]) for p in passes])

    row = {k: passes[0][k] for k in COLUMNS}
    for col in _MEDIAN_COLUMNS:
        v = values(col)
        v = v[~np.isnan(v)]
        row[col] = float(np.median(v)) if len(v) else float("nan")
    row.update(steps=int(np.median(values("steps"))), gpu_s_min=float(values("gpu_s_min").min()),
               gpu_s_max=float(values("gpu_s_max").max()), reps=int(values("reps").sum()))
    return row


def metadata(executor, spec: ModelSpec, weights: str, quick: bool, reps: int, points: int) -> dict:
    """Where and with what the points were measured."""
    import torch

    meta = {"profile_version": PROFILE_VERSION, "model": spec.name, "model_spec": _spec_dict(spec),
            "weights": weights, "grid": "quick" if quick else "full", "reps": reps, "points": points,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "bullet": _version(),
            "commit": _commit(), "source_sha256": _source_hash(), "device": str(executor.device),
            "host": platform.node(),
            "corun_protocol": dict(CORUN_PROTOCOL)}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if executor.cuda:
        props = torch.cuda.get_device_properties(executor.device)
        meta.update(gpu=props.name, num_sms=props.multi_processor_count, memory_bytes=props.total_memory,
                    cuda=torch.version.cuda, green_contexts=bool(executor.menu and executor.menu.green),
                    partitions=executor.menu.describe() if executor.menu else [])
        meta.update(_nvidia_smi())
    else:
        meta.update(gpu="cpu", num_sms=0)
    return meta


def _spec_dict(spec: ModelSpec) -> dict:
    """Every shape a fitted model is checked against (qkv_bias and qk_norm too: Qwen3 has a q/k norm)."""
    from ..perfmodel.fitted import SHAPE_KEYS

    return {k: getattr(spec, k) for k in SHAPE_KEYS}


def _nvidia_smi() -> dict:
    q = "driver_version,power.limit,clocks.max.sm,clocks.max.mem"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    driver, power, sm_clock, mem_clock = (x.strip() for x in out.split(","))
    return {"driver": driver, "power_limit_w": float(power), "max_sm_clock_mhz": float(sm_clock),
            "max_mem_clock_mhz": float(mem_clock)}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bullet")
    except PackageNotFoundError:
        return "unknown"


def _source_hash() -> str:
    """A hash of the bullet package's Python sources (paths and contents), which names the code that measured a
    profile even where the checkout's .git is stale or absent (a lent GPU machine's copy of a working tree)."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _commit() -> str | None:
    """The checkout's commit, with "+changes" when the tree differs from it (a copy of a working tree, as on
    a lent GPU machine, can carry a stale .git: then the commit alone would misname the code measured)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=here,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_profile(executor, out: Path, weights: str, quick: bool, reps: int = 3,
                on_point: Callable[[int, int, str], None] | None = None,
                prefill_graphs: bool = True, redo_coruns: bool = False, sizes: Sizes | None = None,
                twins: bool = False, corun_min: int = 0, corun_passes: int | None = None,
                corun_sweep: bool = False, decode_passes: int | None = None,
                corun_splits: bool = False) -> tuple[int, int]:
    """Measure every point of the grid not already in ``out/points.csv``; returns (measurements, points
    skipped). ``on_point(done, total, id)`` reports progress. ``prefill_graphs``: prefill and mixed launches
    that a prefill graph can serve replay one (captured before their first run), as in serving; the limits go
    into the metadata (``prefill_graphs``), where the fit reads which points ran without the eager host time.
    ``redo_coruns``: measure every co-run point again (their rows are replaced), e.g. after a change of
    :data:`CORUN_PROTOCOL`; a profile whose co-run points were measured otherwise is not resumed without it.
    ``sizes``, ``twins``, ``corun_min``, ``corun_sweep``: the grid's options (:func:`grid`); a resumed profile keeps those it was
    measured with (metadata.json's ``grid_options``) and adds these.

    ``corun_passes`` K > 1: the solo points first, then K passes over all co-run points (a point's passes spread
    over the run, not back to back); every pass's row goes to ``corun_passes.csv`` as it is measured, and once a
    point has K passes its row in points.csv is the :func:`median_row` of all its passes. A co-run row of a
    profile measured in one pass counts as its first pass (``redo_coruns`` measures all K afresh). A rerun
    measures only the passes still missing; None: the profile's own K (metadata.json's ``corun_passes``, 1
    where it has none), so a smaller K given to an interrupted profile ends it with the passes it has.

    ``decode_passes`` K > 1: the same for the solo decode points (their first step moves ~2.3 % between passes of a
    profile against 0.7 % between the runs of one: bench/RESULTS.md, "Decode first"), into ``decode_passes.csv``,
    after the other solo points and before the co-run passes, each pass in the reverse order of the one before (what
    ran just before a point differs between its passes); metadata.json's ``decode_passes``."""
    out.mkdir(parents=True, exist_ok=True)
    spec = executor.spec
    cpu = not executor.cuda
    menu = executor.menu or PartitionMenu.fallback()
    old_meta = _old_meta(out) or {}  # read once: the metadata is rewritten below, before the points
    passes_path = out / PASSES_FILE
    if redo_coruns and passes_path.exists():
        passes_path.unlink()
    opts = _grid_options(old_meta.get("grid_options", {}), sizes, twins, corun_min, corun_sweep, corun_splits)
    passes = corun_passes or int(old_meta.get("corun_passes", 1))
    dpasses = decode_passes or int(old_meta.get("decode_passes", 1))
    pts = grid(spec, (tuple(menu.prefill), tuple(menu.decode)), quick, cpu,
               executor.kv.num_blocks * executor.kv.block_size, **opts)
    path = out / "points.csv"
    have = {r["id"]: r for r in read_points(path)}
    if redo_coruns:
        have = {k: r for k, r in have.items() if not r["co_kind"]}
    if path.exists():  # rewrite without a torn tail (or the points to redo) before appending
        _write_rows(path, list(have.values()))
    meta = metadata(executor, spec, weights, quick, reps, len(pts))
    meta.update(grid_options=opts, corun_passes=passes)
    if dpasses > 1 or "decode_passes" in old_meta:
        meta["decode_passes"] = dpasses
    graphs = prefill_graphs and (executor.use_graphs or not executor.cuda)
    meta["prefill_graphs"] = executor.prefill_graph_limits if graphs else None
    meta["skinny_table"] = _skinny_meta(getattr(executor, "skinny_source", None))
    for key in ("prefill_graphs", "skinny_table"):  # the kernels a resumed profile's points ran
        if have and old_meta and old_meta.get(key) != meta[key]:
            raise ValueError(f"{out}: its points were measured with {key}={old_meta.get(key)}, this run would use "
                             f"{meta[key]}: profile into a new folder")
    old_protocol = old_meta.get("corun_protocol", {"name": "single burst"})
    if (any(r["co_kind"] for r in have.values()) or passes_path.exists()) and \
            old_protocol != meta["corun_protocol"]:
        raise ValueError(f"{out}: its co-run points were measured by the {old_protocol['name']!r} protocol, this "
                         f"run would use {meta['corun_protocol']}: add --redo-coruns to measure them again")
    for key in ("note", "gaps"):  # what a person recorded; the host gaps, measured once (kept if interrupted)
        if key in old_meta:
            meta[key] = old_meta[key]
    _write_json(out / "metadata.json", meta)
    prof = Profiler(executor, reps, graphs, CORUN_PROTOCOL["sustain_s"])
    for pid, row in have.items():  # co-runs size their stretches from earlier solo points
        prof.solo[pid] = float(row["gpu_s"])
    co_pts = [pt for pt in pts if pt.co is not None] if passes > 1 else []
    dec_pts = [pt for pt in pts if pt.co is None and pt.shape.kind == "decode"] if dpasses > 1 else []
    in_passes = {pt.id for pt in co_pts + dec_pts}
    total, done = len(pts) + (passes - 1) * len(co_pts) + (dpasses - 1) * len(dec_pts), 0

    def report(pid: str) -> None:
        nonlocal done
        done += 1
        if on_point is not None:
            on_point(done, total, pid)

    measured = skipped = 0
    for pt in pts:
        if pt.id in in_passes:
            continue
        if pt.id in have:
            skipped += 1
        else:
            _append(path, prof.measure(pt))
            measured += 1
        report(pt.id)
    for group, k, file, alternate in ((dec_pts, dpasses, DECODE_PASSES_FILE, True),
                                      (co_pts, passes, PASSES_FILE, False)):
        if group:
            runs, complete = _measure_passes(prof, out, group, have, k, report, file, alternate)
            measured, skipped = measured + runs, skipped + complete
    gaps = out / "gaps.csv"
    if not gaps.exists():  # measured once, like the points (delete the file to measure again)
        write_gaps(gaps, measure_host_gaps(executor, GAP_SIZES if not cpu else (1, 4, 16)))
        meta["gaps"] = {"measured": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                        "commit": meta.get("commit"), "policy": "chunked", "steps": GAP_STEPS, "prompt": GAP_PROMPT}
    meta["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    _write_json(out / "metadata.json", meta)
    return measured, skipped


def _measure_passes(prof: Profiler, out: Path, pts: Sequence[Point], have: dict[str, dict], passes: int,
                    report: Callable[[str], None], file: str = PASSES_FILE,
                    alternate: bool = False) -> tuple[int, int]:
    """``passes`` passes over the points ``pts`` (each pass measures every point still short of it; ``alternate``:
    each pass in the reverse order of the one before), each row appended to ``file`` (corun_passes.csv or
    decode_passes.csv), and the point's row in points.csv replaced by the median of its passes so
    far at once: a run stopped at a time limit leaves points.csv with every pass measured (before, the medians were
    written only at the end, so an interrupted run left the first pass's rows and no row for a new point). At the
    end every point's row is the median of all its passes. Returns (runs measured, points that needed none)."""
    path = out / file
    done = read_passes(path)
    if path.exists():  # rewrite without a torn tail before appending
        _write_rows(path, read_points(path), PASS_COLUMNS)
    for pt in pts:  # a row measured in one pass (no record of passes) is the point's first pass
        if pt.id in have and pt.id not in done:
            _append(path, {"pass": 1, **{k: have[pt.id][k] for k in COLUMNS}}, PASS_COLUMNS)
            done[pt.id] = [have[pt.id]]
    complete = sum(len(done.get(pt.id, [])) >= passes for pt in pts)
    runs = 0
    for k in range(1, passes + 1):
        for pt in (pts[::-1] if alternate and k % 2 == 0 else pts):
            if len(done.setdefault(pt.id, [])) < k:
                row = prof.measure(pt)
                _append(path, {"pass": len(done[pt.id]) + 1, **row}, PASS_COLUMNS)
                done[pt.id].append(row)
                runs += 1
                _put_medians(out / "points.csv", {pt.id: done[pt.id]})
            report(pt.id)
    ids = {pt.id for pt in pts}
    _put_medians(out / "points.csv", {pid: rows for pid, rows in read_passes(path).items() if pid in ids})
    return runs, complete


def _put_medians(points: Path, passes: dict[str, list[dict]]) -> None:
    """Each point's row in ``points`` becomes the :func:`median_row` of its ``passes``: in place where it had a
    row, else appended."""
    medians = {pid: median_row(rows) for pid, rows in passes.items() if rows}
    rows = [medians.pop(r["id"], r) for r in read_points(points)]
    _write_rows(points, rows + list(medians.values()))


def _grid_options(old: dict, sizes: Sizes | None, twins: bool, corun_min: int, corun_sweep: bool = False,
                  corun_splits: bool = False) -> dict:
    """This run's grid options joined with those a resumed profile was measured with (points are never
    dropped: the grid only grows). ``corun_sweep`` and ``corun_splits`` are recorded only once they are on (older
    profiles' options stay as they were written)."""
    if old.get("sizes") == "all":
        sizes = "all"
    opts = {"sizes": sizes or old.get("sizes"), "twins": twins or bool(old.get("twins")),
            "corun_min": max(corun_min, int(old.get("corun_min", 0)))}
    if corun_sweep or old.get("corun_sweep"):
        opts["corun_sweep"] = True
    if corun_splits or old.get("corun_splits"):
        opts["corun_splits"] = True
        if not opts["corun_min"]:
            raise ValueError("--corun-all-splits adds co-run pairs up to --corun-min N on every split: give N (the "
                             "profile has no --corun-min)")
    return opts


def resumed_grid_options(out: Path, sizes: Sizes | None = None, twins: bool = False, corun_min: int = 0,
                         corun_sweep: bool = False, corun_splits: bool = False) -> dict:
    """The grid options a run of ``bullet profile`` into ``out`` measures with (:func:`_grid_options` of the
    profile's own and this run's); ValueError for a combination that makes no grid. The CLI asks before it
    starts the executor."""
    return _grid_options((_old_meta(out) or {}).get("grid_options", {}), sizes, twins, corun_min, corun_sweep,
                         corun_splits)


def _skinny_meta(path: str | None) -> dict | None:
    """Which skinny GEMM table the decode products used (``GpuExecutor(skinny=...)``): its file name and
    content hash, or None (cuBLAS everywhere)."""
    if path is None:
        return None
    import hashlib

    data = Path(path).read_bytes()
    return {"file": Path(path).name, "sha256": hashlib.sha256(data).hexdigest()[:16],
            "choices": len(json.loads(data).get("choices", []))}


def _old_meta(out: Path) -> dict | None:
    try:
        return json.loads((out / "metadata.json").read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
