"""GpuExecutor: the real-hardware side of the Executor protocol (bullet/batch.py).

``launch`` enqueues a Batch on its lane's stream: lane "all" on a whole-GPU stream; lanes "prefill" and
"decode" on the nested menu's green context of exactly ``batch.partition.num_sms`` SMs (partitions.py); a
split lane asking for the whole GPU (naive concurrency) gets one of two ordinary streams. A size the menu
lacks, or one that overlaps the other lane's launch in flight, is a PartitionError (``check_launch``, the
simulator's rule too). On device "cpu" everything runs eagerly on the host inside ``launch`` (tests and
development; the rule is checked where a menu is given).

Timing: CUDA events around each launch (and one per fused step). Their times are converted to the
executor's clock (``time.perf_counter()`` since creation) through a reference event recorded, and waited
for, at creation: ``t = t_ref + ref.elapsed_time(event)``. They are the GPU's own start/end, not the moment
the host noticed (which can be later by the polling interval); the GPU timer and the host clock may drift
apart by a few ppm over a long run. On the CPU path the host clock is read around each step.

Inputs: ``Chunk.token_ids`` where the host has them; otherwise positions before a request's first sampled
token get deterministic synthetic ids (:func:`synthetic_ids`, seeded by request id and position), the
position of the last sampled token is fed from a per-request device-side slot (no host round trip), and
older output positions (recompute after preemption) come from the tokens already read back.

Layer-granular prefill: a launch whose ``layers`` stop short of the last layer keeps its hidden state on the
executor (one per lane) for the launch that continues it; only the launch that reaches the last layer
samples. Decode launches whose chunks fit a graph bucket replay decode CUDA graphs (graphs.py) captured on
the very partition they run on; ``steps > 1`` runs the chunks as given (eagerly if some have several tokens)
and then ``steps - 1`` decode steps of every chunk, replaying the step graph back to back, each step feeding
its sampled ids to the next on the device (the block tables loaded for the first step already cover every step:
``steps`` fused steps need each request's table to hold ``start + steps`` tokens at launch).

Prefill and mixed launches of up to ``max(token_buckets)`` tokens and ``graph_max_seqs`` chunks replay a
prefill graph (prefill_graphs.py) where ``capture_prefill`` captured one for their partition, token bucket,
layer range and sampling mode; the others run eagerly. Their attention is one kernel call per layer over the
pool (``build_meta(..., block_q=...)``: the model's tile size) in both cases.

The only host sync per launch is the one that reads the sampled tokens (after the end event); ``wait``
blocks on an event only while a single lane is in flight, and otherwise polls every lane's end event (so the
lane that finishes first is seen first). Metadata and inputs go to the device from pinned memory,
asynchronously (a copy from pageable memory would wait for the lane's stream to drain).

Options: ``kv_layout`` is the pool's order within a block (``PagedKvCache``: "hnd" or "nhd");
``one_token_gemv`` the launch options of the fused GEMV path for one-token forwards (batch-1 decode; see
``kernels/gemv.py``): "default" takes ``GEMV_DEFAULT`` on CUDA and cuBLAS on the CPU, None always cuBLAS;
``skinny`` the table of (partition, rows, product) choices of the skinny GEMM for multi-row decode products
(``kernels/skinny.py``): "auto" loads the one shipped for this GPU and model where there is one, a path that
file, None none (cuBLAS).

Lifetime: ``close()`` synchronizes and drops the graphs and pinned buffers, which were used on the menu's
streams; close the executor before closing a menu it was given (a menu it made itself it closes).
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..batch import Batch, Chunk, Lane, Partition, StepResult, check_launch
from ..config import PROFILES_DIR, ConfigError, ModelSpec, gpu_short_name
from .attention import build_meta, warm_prefill
from .graphs import DEFAULT_BUCKETS, LaneGraphs
from .kernels.decode_attention import DECODE_TARGET_PROGRAMS, launch_defaults, paged_decode_attention
from .kernels.gemv import GEMV_DEFAULT
from .kernels.skinny import load_table
from .kvcache import PagedKvCache
from .model import Model, logits_rows
from .partitions import PartitionMenu, Side
from .prefill_graphs import DEFAULT_TOKEN_BUCKETS, PrefillGraphs, leading_decode
from .sampling import sample
from .weights import load_weights

_MIX = np.uint64(0x9E3779B97F4A7C15)
LOGITS_WARM_ROWS = 1024  # the warm-up runs the lm_head product at every padded row count up to this
HELD_PER_LANE = 2  # hidden states of unfinished layer-sliced jobs a lane keeps: the current one and one paused


def synthetic_ids(req_id: int, start: int, n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Deterministic prompt ids of positions ``[start, start + n)`` of request ``req_id`` (int64)."""
    pos = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = pos * _MIX + np.uint64((req_id * 1_000_003 + seed * 7919 + 1) & 0xFFFFFFFFFFFF)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
    return (x % np.uint64(vocab)).astype(np.int64)


@dataclass(slots=True)
class _ReqState:
    slot: int  # index into the device-side last-token array
    next_pos: int = -1  # position of the last sampled token (the next decode input), -1: none yet
    out_start: int | None = None  # position of the first sampled token (== prompt length)
    seen: int = 0  # positions [0, seen) have been inputs of this executor (their ids are known here)
    outputs: list[int] = field(default_factory=list)  # sampled ids read back, in position order
    table: np.ndarray | None = None  # host copy of the block table (int32), grown by appends
    table_len: int = 0
    table_src: object = None  # the Chunk.block_ids object it mirrors (the block manager's live list)


@dataclass(slots=True)
class _Flight:
    batch: Batch
    order: int
    cols: np.ndarray  # chunk columns (batch order) that sample, matching the device token columns
    req_ids: tuple[int, ...]  # the sampling chunks' requests (in ``cols`` order)
    start_ev: object = None
    step_evs: list = field(default_factory=list)
    done_ev: object = None
    host: torch.Tensor | None = None  # pinned (steps, len(cols)) sampled ids
    times: tuple[float, float, list[float]] | None = None  # CPU path: host start, end, step ends
    tokens: np.ndarray | None = None  # CPU path
    work: object = None  # CUDA: the launch's generator while part of it is still to be enqueued
    turn: int = 0  # when ``_advance`` last enqueued a piece of it (or it was made): lanes take turns by it
    side: Side | None = None


@dataclass(slots=True)
class _Held:
    """Hidden state of a layer-sliced prefill between launches on one lane."""

    stop: int
    hidden: torch.Tensor
    stream: object
    event: object


def host_memory_available() -> int | None:
    """Bytes of memory available to a new allocation on this host (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(spec: ModelSpec, dtype: torch.dtype, available: int | None = None) -> None:
    """Refuse, before any allocation, a model whose weights in ``dtype`` would not fit the host's available memory
    (an 8B model in float32 on a 24 GiB machine was killed by the kernel's OOM killer, with no message)."""
    available = host_memory_available() if available is None else available
    need = spec.weight_bytes // spec.dtype_bytes * dtype.itemsize
    if available is not None and need > available:
        raise ValueError(f"{spec.name}'s weights need {need / 1e9:.1f} GB in {str(dtype).removeprefix('torch.')} on "
                         f"the CPU, this host has {available / 1e9:.1f} GB available: use a smaller model "
                         "(--model tiny-llama) or a GPU")


class GpuExecutor:
    def __init__(self, spec: ModelSpec, weights_source: str = "dummy", device: str | torch.device = "cuda", *,
                 block_size: int = 16, num_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 reserved_bytes: int = 4 << 30, menu: PartitionMenu | None = None, use_graphs: bool = True,
                 seed: int = 0, dtype: torch.dtype | None = None, weights: dict | None = None,
                 max_requests: int = 16384, graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
                 graph_max_context: int = 16384, poll_s: float = 0.0, kv_layout: str = "hnd",
                 one_token_gemv: dict | None | str = "default",
                 token_buckets: Sequence[int] = DEFAULT_TOKEN_BUCKETS, graph_max_seqs: int = 64,
                 skinny: str | Path | None = "auto") -> None:
        self._t0 = time.perf_counter()
        self.spec = spec
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype or (torch.bfloat16 if self.cuda else torch.float32)
        self.seed = seed
        self.poll_s = poll_s  # sleep between event polls while several lanes are in flight (0: yield)
        self.block_size = block_size
        if weights is None:
            if not self.cuda:
                check_host_memory(spec, self.dtype)
            weights = load_weights(spec, weights_source, self.device, self.dtype, seed=seed)
        self.model = Model(spec, weights, self.device, self.dtype)
        del weights
        if one_token_gemv == "default":  # the fused GEMV path for one-token forwards, on CUDA only
            one_token_gemv = dict(GEMV_DEFAULT) if self.cuda else None
        self.model.gemv_config = one_token_gemv
        self.skinny_source = self._load_skinny(skinny)  # the skinny GEMM table decode products use (or None)
        if num_blocks is None:
            if not self.cuda:
                raise ValueError("GpuExecutor on the CPU needs num_blocks")
            num_blocks = PagedKvCache.blocks_for_memory(spec, block_size, gpu_memory_utilization,
                                                        reserved_bytes, self.device)
        self.kv = PagedKvCache(spec, num_blocks, block_size, self.device, self.dtype, layout=kv_layout)
        self.menu = menu
        self._own_menu = self.cuda and menu is None
        if self._own_menu:
            self.menu = PartitionMenu.create(self.device.index)
        self.use_graphs = use_graphs and self.cuda
        self.graph_buckets = tuple(graph_buckets)  # batch sizes decode graphs are captured for
        self._graph_args = {"buckets": self.graph_buckets, "max_context": graph_max_context}
        self._graphs: dict[Lane, LaneGraphs] = {}
        # prefill / mixed launches of up to max(token_buckets) tokens and graph_max_seqs chunks replay a graph
        # where one was captured for their partition, bucket and layers (capture_prefill), else run eagerly
        self._pgraph_args = {"buckets": tuple(token_buckets), "max_seqs": graph_max_seqs,
                             "max_context": graph_max_context}
        self.prefill_graphs: dict[Lane, PrefillGraphs] = {}  # by lane (capture_prefill)
        self._last = torch.zeros(max_requests, dtype=torch.int64, device=self.device)
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._reqs: dict[int, _ReqState] = {}
        self._inflight: dict[Lane, _Flight] = {}
        self._queued: dict[Lane, _Flight] = {}  # a launch enqueued behind the lane's flight (async scheduling)
        # hidden states of layer-sliced prefill jobs between launches, by (lane, job): a policy may pause a job
        # between slices to run a more urgent one first, so a lane holds up to HELD_PER_LANE of them
        self._held: dict[tuple[Lane, tuple], _Held] = {}
        self._order = 0
        self._turn = 0  # counts flights made and pieces enqueued (``_Flight.turn``)
        # CUDA events and pinned read-back buffers, made once and reused (not allocated for each launch)
        self._timing_events: list = []
        self._done_events: list = []
        self._host_bufs: dict[tuple[Lane, int], torch.Tensor] = {}
        self._flip: dict[Lane, int] = {}  # which of a lane's two read-back buffers its next launch uses
        self._ref = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record(torch.cuda.current_stream(self.device))
            self._ref.synchronize()
            self._t_ref = self.now()

    def _load_skinny(self, choice: str | Path | None) -> str | None:
        """Give the model a skinny GEMM table (``kernels.skinny``): a path, or ``"auto"``: the one shipped for
        this GPU and model (``profiles/<gpu>/<model>/skinny.json``) if there is one, skipped with a warning if
        it was measured on another GPU; None or on the CPU: none. Returns the table's path."""
        if choice is None or not self.cuda:
            return None
        gpu = torch.cuda.get_device_name(self.device)
        path = PROFILES_DIR / gpu_short_name(gpu) / self.spec.name / "skinny.json" if choice == "auto" else Path(choice)
        if choice == "auto" and not path.exists():
            return None
        try:
            self.model.skinny = load_table(path, self.spec, gpu)
        except ConfigError as e:
            if choice != "auto":
                raise
            warnings.warn(f"{e}: decode products stay on cuBLAS", stacklevel=3)
            return None
        return str(path)

    # ------------------------------------------------------------------ protocol
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def busy(self, lane: Lane) -> bool:
        return lane in self._inflight

    def queued(self, lane: Lane) -> bool:
        return lane in self._queued

    def launch(self, batch: Batch) -> None:
        """Enqueue ``batch`` on its lane's stream. On a busy lane (async scheduling) it is queued behind the
        launch in flight: that one is enqueued to its end first (the queued one reads the last tokens it
        writes, and its pieces are not interleaved with another lane's any more), then all of this one; the
        stream runs them in order."""
        lane = batch.lane
        head = self._inflight.get(lane)
        if head is not None and lane in self._queued:
            raise RuntimeError(f"GpuExecutor.launch: lane {lane!r} already has a batch in flight and one queued")
        if not batch.chunks:
            raise ValueError("GpuExecutor.launch: empty batch")
        layers = batch.layers
        L = self.spec.num_layers
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= L:
            raise ValueError(f"GpuExecutor.launch: layers {layers} is not a slice of 0..{L}")
        if batch.steps > 1 and (layers.start, layers.stop) != (0, L):
            raise ValueError("GpuExecutor.launch: fused decode steps need all layers")
        if self.menu is not None:
            check_launch(batch, (f.batch for f in self._inflight.values() if f.batch.lane != lane),
                         {"prefill": self.menu.prefill, "decode": self.menu.decode, "all": (self.menu.num_sms,)},
                         self.menu.num_sms)
        if head is not None:
            while head.work is not None:
                self._advance(head)
        self._order += 1
        f = self._run_cuda(batch, self._side(batch)) if self.cuda else self._run_cpu(batch)
        if head is None:
            self._inflight[lane] = f
            self._advance(f)
        else:
            self._queued[lane] = f
            while f.work is not None:
                self._advance(f)

    def wait(self, until: float | None = None) -> list[StepResult]:
        while True:
            done = [f for f in self._inflight.values()
                    if f.work is None and (f.times is not None or f.done_ev.query())]
            if done:
                return [self._finish(f) for f in self._by_end(done)]
            pending = [f for f in self._inflight.values() if f.work is not None]
            if pending:  # enqueue a piece of the launch that waited longest, then look at the lanes again
                self._advance(min(pending, key=lambda f: f.turn))
                if until is not None and self.now() >= until:
                    return []
                continue
            if not self._inflight:
                if until is not None:
                    left = until - self.now()
                    if left > 0:
                        time.sleep(left)
                return []
            if until is None and len(self._inflight) == 1:
                next(iter(self._inflight.values())).done_ev.synchronize()
                continue
            if until is not None and self.now() >= until:
                return []
            # several lanes in flight: poll them all, so the first to finish is seen first
            time.sleep(self.poll_s)

    def warmup(self, max_prompt: int = 8192) -> int:
        """Build the prefill attention plans for every padded prompt length up to ``max_prompt`` (each
        new length otherwise costs ~70 ms in the middle of serving), then run a few eager launches of the
        kinds serving makes, so every kernel variant they need is compiled now (on the H200 the first
        multi-prompt and mixed launches of a fresh process took 0.2-0.9 s each, against ~50 ms); returns how
        many prompt lengths."""
        if not self.cuda:
            return 0
        n = warm_prefill(self.spec, self.device, self.dtype, max_prompt, self.model.prefill_config)
        self._warm_eager()
        self._warm_variants()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up's activations (3 GiB cached for Llama-3.1-8B on the H200)
        freeze_heap()
        return n

    def _warm_eager(self) -> None:
        """Eager launches on the whole GPU (compiled kernels serve every partition), of :func:`warm_shapes`;
        the KV they write is garbage nobody reads."""
        from ..kvcache import BlockManager

        kv = BlockManager(self.kv.num_blocks, self.kv.block_size)
        sms = self.menu.num_sms if self.menu is not None else \
            torch.cuda.get_device_properties(self.device).multi_processor_count
        rid = 1 << 41
        bs = self.kv.block_size
        for prefill, decode in warm_shapes(self.spec):
            need = sum(-(-c // bs) for c in decode) + sum(-(-(n + p) // bs) for n, p in prefill)
            if need > kv.num_free:  # a pool sized small (--num-blocks): warm what fits
                continue
            chunks = shape_chunks(kv, rid, prefill, decode)
            rid += len(chunks)
            self.launch(Batch(Partition("all", sms), range(self.spec.num_layers), tuple(chunks)))
            while self.busy("all"):
                self.wait(None)
            for c in chunks:
                kv.free(c.req_id)
                self.release(c.req_id)

    def _warm_variants(self) -> None:
        """Kernels whose shape or options an eager launch picks at run time, run once now: the lm_head
        product at every :func:`~bullet.gpu.model.logits_rows` bucket up to ``LOGITS_WARM_ROWS`` rows, and the
        decode attention (one slice and split) with each partition size's launch options. The first call of
        a new cuBLAS shape or Triton variant waits for the whole GPU to drain (a Triton one compiles first):
        240 ms on the H200 with the other lane busy (bench/RESULTS.md, twenty-third session)."""
        m = self.model
        h = torch.zeros((LOGITS_WARM_ROWS, self.spec.hidden_size), device=self.device, dtype=self.dtype)
        n = 2
        while n <= LOGITS_WARM_ROWS:
            m.logits(h, torch.arange(n, device=self.device), pad=True)
            n = logits_rows(n + 1)
        sizes = {None} if self.menu is None else {*self.menu.prefill, *self.menu.decode, self.menu.num_sms}
        configs = {tuple(sorted({**launch_defaults(s), **m.decode_config}.items())) for s in sizes}
        spec, kv = self.spec, self.kv
        k_cache, v_cache = kv.layer(0)
        ctx = 4 * self.block_size
        table = torch.arange(16, device=self.device, dtype=torch.int32).remainder(kv.num_blocks).view(1, 16)
        q = torch.zeros((1, spec.heads_per_gpu, spec.head_dim), device=self.device, dtype=self.dtype)
        lens = torch.full((1,), ctx, device=self.device, dtype=torch.int32)
        for cfg in configs:
            for splits in (1, 2):
                paged_decode_attention(q, k_cache, v_cache, table, lens, m.scale, ctx,
                                       **{**dict(cfg), "num_splits": splits})

    def release(self, req_id: int) -> None:
        """Forget a finished request: its last-token slot and read-back tokens."""
        st = self._reqs.pop(req_id, None)
        if st is not None:
            self._free_slots.append(st.slot)

    def close(self) -> None:
        """Finish the device's work and drop the graphs and pinned buffers (they were used on the menu's
        streams, which must outlive them), then close the menu if this executor made it."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self.prefill_graphs.clear()  # their buffers were used on green streams: free them while those live
        self._inflight.clear()
        self._queued.clear()
        self._held.clear()
        # pinned read-back buffers record an event on the streams they were copied on when they are freed: a
        # buffer outliving its green stream aborts the process at exit (measured on the H200: "context is
        # destroyed" from ~TensorImpl after close())
        self._host_bufs.clear()
        self._timing_events.clear()
        self._done_events.clear()
        if self.cuda:  # let the host allocator settle those events while the streams still exist
            torch.cuda.synchronize(self.device)
            getattr(torch._C, "_host_emptyCache", lambda: None)()
        if self._own_menu:  # a menu passed in belongs to the caller
            self.menu.close()

    # ------------------------------------------------------------------ streams
    def _side(self, batch: Batch) -> Side:
        if self.menu is None:
            raise RuntimeError("GpuExecutor: no partition menu on a CUDA device")
        return self.menu.side(batch.lane, batch.partition.num_sms)

    def graphs(self, lane: Lane) -> LaneGraphs:
        g = self._graphs.get(lane)
        if g is None:
            g = self._graphs[lane] = LaneGraphs(self.model, self.kv, self.device, **self._graph_args)
        return g

    def capture(self, lane: Lane, num_sms: int, sizes: Sequence[int], greedy: bool = True) -> None:
        """Capture decode graphs ahead of use for ``lane`` on the partition a batch with ``num_sms`` gets."""
        if not self.use_graphs:
            return
        side = self.menu.side(lane, num_sms)
        with torch.cuda.stream(side.stream), self.model.on_sms(side.num_sms):
            # largest first: a graph's activations stay in the lane's pool, and a smaller batch's fit into the
            # blocks a larger one freed, while smallest first each bucket wanted bigger blocks than any freed
            # (0.6 GiB kept per decode size, growing ~1 MB a row per bucket, on the H200: bench/RESULTS.md)
            for bs in sorted(sizes, reverse=True):
                self.graphs(lane).capture(side, bs, greedy)

    def capture_prefill(self, lane: Lane, num_sms: int, buckets: Sequence[int] | None = None,
                        layer_ranges: Sequence[range] | None = None, greedy: Sequence[bool] = (True,),
                        decode_rows: Sequence[bool] = (False,)) -> int:
        """Capture prefill/mixed-launch graphs ahead of use for ``lane`` on the partition a batch with
        ``num_sms`` gets: every token bucket (default: all) x layer range (default: all layers) x sampling
        mode x ``decode_rows`` variant (True: leading decode rows through the decode kernel, for lanes whose
        launches carry decode rows: ``PrefillGraphs.key``). Returns how many graphs the lane has. On the CPU
        the "graphs" re-run the same body (tests)."""
        if self.cuda and not self.use_graphs:
            return 0
        pg = self._lane_prefill_graphs(lane)
        side = self.menu.side(lane, num_sms) if self.cuda else None
        for b in sorted(buckets or pg.buckets, reverse=True):  # largest first, as decode graphs (capture)
            for layers in layer_ranges or (range(self.spec.num_layers),):
                for g in greedy:
                    for dec in decode_rows:
                        pg.capture(side, b, layers, g, dec)
        return len(pg.graphs)

    def capture_prefill_for(self, batch: Batch, greedy: bool = True) -> bool:
        """Capture the prefill graph a launch of ``batch`` would replay (its partition, token bucket, layers);
        False where none can serve it (too many tokens or chunks, or one-token rows only: decode graphs)."""
        if all(c.num_tokens == 1 for c in batch.chunks) or (self.cuda and not self.use_graphs):
            return False
        pg = self._lane_prefill_graphs(batch.lane)
        b = pg.bucket(batch.chunks)
        if b is None:
            return False
        side = self.menu.side(batch.lane, batch.partition.num_sms) if self.cuda else None
        pg.capture(side, b, batch.layers, greedy, leading_decode(batch.chunks) > 0)
        return True

    def _lane_prefill_graphs(self, lane: Lane) -> PrefillGraphs:
        pg = self.prefill_graphs.get(lane)
        if pg is None:
            pg = self.prefill_graphs[lane] = PrefillGraphs(self.model, self.kv, self.device, **self._pgraph_args)
        return pg

    @property
    def prefill_graph_limits(self) -> dict:
        """The largest launch a prefill graph serves (tokens, chunks), and the token buckets."""
        b = sorted(self._pgraph_args["buckets"])
        return {"max_tokens": b[-1], "max_seqs": self._pgraph_args["max_seqs"], "buckets": b}

    def _prefill_graph(self, lane: Lane, side: Side | None, chunks: Sequence[Chunk], samp: Sequence[Chunk],
                       x: torch.Tensor, layers: range) -> torch.Tensor | None:
        """Run the launch through a captured prefill graph where one fits: the hidden state (a slice that
        stops short) or the sampled ids ``[len(samp)]``; None: no graph (run it eagerly)."""
        pg = self.prefill_graphs.get(lane)
        if pg is None or (b := pg.bucket(chunks)) is None:
            return None
        full = layers.stop == self.spec.num_layers
        greedy, temp, top_p, seeds, offsets = self._sampling_args(samp, 1) if full else (True,) * 5
        # leading decode rows take the decode kernel in the variant captured for them, where there is one
        dec = leading_decode(chunks) > 0 and pg.key(side, b, layers, greedy, True) in pg.graphs
        if pg.key(side, b, layers, greedy, dec) not in pg.graphs:
            return None
        return pg.run(side, chunks, x, b, layers, greedy, None if greedy else (temp, top_p, seeds, offsets), dec,
                      self._block_table)

    # ------------------------------------------------------------------ inputs
    def _state(self, req_id: int) -> _ReqState:
        st = self._reqs.get(req_id)
        if st is None:
            if not self._free_slots:
                raise RuntimeError("GpuExecutor: out of last-token slots (release finished requests)")
            st = self._reqs[req_id] = _ReqState(self._free_slots.pop())
        return st

    def _host_inputs(self, chunks: Sequence[Chunk]) -> tuple[np.ndarray, list[int], list[int]]:
        """Host ids of every row, plus (rows, slots) of the rows fed from the device-side last tokens."""
        T = sum(c.num_tokens for c in chunks)
        ids = np.zeros(T, dtype=np.int64)
        rows: list[int] = []
        slots: list[int] = []
        row = 0
        vocab = self.spec.vocab_size
        for c in chunks:
            n = c.num_tokens
            st = self._state(c.req_id)
            if c.token_ids is not None:
                if len(c.token_ids) != n:
                    raise ValueError(f"request {c.req_id}: chunk has {len(c.token_ids)} ids for {n} tokens")
                ids[row:row + n] = c.token_ids
            else:
                stop = c.start + n
                if c.start > st.seen and c.start != st.next_pos:
                    raise ValueError(f"request {c.req_id}: a chunk at position {c.start} without token ids, but "
                                     f"this executor has seen only positions [0, {st.seen}) of it: a prefix-"
                                     "cache hit on synthetic ids would attend to another prompt's KV (give the "
                                     "request prompt_ids, e.g. bullet.traces.materialize_prompt_ids)")
                prompt_end = stop if st.out_start is None else min(stop, st.out_start)
                if prompt_end > c.start:
                    ids[row:row + prompt_end - c.start] = synthetic_ids(c.req_id, c.start, prompt_end - c.start,
                                                                       vocab, self.seed)
                for p in range(max(c.start, prompt_end), stop):
                    k = p - st.out_start
                    if p == st.next_pos:  # the last sampled token: straight from the device
                        rows.append(row + p - c.start)
                        slots.append(st.slot)
                    elif k < len(st.outputs):  # recompute after preemption: ids read back earlier
                        ids[row + p - c.start] = st.outputs[k]
                    else:
                        raise ValueError(f"request {c.req_id}: no token id for position {p}")
            st.seen = max(st.seen, c.start + n)
            row += n
        return ids, rows, slots

    def _device_ids(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        ids, rows, slots = self._host_inputs(chunks)
        k = len(rows)
        host = np.concatenate([ids, np.asarray(rows, np.int64), np.asarray(slots, np.int64)])
        dev = self._to_device(host)
        out = dev[:len(ids)]
        if k:
            out.index_copy_(0, dev[len(ids):len(ids) + k], self._last.index_select(0, dev[len(ids) + k:]))
        return out

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _sampling_args(self, chunks: Sequence[Chunk], steps: int):
        """(greedy, temperature, top_p, seeds, offsets) device tensors for the sampling chunks."""
        if all(c.sampling.temperature == 0 for c in chunks):
            return True, None, None, None, None
        n = len(chunks)
        temp = np.array([c.sampling.temperature for c in chunks], np.float32)
        top_p = np.array([c.sampling.top_p for c in chunks], np.float32)
        seeds = np.array([c.sampling.seed if c.sampling.seed is not None
                          else (self.seed * 1_000_003 + c.req_id) & 0x7FFFFFFF for c in chunks], np.int64)
        offsets = np.array([c.start + c.num_tokens for c in chunks], np.int64)  # position sampled
        f = self._to_device(np.concatenate([temp, top_p]))
        i = self._to_device(np.concatenate([seeds, offsets]))
        return False, f[:n], f[n:], i[:n], i[n:]

    # ------------------------------------------------------------------ the step
    def _order_chunks(self, batch: Batch) -> tuple[list[int], list[Chunk]]:
        """One-token chunks first (the attention's decode rows), stable otherwise."""
        chunks = tuple(batch.chunks)  # (a DecodeChunks made once, not read per index)
        perm = sorted(range(len(chunks)), key=lambda j: chunks[j].num_tokens != 1)
        return perm, [chunks[j] for j in perm]

    def _forward_steps(self, batch: Batch, side: Side | None, record) -> tuple[torch.Tensor | None, list[int]]:
        """Run the batch (all steps) on the current stream. Returns device tokens (steps, k) for the
        sampling chunks (None for a partial layer slice) and their batch columns. ``record()`` is called
        after each step's sampling."""
        lane, L = batch.lane, self.spec.num_layers
        perm, chunks = self._order_chunks(batch)
        key = self._job_key(lane, chunks)
        layers = batch.layers
        if layers.start > 0:
            held = self._held.get(key)
            if held is None or held.stop != layers.start:
                raise RuntimeError(f"GpuExecutor: lane {lane!r} has no hidden state for {layers} of this batch")
            x = held.hidden
            if self.cuda and held.stream is not side.stream:
                torch.cuda.current_stream(self.device).wait_event(held.event)
                x.record_stream(torch.cuda.current_stream(self.device))
        else:
            x = self._device_ids(chunks)
        sampling = [j for j, c in enumerate(chunks) if c.sample]
        cols = [perm[j] for j in sampling]
        if layers.stop < L:
            hidden = self._prefill_graph(lane, side, chunks, (), x, layers)
            if hidden is not None:  # a view of the lane's graph buffer, which the slice of another job (one run
                hidden = hidden.clone()  # while this one is set aside) would overwrite: hold a copy
            else:
                meta = build_meta(chunks, self.block_size, self.device, block_q=self.model.block_q,
                                  table=self._block_table)
                hidden = yield from self.model.forward_iter(x, layers, meta, self.kv)
            ev = None
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record()
            self._hold(key, _Held(layers.stop, hidden, side.stream if side else None, ev))
            record()
            return None, cols
        self._held.pop(key, None)
        samp = [chunks[j] for j in sampling]
        steps = batch.steps
        slots = None
        if samp:
            slots = self._to_device(np.array([self._state(c.req_id).slot for c in samp], np.int64))
        if layers.start == 0 and self._graph_ok(lane, chunks, samp, steps):  # (a slice's x is hidden state)
            toks = yield from self._graph_steps(lane, side, chunks, x, steps, record)
        else:
            first = self._prefill_graph(lane, side, chunks, samp, x, layers)
            if first is None:
                toks = yield from self._eager_steps(chunks, sampling, x, layers, 1, record)
            else:
                toks = first[None, :].clone() if samp else None
                record()
            if steps > 1:  # a mixed first step, then steps - 1 decode steps of every chunk (all sample)
                dec = [Chunk(c.req_id, c.start + c.num_tokens, 1, c.block_ids, True, None, c.sampling)
                       for c in samp]
                if self._graph_ok(lane, dec, dec, steps - 1):
                    rest = yield from self._graph_steps(lane, side, dec, toks[0], steps - 1, record)
                else:
                    rest = yield from self._eager_steps(dec, range(len(dec)), toks[0], range(L), steps - 1, record)
                toks = torch.cat([toks, rest])
        if samp:
            self._last.index_copy_(0, slots, toks[-1])
            for c in samp:
                st = self._state(c.req_id)
                st.next_pos = c.start + c.num_tokens + steps - 1
                st.seen = max(st.seen, st.next_pos)
                if st.out_start is None:
                    st.out_start = c.start + c.num_tokens
        return toks, cols

    def _graph_ok(self, lane: Lane, chunks: Sequence[Chunk], samp: Sequence[Chunk], steps: int) -> bool:
        return (self.use_graphs and len(samp) == len(chunks)
                and all(c.num_tokens == 1 for c in chunks)
                and self.graphs(lane).fits(chunks, steps) is not None)

    def _graph_steps(self, lane: Lane, side: Side, chunks, ids, steps: int, record) -> torch.Tensor:
        lg = self.graphs(lane)
        bs = lg.fits(chunks, steps)
        greedy, temp, top_p, seeds, offsets = self._sampling_args(chunks, steps)
        graph = lg.capture(side, bs, greedy)
        positions, tables = self._decode_tables(chunks, steps)
        lg.prepare(positions, tables, ids, bs, greedy, temp, top_p, seeds, offsets)
        n = len(chunks)
        toks = torch.empty((steps, n), dtype=torch.int64, device=self.device)
        for k in range(steps):
            graph.replay()
            toks[k].copy_(lg.out[:n])
            record()
            if k + 1 < steps:
                yield
        return toks

    def _decode_tables(self, chunks: Sequence[Chunk], steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions and block tables (wide enough for every fused step) of one-token chunks."""
        B = self.block_size
        positions = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        need = int(positions.max()) + steps - 1
        need = need // B + 1
        tables = np.zeros((len(chunks), need), np.int32)
        for i, c in enumerate(chunks):
            t = self._block_table(c)
            k = min(len(t), need)
            tables[i, :k] = t[:k]
        return positions, tables

    def _block_table(self, c: Chunk) -> np.ndarray:
        """``c.block_ids`` as int32, from a per-request host copy that only converts appended blocks when
        the chunk carries the same (append-only) list as last time; otherwise converted afresh."""
        st = self._state(c.req_id)
        ids, n, t, have = c.block_ids, len(c.block_ids), st.table, st.table_len
        if st.table_src is ids and t is not None and n >= have and (have == 0 or t[have - 1] == ids[have - 1]):
            if n > have:
                if n > len(t):
                    grown = np.empty(max(n, 2 * len(t)), np.int32)
                    grown[:have] = t[:have]
                    t = grown
                t[have:n] = ids[have:n]
        else:
            t = np.empty(max(n, 16), np.int32)
            t[:n] = ids
            st.table_src = ids
        st.table, st.table_len = t, n
        return t[:n]

    def _eager_steps(self, chunks, sampling, x, layers: range, steps: int, record) -> torch.Tensor | None:
        samp = [chunks[j] for j in sampling]
        greedy, temp, top_p, seeds, offsets = self._sampling_args(samp, steps)
        toks = torch.empty((steps, len(samp)), dtype=torch.int64, device=self.device) if samp else None
        for k in range(steps):
            cur = chunks if k == 0 else [c._replace(start=c.start + k) for c in chunks]  # k > 0: decode only
            meta = build_meta(cur, self.block_size, self.device, block_q=self.model.block_q, table=self._block_table)
            hidden = yield from self.model.forward_iter(x, layers, meta, self.kv)  # steps > 1: all layers
            if samp:
                logits = self.model.logits(hidden, meta.sample_rows, pad=True)
                if greedy:
                    tok = logits.argmax(dim=-1)
                else:
                    tok = sample(logits, temp, top_p, seeds, offsets + k)
                toks[k].copy_(tok)
                x = tok  # steps > 1 only for one-token chunks that all sample
            record()
        return toks

    # ------------------------------------------------------------------ CUDA and CPU launches
    def _run_cuda(self, batch: Batch, side: Side) -> _Flight:
        """The launch as a flight whose work (a generator) ``_advance`` enqueues piece by piece: a layer of
        an eager forward, or one replay of a decode graph. Between pieces ``wait`` looks at the lanes, so a
        long eager launch (~12 ms of host time for a few thousand tokens) no longer keeps the other lane's
        next launch waiting until all of it is enqueued."""
        f = self._new_flight(batch)
        f.side = side
        f.work = self._cuda_work(f, batch, side)
        return f

    def _cuda_work(self, f: _Flight, batch: Batch, side: Side):
        timing = self._timing_events
        f.start_ev = timing.pop() if timing else torch.cuda.Event(enable_timing=True)
        f.start_ev.record()

        def record():
            ev = timing.pop() if timing else torch.cuda.Event(enable_timing=True)
            ev.record()
            f.step_evs.append(ev)

        toks, cols = yield from self._forward_steps(batch, side, record)
        self._set_cols(f, batch, cols)
        if toks is not None and toks.numel():
            f.host = self._host_buffer(batch.lane, toks.numel()).view(toks.shape)
            f.host.copy_(toks, non_blocking=True)
        f.done_ev = self._done_events.pop() if self._done_events else torch.cuda.Event()
        f.done_ev.record()

    def _host_buffer(self, lane: Lane, n: int) -> torch.Tensor:
        """A pinned buffer for a launch's sampled ids (``n`` of them). A lane has at most two launches out (one
        in flight, one queued behind it), and ``_finish`` copies the ids out before the lane's launch after
        next, so the lane's launches take its two buffers in turn (each grows to the largest launch seen)."""
        flip = self._flip[lane] = self._flip.get(lane, 1) ^ 1
        buf = self._host_bufs.get((lane, flip))
        if buf is None or buf.numel() < n:
            buf = self._host_bufs[lane, flip] = torch.empty(max(n, 4096), dtype=torch.int64, pin_memory=True)
        return buf[:n]

    def _advance(self, f: _Flight) -> None:
        """Enqueue the next piece of ``f``'s launch on its partition's stream. A piece that raises (bad input
        found while preparing it, a CUDA error) ends the launch: the lane is free again and the error goes to
        the caller of ``launch`` or ``wait``, as it did when a launch was enqueued whole."""
        with (torch.cuda.stream(f.side.stream) if f.side is not None else nullcontext()), \
                self.model.on_sms(f.side.num_sms if f.side is not None else None):
            try:
                self._turn += 1
                f.turn = self._turn
                next(f.work)
            except StopIteration:
                f.work = None
            except BaseException:
                lane = f.batch.lane
                if self._inflight.get(lane) is f:
                    del self._inflight[lane]
                    if lane in self._queued:  # (it read what this one was to write: it goes too)
                        del self._queued[lane]
                elif self._queued.get(lane) is f:
                    del self._queued[lane]
                self._held.pop(self._job_key(lane, self._order_chunks(f.batch)[1]), None)
                raise

    def _hold(self, key: tuple, held: _Held) -> None:
        """Keep a job's hidden state after its slice; a lane keeps its newest HELD_PER_LANE (a job left
        unfinished, e.g. its requests failed, is dropped when newer ones need the room)."""
        self._held.pop(key, None)
        mine = [k for k in self._held if k[0] == key[0]]
        for k in mine[:max(0, len(mine) - HELD_PER_LANE + 1)]:
            del self._held[k]
        self._held[key] = held

    @staticmethod
    def _job_key(lane: Lane, chunks: Sequence[Chunk]) -> tuple:
        """What a lane's held hidden state is filed under: the lane and its (ordered) chunks' positions."""
        return lane, tuple((c.req_id, c.start, c.num_tokens) for c in chunks)

    def flush(self) -> None:
        """Enqueue every launch in flight to its end now (the profiler times a launch's whole host part)."""
        for f in [*self._inflight.values(), *self._queued.values()]:
            while f.work is not None:
                self._advance(f)

    def _run_cpu(self, batch: Batch) -> _Flight:
        """The launch as a flight whose pieces run on the host as ``_advance`` reaches them (the CUDA path's
        order of work, so the CPU tests cover it); its times are the host's clock around them."""
        f = self._new_flight(batch)
        f.work = self._cpu_work(f, batch)
        return f

    def _cpu_work(self, f: _Flight, batch: Batch):
        start = self.now()
        ends: list[float] = []
        toks, cols = yield from self._forward_steps(batch, None, lambda: ends.append(self.now()))
        self._set_cols(f, batch, cols)
        f.tokens = None if toks is None else toks.numpy().copy()
        f.times = (start, ends[-1], ends)

    def _new_flight(self, batch: Batch) -> _Flight:
        self._turn += 1
        return _Flight(batch, self._order, np.zeros(0, np.int64), (), turn=self._turn)

    def _set_cols(self, f: _Flight, batch: Batch, cols: list[int]) -> None:
        f.cols = np.asarray(cols, np.int64)
        chunks = tuple(batch.chunks)
        f.req_ids = tuple(chunks[j].req_id for j in cols)

    def _ev_time(self, ev) -> float:
        return self._t_ref + self._ref.elapsed_time(ev) / 1e3

    def _by_end(self, flights: list[_Flight]) -> list[_Flight]:
        def end(f: _Flight) -> float:
            return f.times[1] if f.times is not None else self._ev_time(f.step_evs[-1])
        return sorted(flights, key=end)

    def _finish(self, f: _Flight) -> StepResult:
        batch = f.batch
        del self._inflight[batch.lane]
        if self._queued:
            nxt = self._queued.pop(batch.lane, None)
            if nxt is not None:
                self._inflight[batch.lane] = nxt
        if f.times is not None:
            start, end, ends = f.times
            dev = f.tokens
        else:
            start = self._ev_time(f.start_ev)
            ends = [self._ev_time(e) for e in f.step_evs]
            end = ends[-1]
            dev = None if f.host is None else f.host.numpy()
            # the events are done with: recorded again by later launches, not made anew for each
            self._timing_events.append(f.start_ev)
            self._timing_events.extend(f.step_evs)
            self._done_events.append(f.done_ev)
        tokens = np.full((batch.steps, len(batch.chunks)), -1, dtype=np.int64)
        if dev is not None and len(f.cols):
            tokens[:, f.cols] = dev
            per_request = dev.T.tolist()  # Python ints, one list per request (not a per-token int() loop:
            # 38,400 generator steps in 300 launches of 64 requests under cProfile on the H200, .run/s13h.sh)
            reqs = self._reqs
            for rid, ids in zip(f.req_ids, per_request):
                st = reqs.get(rid)
                if st is not None:
                    st.outputs.extend(ids)
        return StepResult(batch, start, end, tuple(ends), tokens)


def shape_chunks(kv, first_id: int, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> list[Chunk]:
    """A launch's chunks for decode rows of contexts ``decode`` (first, as the executor orders them) and prompt
    chunks ``prefill`` as (new tokens, cached prefix), each sampling, with placeholder ids; their KV allocated in
    ``kv`` (a BlockManager) under ids ``first_id``, ``first_id + 1``, ..."""
    chunks = []
    for i, ctx in enumerate(decode):
        chunks.append(Chunk(first_id + i, ctx - 1, 1, kv.allocate(first_id + i, ctx), True, (1,)))
    for i, (new, prefix) in enumerate(prefill, start=first_id + len(decode)):
        chunks.append(Chunk(i, prefix, new, kv.allocate(i, prefix + new), True, (1,) * new))
    return chunks


def freeze_heap() -> None:
    """Start-up is over: what it made (the modules of torch and the rest, weights, graphs: 286,000 objects on
    the VM) leaves the garbage collector's scans. A generation-2 pass over them held the GIL for 256 ms in the
    middle of a bullet run on the H200, a stall of both lanes (bench/RESULTS.md, twenty-third session); after
    the freeze a full pass took 0.0 ms against 254-274 ms on the 2-core VM."""
    gc.collect()
    gc.freeze()


def warm_shapes(spec: ModelSpec) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """The eager launches of the executor's warm-up: (prompt chunks as (new tokens, cached prefix), decode
    rows' contexts). One and several prompts, a chunk over a prefix; each with no decode rows, a few (the
    decode attention splits each context) and enough that it does not split (a kernel variant of its own:
    compiled in the middle of serving, a 130-row mixed launch took 680 ms against 65 predicted on the H200,
    bench/RESULTS.md, fourteenth session)."""
    f = min(1.0, (spec.max_position - 1) / 2200)  # a small model's positions
    prompts = [[(int(f * n) + 1, int(f * p)) for n, p in sh]
               for sh in (((2048, 0),), ((700, 0), (600, 0), (900, 0)), ((1500, 700),), ((600, 0), (300, 1200)))]
    ctx = int(f * 1000) + 1
    unsplit = -(-DECODE_TARGET_PROGRAMS // spec.kv_heads_per_gpu)
    return [(p, [ctx] * rows) for p in prompts for rows in (0, 5, unsplit)]


def prepare_graphs(ex: GpuExecutor, cfg, gpu, prefill: bool = True) -> dict[str, int]:
    """Capture, before serving, the graphs of every partition the policy (``cfg``: a SchedulerConfig) will
    launch on: decode graphs (every batch bucket), and, with ``prefill``, prefill graphs (every token bucket)
    for the layer ranges its prefill launches take. bullet's prefill partitions are the complements of its
    decode sizes and the whole GPU; its ranges the ``layers_per_step`` slices and the whole forward, and on the
    whole GPU the rest of a job from each slice boundary (a launch the menu or the ranges miss runs eagerly).
    Partitions are captured one at a time, the allocator's cache released in between; out of device memory is a
    MemoryError naming the flags that help. Returns how many graphs each kind has."""
    N, L = gpu.num_sms, ex.spec.num_layers
    step = cfg.prefill_layers(L)  # (bullet: its 8-layer slices when not told otherwise)
    slices = [range(i, min(i + step, L)) for i in range(0, L, step)]
    if cfg.policy in ("chunked", "prefill-first"):
        decode, pre = [("all", N)], [("all", N, [range(L)])]
    elif cfg.policy == "static-split":
        decode, pre = [("decode", N - cfg.prefill_sms)], [("prefill", cfg.prefill_sms, slices)]
    elif cfg.policy == "naive-concurrent":
        decode, pre = [("decode", N)], [("prefill", N, slices)]
    else:
        sizes = (*(cfg.decode_sizes or gpu.decode_sizes[:-1]), N)
        decode = [("decode", d) for d in sizes]
        ranges = slices if len(slices) == 1 else [*slices, range(L)]
        # on the whole GPU bullet also runs the rest of a job from any slice boundary at once (_whole_gpu)
        rests = [range(r.start, L) for r in slices[1:]]
        pre = [("prefill", N - d if d < N else N, ranges + (rests if d == N else [])) for d in sizes]
    # The caching allocator keeps blocks per stream, and each partition is a stream of its own: a capture's
    # warm-up run (outside the graph) leaves blocks cached on its partition's stream that no other stream can
    # use. Released after each partition; without it bullet's 16 partitions ran out of memory at start-up
    # with 17 GiB cached and unused (H200, fourteenth session: bench/RESULTS.md). What stays is the graphs'
    # own pools, about 0.6 GiB per decode size and 0.1 GiB per prefill size for Llama-3.1-8B.
    jobs = [partial(ex.capture, lane, sms, ex.graph_buckets) for lane, sms in decode]
    # launches with decode rows: chunked's and prefill-first's on the whole GPU, bullet's mixed launch (the whole
    # forward on the whole GPU, Bullet._mixed): graphs whose decode rows take the decode kernel as well
    rows = (False, True) if cfg.policy in ("chunked", "prefill-first") else (False,)
    jobs += [partial(ex.capture_prefill, lane, sms, layer_ranges=ranges, decode_rows=rows)
             for lane, sms, ranges in (pre if prefill else ())]
    if prefill and cfg.policy == "bullet":
        jobs.append(partial(ex.capture_prefill, "prefill", N, layer_ranges=[range(L)], decode_rows=(True,)))
    for i, job in enumerate(jobs):
        if ex.cuda:
            torch.cuda.empty_cache()
        try:
            job()
        except torch.OutOfMemoryError as e:
            raise MemoryError(
                f"out of device memory capturing CUDA graphs for partition {i + 1} of {len(jobs)} "
                f"({len(decode)} decode sizes{f', {len(pre)} prefill sizes' if prefill else ''}): use fewer "
                "--decode-sizes or a lower --gpu-memory-utilization (the KV cache takes the rest)") from e
    if ex.cuda:
        torch.cuda.empty_cache()
        freeze_heap()
    return {"decode": sum(len(g.graphs) for g in ex._graphs.values()),
            "prefill": sum(len(g.graphs) for g in ex.prefill_graphs.values())}
