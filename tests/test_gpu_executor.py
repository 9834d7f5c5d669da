"""The real executor end to end: requests in through the core's serve() loop, tokens out, checked against
greedy decoding with the plain-torch reference forward of each request alone. CPU by default (tiny model,
float32, eager); tests marked ``gpu`` run the same on CUDA with green-context partitions and decode graphs,
and check that co-running a prefill next to decode steps changes nothing."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bullet.batch import Batch, Chunk, Partition
from bullet.config import GPUS, MODELS, SchedulerConfig, SloConfig
from bullet.engine import serve
from bullet.gpu.executor import GpuExecutor, synthetic_ids
from bullet.gpu.model import reference_forward
from bullet.gpu.weights import load_weights
from bullet.kvcache import BlockManager
from bullet.policies import make_scheduler
from bullet.request import Request
from tests.latency import LinearLatency

SPEC = MODELS["tiny-llama"]
SEED = 3


@pytest.fixture(scope="module")
def weights():
    return load_weights(SPEC, "dummy", "cpu", torch.float32, seed=SEED)


def greedy_reference(weights, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(n):
        logits = reference_forward(SPEC, weights, [ids], dtype=torch.float64)[0]
        out.append(int(logits[-1].argmax()))
        ids.append(out[-1])
    return out


def prompt_of(r: Request) -> list[int]:
    if r.prompt_ids is not None:
        return list(r.prompt_ids)
    return synthetic_ids(r.id, 0, r.prompt_len, SPEC.vocab_size, SEED).tolist()


def make_requests(n=7, seed=0, with_ids=False):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        plen = int(rng.integers(1, 40))
        ids = tuple(int(x) for x in rng.integers(0, SPEC.vocab_size, plen)) if with_ids and i % 2 else None
        reqs.append(Request(i, 0.0, plen, int(rng.integers(1, 7)), prompt_ids=ids))
    return reqs


def run_serve(weights, reqs, policy, device="cpu", num_blocks=64, dtype=None, menu=None, prefix_caching=False,
              waves=None, prefill_graphs=(), decode_rows=(False,), slo=None, **cfg):
    """``waves``: lists of requests served one after another by the same scheduler and executor (so that
    later ones can find earlier ones' blocks in the prefix cache); default one wave of ``reqs``.
    ``prefill_graphs``: (lane, SMs) pairs to capture prefill graphs for, every bucket, the whole forward and
    each one-layer slice (``decode_rows``: the variants, ``GpuExecutor.capture_prefill``)."""
    gpu = GPUS["h200"]
    executor = GpuExecutor(SPEC, "dummy", device, block_size=4, num_blocks=num_blocks, seed=SEED,
                           weights=weights, dtype=dtype, menu=menu, token_buckets=(16, 32, 64), graph_max_seqs=8)
    L = SPEC.num_layers
    for lane, sms in prefill_graphs:
        executor.capture_prefill(lane, sms, layer_ranges=[range(L)] + [range(i, i + 1) for i in range(L)],
                                 decode_rows=decode_rows)
    kv = BlockManager(num_blocks, 4, prefix_caching)
    sched = make_scheduler(SchedulerConfig(policy=policy, **cfg), SPEC, gpu, kv, LinearLatency(SPEC.num_layers), slo=slo)
    steps = []
    done = []
    for wave in waves or [reqs]:
        done += serve(wave, sched, executor, on_step=steps.append)
    executor.sched = sched
    executor.num_graphs = sum(len(lg.graphs) for lg in executor._graphs.values())  # before close() drops them
    executor.prefill_replays = sum(pg.replays for pg in executor.prefill_graphs.values())
    executor.decode_row_replays = sum(pg.decode_replays for pg in executor.prefill_graphs.values())
    executor.close()
    return done, steps, executor


def check_against_reference(weights, done, reqs):
    assert len(done) == len(reqs)
    for r in done:
        assert r.num_output == r.max_new_tokens
        assert len(r.output_ids) == r.max_new_tokens
        assert r.output_ids == greedy_reference(weights, prompt_of(r), r.max_new_tokens), f"request {r.id}"


@pytest.mark.parametrize("policy,cfg", [
    ("chunked", {"max_batched_tokens": 16}),
    ("prefill-first", {"max_batched_tokens": 24}),
    ("static-split", {"max_batched_tokens": 32, "layers_per_step": 1}),
    ("naive-concurrent", {"max_batched_tokens": 32}),
    ("bullet", {"max_batched_tokens": 32, "layers_per_step": 1}),
    # a per-token TTFT target: bullet's jobs share the GPU with decode (sliced, mixed launches) instead of taking
    # it whole while decode lends the stall, as under the default absolute target (LIGHT_STALL)
    ("bullet", {"max_batched_tokens": 32, "layers_per_step": 1, "slo": SloConfig(ttft=None, ttft_per_token=0.003)}),
    ("chunked", {"max_batched_tokens": 16, "async_scheduling": True}),
    ("prefill-first", {"max_batched_tokens": 24, "async_scheduling": True}),
])
def test_serve_matches_reference(weights, policy, cfg):
    reqs = make_requests(7, seed=1, with_ids=True)
    done, steps, executor = run_serve(weights, reqs, policy, **cfg)
    check_against_reference(weights, done, reqs)
    for res in steps:
        assert res.start <= res.end and len(res.step_ends) == res.batch.steps
        assert list(res.step_ends) == sorted(res.step_ends) and res.step_ends[-1] == res.end
        assert res.tokens.shape == (res.batch.steps, len(res.batch.chunks))
        samples = np.array([c.sample for c in res.batch.chunks])
        full = res.batch.layers.stop == SPEC.num_layers
        assert np.all((res.tokens >= 0) == (samples[None, :] & full))
    if policy not in ("prefill-first", "bullet"):  # prefill-first's decode waits for each prefill; bullet's
        # stretches end at each 1-layer slice here (its fused launches are checked on a fake clock below)
        assert any(res.batch.steps > 1 for res in steps)
    sliced = policy == "static-split" or (policy == "bullet" and "slo" in cfg)
    if sliced:
        assert any(res.batch.layers.stop < SPEC.num_layers for res in steps)  # layer slices too
    if policy == "chunked":  # fused launches that start with a prefill-completing (mixed) step
        assert any(res.batch.steps > 1 and any(c.num_tokens > 1 for c in res.batch.chunks) for res in steps)
    if policy == "bullet" and "slo" in cfg:  # mixed launches on the prefill lane: prompts and decode rows (Bullet._mixed)
        assert any(res.batch.lane == "prefill" and {c.num_tokens == 1 and c.start > 0 for c in res.batch.chunks} == {True, False}
                   for res in steps)
    assert not executor._reqs  # every finished request was released


@pytest.mark.parametrize("policy,cfg,lanes,rows", [
    ("chunked", {"max_batched_tokens": 16}, [("all", 132)], (False,)),
    ("chunked", {"max_batched_tokens": 16}, [("all", 132)], (False, True)),
    ("chunked", {"max_batched_tokens": 16, "async_scheduling": True}, [("all", 132)], (False, True)),
    ("static-split", {"max_batched_tokens": 32, "layers_per_step": 1, "prefill_sms": 92},
     [("prefill", 92), ("decode", 40)], (False,)),
])
def test_serve_through_prefill_graphs_matches_reference(weights, policy, cfg, lanes, rows):
    """Prefill and mixed launches replayed from prefill graphs (on the CPU, the same body re-run on the
    static buffers: padding rows and sequences, tile tables, one-layer slices handing over the hidden state,
    sampling rows; with ``rows`` (False, True), the mixed launches' decode rows through the decode kernel)
    give the reference's tokens."""
    reqs = make_requests(7, seed=4, with_ids=True)
    done, steps, executor = run_serve(weights, reqs, policy, prefill_graphs=lanes, decode_rows=rows, **cfg)
    check_against_reference(weights, done, reqs)
    graphed = [r for r in steps if sum(c.num_tokens for c in r.batch.chunks) <= 64 and len(r.batch.chunks) <= 8
               and any(c.num_tokens > 1 for c in r.batch.chunks)]
    assert graphed and executor.prefill_replays >= len(graphed)
    mixed = [r for r in graphed if r.batch.chunks[0].num_tokens == 1]  # (and a lone prompt chunk of one token)
    assert executor.decode_row_replays >= len(mixed) > 0 if True in rows else executor.decode_row_replays == 0


def test_prepare_graphs_captures_each_policys_lanes_and_ranges(weights):
    """prepare_graphs captures prefill graphs for the lanes and layer ranges each policy launches (on the CPU
    every partition is the one host "side", so the keys show lanes, buckets and ranges)."""
    from bullet.gpu.executor import prepare_graphs

    L, gpu = SPEC.num_layers, GPUS["h200"]
    cases = {
        SchedulerConfig(policy="chunked"): {"all": [range(L)]},
        SchedulerConfig(policy="static-split", layers_per_step=1): {"prefill": [range(i, i + 1) for i in range(L)]},
        SchedulerConfig(policy="bullet", layers_per_step=1, decode_sizes=(16, 40)):
            {"prefill": [*(range(i, i + 1) for i in range(L)), range(L)]},
    }
    for cfg, want in cases.items():
        ex = GpuExecutor(SPEC, "dummy", "cpu", block_size=4, num_blocks=32, seed=SEED, weights=weights,
                         token_buckets=(16, 32), graph_max_seqs=4)
        counts = prepare_graphs(ex, cfg, gpu)
        got = {lane: sorted({(k[2], k[3]) for k in pg.graphs}) for lane, pg in ex.prefill_graphs.items()}
        assert got == {lane: sorted((r.start, r.stop) for r in rs) for lane, rs in want.items()}, cfg.policy
        # two token buckets each; chunked's lane with and without decode rows through the decode kernel, and
        # bullet's whole forward (its mixed launch) with them too
        ranges = sum(len(rs) for rs in want.values())
        want_graphs = {"chunked": 2 * 2 * ranges, "static-split": 2 * ranges, "bullet": 2 * (ranges + 1)}
        assert counts["prefill"] == want_graphs[cfg.policy]
        assert all(k[1] in (16, 32) for pg in ex.prefill_graphs.values() for k in pg.graphs)
        ex.close()


def test_prepare_graphs_captures_bullets_default_slices():
    """bullet slices prefill 8 layers at a time when --layers-per-step is not given, and prepare_graphs captures
    graphs for those slices (it captured only whole forwards, so every slice of a live bullet server ran
    eagerly). Llama-3.1-8B's 32 layers: four slices and the whole forward, on each decode size's complement, and on
    the whole GPU the rest of a job from each slice boundary."""
    from bullet.gpu.executor import prepare_graphs

    class Recorder:  # the executor's capture calls, no model
        spec, graph_buckets, _graphs, prefill_graphs, cuda = MODELS["llama-3.1-8b"], (1, 2), {}, {}, False

        def __init__(self):
            self.prefill, self.decode = [], []

        def capture(self, lane, sms, sizes):
            self.decode.append((lane, sms))

        def capture_prefill(self, lane, sms, layer_ranges, decode_rows=(False,)):
            self.prefill.append((lane, sms, list(layer_ranges), tuple(decode_rows)))

    cfg = SchedulerConfig(policy="bullet", decode_sizes=(16, 40))
    assert cfg.prefill_layers(32) == 8 and SchedulerConfig(policy="static-split").prefill_layers(32) == 32
    ex = Recorder()
    prepare_graphs(ex, cfg, GPUS["h200"])
    want = [range(8), range(8, 16), range(16, 24), range(24, 32), range(32)]
    rests = [range(8, 32), range(16, 32), range(24, 32)]  # the whole GPU: a job's rest at once (bullet._whole_gpu)
    no = (False,)
    assert ex.prefill == [("prefill", 116, want, no), ("prefill", 92, want, no), ("prefill", 132, want + rests, no),
                          ("prefill", 132, [range(32)], (True,))]  # the mixed launch's decode rows (Bullet._mixed)
    assert ex.decode == [("decode", 16), ("decode", 40), ("decode", 132)]


def test_prepare_graphs_out_of_memory_names_the_way_out():
    """Device memory running out while graphs are captured (bullet's whole decode menu did on the H200 before
    the per-partition release) ends start-up with a message naming the partition and the flags that help."""
    from bullet.gpu.executor import prepare_graphs

    class Full:
        spec, graph_buckets, _graphs, prefill_graphs, cuda = MODELS["llama-3.1-8b"], (1,), {}, {}, False

        def capture(self, lane, sms, sizes):
            if sms == 40:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 110.00 MiB")

        def capture_prefill(self, lane, sms, layer_ranges, decode_rows=(False,)):
            pass

    with pytest.raises(MemoryError, match=r"partition 2 of 7 \(3 decode sizes, 3 prefill sizes\).*--decode-sizes"
                                          r".*--gpu-memory-utilization"):
        prepare_graphs(Full(), SchedulerConfig(policy="bullet", decode_sizes=(16, 40)), GPUS["h200"])


@pytest.mark.parametrize("ahead", [False, True])
def test_preemption_recompute_matches_reference(weights, ahead):
    """A pool too small for everyone: preempted requests recompute prompt and outputs they already have
    (with async scheduling too: a request is preempted only once no launch in flight holds it; whether one is
    depends on the host's timing here, on a wall clock: tests/test_async.py counts them on a virtual one)."""
    reqs = [Request(i, 0.0, 10 + 3 * i, 8) for i in range(6)]
    done, _steps, _ = run_serve(weights, reqs, "chunked", num_blocks=14, max_batched_tokens=16,
                                async_scheduling=ahead)
    assert ahead or sum(r.num_preemptions for r in done) > 0
    check_against_reference(weights, done, reqs)


def shared_prefix_waves():
    """Block size 4. Wave 1: request 0, prompt = 16 base tokens + 3 of its own, 2 new tokens: its 19 prompt
    tokens and first output (20 positions, 5 full blocks) end up cached. Wave 2 (all at once, so they hit
    only request 0's blocks): the base cut at 12, 16 and 8 tokens, each followed by tokens that differ from
    the base's continuation, and request 0's prompt again. Hits, by hand: 12, 16, 8 and 16 tokens (the
    repeat may not hit its whole 19-token prompt: 4 whole blocks leave its last 3 tokens to compute)."""
    rng = np.random.default_rng(11)
    base = [int(x) for x in rng.integers(0, SPEC.vocab_size, 16)]

    def own(cut, n):  # n tokens after base[:cut], the first differing from base[cut]
        tail = [int(x) for x in rng.integers(0, SPEC.vocab_size, n)]
        if cut < len(base):
            tail[0] = (base[cut] + 1) % SPEC.vocab_size
        return tuple(base[:cut] + tail)

    first = Request(0, 0.0, 19, 2, prompt_ids=own(16, 3))
    second = [Request(i, 0.0, len(p), m, prompt_ids=p) for i, (p, m) in
              enumerate([(own(12, 5), 4), (own(16, 2), 3), (own(8, 9), 5), (first.prompt_ids, 3)], start=1)]
    return [first], second, 12 + 16 + 8 + 16


@pytest.mark.parametrize("policy,cfg", [
    ("chunked", {"max_batched_tokens": 16}),
    ("chunked", {"max_batched_tokens": 16, "async_scheduling": True}),
    ("static-split", {"max_batched_tokens": 32, "layers_per_step": 1}),
])
def test_prefix_cache_hits_match_reference(weights, policy, cfg):
    """Requests whose prompts share prefixes start their prefill after the cached blocks and attend to the
    cached KV: greedy outputs equal the plain-torch reference and the run without prefix caching."""
    waves = {flag: shared_prefix_waves() for flag in (True, False)}
    outs = {}
    for flag, (w1, w2, hits) in waves.items():
        done, steps, ex = run_serve(weights, None, policy, prefix_caching=flag, waves=[w1, w2], **cfg)
        check_against_reference(weights, done, w1 + w2)
        assert ex.sched.hit_tokens == (hits if flag else 0)
        firsts: dict[int, int] = {}  # where each wave-2 request's first prefill chunk starts
        for s in steps:
            for c in s.batch.chunks:
                if s.batch.layers.start == 0 and c.req_id > 0:
                    firsts.setdefault(c.req_id, c.start)
        assert sorted(firsts.values()) == ([8, 12, 16, 16] if flag else [0, 0, 0, 0])
        assert sum(s.batch.cached_tokens for s in steps) == (hits if flag else 0)
        outs[flag] = {r.id: r.output_ids for r in done}
    assert outs[True] == outs[False]


def test_synthetic_ids_never_take_a_cached_prefix(weights):
    """A chunk past position 0 without token ids, for a request this executor never saw, would attend to
    KV computed from another request's synthetic ids: refused with a message."""
    ex = direct_executor(weights)
    with pytest.raises(ValueError, match="prefix-cache hit on synthetic ids"):
        ex.launch(Batch(Partition("all", 132), range(SPEC.num_layers), (Chunk(7, 8, 4, (0, 1, 2), True),)))


def direct_executor(weights, **kw):
    return GpuExecutor(SPEC, "dummy", "cpu", block_size=4, num_blocks=32, seed=SEED, weights=weights, **kw)


def test_layer_slices_equal_full_pass(weights):
    chunks = (Chunk(0, 0, 9, (0, 1, 2), True), Chunk(1, 0, 5, (3, 4), True))
    full = direct_executor(weights)
    full.launch(Batch(Partition("all", 132), range(SPEC.num_layers), chunks))
    (a,) = full.wait(None)
    sliced = direct_executor(weights)
    for layer in range(SPEC.num_layers):
        sliced.launch(Batch(Partition("prefill", 92), range(layer, layer + 1), chunks))
        assert sliced.busy("prefill") and not sliced.busy("decode")
        (b,) = sliced.wait(None)
        assert not sliced.busy("prefill")
    assert np.all(b.tokens >= 0) and np.array_equal(a.tokens, b.tokens)
    # the sampled token is the next decode input (fed from the device-side slot)
    dec = Batch(Partition("decode", 40), range(SPEC.num_layers),
                (Chunk(0, 9, 1, (0, 1, 2), True), Chunk(1, 5, 1, (3, 4), True)), steps=3)
    sliced.launch(dec)
    (c,) = sliced.wait(None)
    ref = [greedy_reference(weights, synthetic_ids(i, 0, n, SPEC.vocab_size, SEED).tolist(), 4) for i, n in
           ((0, 9), (1, 5))]
    assert c.tokens.T.tolist() == [r[1:] for r in ref] and b.tokens[0].tolist() == [r[0] for r in ref]


def test_launch_rules(weights):
    ex = direct_executor(weights)
    b = Batch(Partition("all", 132), range(SPEC.num_layers), (Chunk(0, 0, 3, (0,), True),))
    ex.launch(b)
    nxt = Batch(Partition("all", 132), range(SPEC.num_layers), (Chunk(0, 3, 1, (0,), True),))
    ex.launch(nxt)  # queued behind it (async scheduling): it decodes the token b samples
    assert ex.busy("all") and ex.queued("all")
    with pytest.raises(RuntimeError, match="in flight and one queued"):
        ex.launch(b)
    (first,), (second,) = ex.wait(None), ex.wait(None)
    assert (first.batch, second.batch) == (b, nxt) and first.end <= second.start and ex.wait(None) == []
    assert not ex.busy("all") and not ex.queued("all")
    with pytest.raises(RuntimeError, match="hidden state"):  # a slice that continues nothing
        ex.launch(Batch(Partition("prefill", 92), range(1, 2), (Chunk(5, 0, 3, (1,), True),)))
    t = ex.now()
    assert ex.wait(t + 0.01) == [] and ex.now() >= t + 0.01  # idles until the horizon
    ex.release(0)
    assert 0 not in ex._reqs


def test_block_tables_for_graphs(weights):
    """Host block tables for decode graphs: appended blocks are picked up, a new list is converted afresh,
    and the table is wide enough for every fused step (the in-graph advance reads it)."""
    ex = direct_executor(weights)  # block_size 4
    table = [5, 6]
    c = Chunk(0, 7, 1, table, True)
    assert ex._block_table(c).tolist() == [5, 6]
    table.append(9)
    assert ex._block_table(c).tolist() == [5, 6, 9]
    fresh = [1, 2, 3]
    assert ex._block_table(c._replace(block_ids=fresh)).tolist() == [1, 2, 3]
    pos, bt = ex._decode_tables([Chunk(0, 7, 1, fresh, True), Chunk(1, 3, 1, (4, 8), True)], steps=2)
    assert pos.tolist() == [7, 3] and bt.tolist() == [[1, 2, 3], [4, 8, 0]]  # position 8 needs block 2


def test_seeded_sampling_is_deterministic(weights):
    from bullet.request import SamplingParams

    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    out = []
    for _ in range(2):
        ex = direct_executor(weights)
        ex.launch(Batch(Partition("all", 132), range(SPEC.num_layers),
                        (Chunk(0, 0, 6, (0, 1), True, None, sp), Chunk(1, 0, 4, (2,), True))))
        (r,) = ex.wait(None)
        ex.launch(Batch(Partition("all", 132), range(SPEC.num_layers),
                        (Chunk(0, 6, 1, (0, 1), True, None, sp), Chunk(1, 4, 1, (2, 3), True)), steps=2))
        (s,) = ex.wait(None)
        out.append(np.vstack([r.tokens, s.tokens]))
    assert np.array_equal(out[0], out[1])


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("policy,cfg,lanes", [
    ("static-split", {"max_batched_tokens": 32, "layers_per_step": 1, "prefill_sms": 68}, ()),
    ("chunked", {"max_batched_tokens": 16}, ()),
    ("static-split", {"max_batched_tokens": 32, "layers_per_step": 1, "prefill_sms": 68},
     [("prefill", 68), ("decode", 64)]),
    ("chunked", {"max_batched_tokens": 16}, [("all", 132)]),
    ("chunked", {"max_batched_tokens": 16, "async_scheduling": True}, ()),
    ("chunked", {"max_batched_tokens": 16, "async_scheduling": True}, [("all", 132)]),
    ("prefill-first", {"max_batched_tokens": 24, "async_scheduling": True}, [("all", 132)]),
    ("chunked", {"max_batched_tokens": 16, "decode_rows": (False, True)}, [("all", 132)]),
    ("chunked", {"max_batched_tokens": 16, "async_scheduling": True, "decode_rows": (False, True)},
     [("all", 132)]),
])
def test_gpu_serve_matches_reference(weights, gpu_menu, policy, cfg, lanes):
    """float32 on the GPU (Triton kernels, green-context streams, decode graphs, and prefill graphs where
    ``lanes`` asks; with ``decode_rows`` (False, True) the mixed launches' decode rows through the decode
    kernel inside the graph) against the reference."""
    reqs = make_requests(7, seed=2, with_ids=True)
    done, _steps, executor = run_serve(weights, reqs, policy, device="cuda", dtype=torch.float32,
                                       menu=gpu_menu, prefill_graphs=lanes, **cfg)
    check_against_reference(weights, done, reqs)
    assert executor.num_graphs > 0  # decode ran as CUDA graphs captured on the partitions
    assert (executor.prefill_replays > 0) == bool(lanes)
    assert (executor.decode_row_replays > 0) == (True in cfg.get("decode_rows", ()))


@pytest.mark.gpu
def test_gpu_sliced_one_token_prompt_does_not_replay_a_decode_graph(weights, gpu_menu):
    """A one-token prompt prefilled in one-layer slices: every chunk has one token and samples, but the last
    slice's input is the hidden state, not token ids, so it must not go to a decode graph (it did, on the
    H200 under bullet at 8 req/s: "output with shape [1] doesn't match the broadcast shape [1, 4096]")."""
    ex = GpuExecutor(SPEC, "dummy", "cuda", block_size=4, num_blocks=32, seed=SEED, weights=weights,
                     dtype=torch.float32, menu=gpu_menu)
    chunks = (Chunk(0, 0, 1, (0,), True, (7,)),)
    for layer in range(SPEC.num_layers):
        ex.launch(Batch(Partition("prefill", 68), range(layer, layer + 1), chunks))
        (res,) = ex.wait(None)
    assert res.tokens[0].tolist() == greedy_reference(weights, [7], 1)
    ex.close()


@pytest.mark.gpu
def test_gpu_prefix_cache_hits_match_reference(weights, gpu_menu):
    """The prefix-cache case of the CPU test on the GPU (float32, partitions, graphs), cached and not."""
    outs = {}
    for flag in (True, False):
        w1, w2, hits = shared_prefix_waves()
        done, _steps, ex = run_serve(weights, None, "static-split", device="cuda", dtype=torch.float32,
                                     menu=gpu_menu, prefix_caching=flag, waves=[w1, w2], max_batched_tokens=32,
                                     layers_per_step=1, prefill_sms=68)
        check_against_reference(weights, done, w1 + w2)
        assert ex.sched.hit_tokens == (hits if flag else 0)
        outs[flag] = {r.id: r.output_ids for r in done}
    assert outs[True] == outs[False]


def test_launches_are_enqueued_in_pieces_and_lanes_interleave(weights):
    """A launch enqueues its first piece (a layer) in launch() and the rest in wait(), so the other lane can be
    launched in between; the tokens are those of each launch alone; flush() enqueues the rest at once."""
    def executor():
        return GpuExecutor(SPEC, "dummy", "cpu", block_size=4, num_blocks=64, seed=SEED, weights=weights)

    L = SPEC.num_layers
    prompt = tuple(range(5, 35))

    def prefill(req_id):  # a whole forward of one 30-token prompt on the prefill lane
        return Batch(Partition("prefill", 92), range(L), (Chunk(req_id, 0, 30, tuple(range(8)), True, prompt),))

    def decode_lane(req_id):  # a 3-token prompt, then 4 fused steps, on the decode lane
        return Batch(Partition("decode", 40), range(L), (Chunk(req_id, 0, 3, (20, 21), True, (7, 8, 9)),), steps=4)

    alone = {}
    ex = executor()
    for b in (prefill(1), decode_lane(2)):
        ex.launch(b)
        (res,) = ex.wait(None)
        alone[b.lane] = res.tokens
    ex.close()
    ex = executor()
    ex.launch(prefill(1))
    assert ex._inflight["prefill"].work is not None  # its later layers are not run yet
    ex.launch(decode_lane(2))
    got = {}
    while ex.busy("prefill") or ex.busy("decode"):
        for res in ex.wait(None):
            got[res.batch.lane] = res.tokens
    assert all(np.array_equal(got[lane], alone[lane]) for lane in alone)
    ex.launch(prefill(3))
    ex.flush()
    assert ex._inflight["prefill"].work is None
    ex.close()


def test_a_launch_that_fails_frees_its_lane(weights, monkeypatch):
    """Bad input found while preparing the first piece raises from launch(); an error in a later piece raises
    from wait(); either way the lane is free for the next launch."""
    ex = GpuExecutor(SPEC, "dummy", "cpu", block_size=4, num_blocks=64, seed=SEED, weights=weights)
    L = SPEC.num_layers
    with pytest.raises(ValueError, match="without token ids"):  # position 5 of a request never seen
        ex.launch(Batch(Partition("prefill", 92), range(L), (Chunk(1, 5, 3, (0, 1), True),)))
    assert not ex.busy("prefill")
    calls = []
    mlp = ex.model._mlp

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom in layer 1")
        return mlp(*args)

    monkeypatch.setattr(ex.model, "_mlp", failing)
    ex.launch(Batch(Partition("prefill", 92), range(L), (Chunk(2, 0, 3, (2,), True, (1, 2, 3)),)))
    assert ex.busy("prefill")
    with pytest.raises(RuntimeError, match="boom"):
        ex.wait(None)
    assert not ex.busy("prefill")
    monkeypatch.setattr(ex.model, "_mlp", mlp)
    ex.launch(Batch(Partition("prefill", 92), range(L), (Chunk(3, 0, 3, (3,), True, (1, 2, 3)),)))
    (res,) = ex.wait(None)
    assert res.tokens.shape == (1, 1)
    ex.close()


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_gpu_corun_equals_alone(gpu_menu, first):
    """A layer-sliced prefill on one partition next to fused decode steps on the other gives exactly the
    tokens each gives alone on the same partitions. With the (eager) prefill launched first, the decode
    launch is enqueued while the prefill's launch is still being enqueued a layer at a time."""
    spec = dataclasses.replace(MODELS["llama-3.1-8b"], num_layers=4)
    ex = GpuExecutor(spec, "dummy", "cuda", block_size=16, num_blocks=4096, seed=0, menu=gpu_menu)
    try:
        _corun(ex, spec, first)
    finally:
        ex.close()  # before the menu's streams go: its pinned buffers were used on them


def _corun(ex, spec, first="decode"):
    rng = np.random.default_rng(0)
    dec_prompt = [tuple(int(x) for x in rng.integers(0, spec.vocab_size, 300)) for _ in range(16)]
    pre_prompt = tuple(int(x) for x in rng.integers(0, spec.vocab_size, 3000))
    nxt = iter(range(1, 4096))

    def table(n):
        return tuple(next(nxt) for _ in range(-(-n // 16)))

    def setup(base):
        """Prefill the decode requests (whole GPU); return their decode batch and the big prefill's chunk."""
        tables = [table(300 + 8) for _ in range(16)]
        chunks = tuple(Chunk(base + i, 0, 300, tables[i], True, dec_prompt[i]) for i in range(16))
        ex.launch(Batch(Partition("all", 132), range(4), chunks))
        (r,) = ex.wait(None)
        dec = Batch(Partition("decode", 40), range(4),
                    tuple(Chunk(base + i, 300, 1, tables[i], True) for i in range(16)), steps=8)
        pre = Chunk(base + 99, 0, 3000, table(3000), True, pre_prompt)
        return r.tokens, dec, pre

    def prefill(pre):
        return [Batch(Partition("prefill", 92), range(i, i + 1), (pre,)) for i in range(4)]

    t0, dec_a, pre_a = setup(0)
    for b in prefill(pre_a):  # alone
        ex.launch(b)
        (pa,) = ex.wait(None)
    ex.launch(dec_a)
    (da,) = ex.wait(None)
    t1, dec_b, pre_b = setup(1000)
    assert np.array_equal(t0, t1)
    slices = prefill(pre_b)
    if first == "decode":
        ex.launch(dec_b)
        ex.launch(slices.pop(0))
    else:
        ex.launch(slices.pop(0))
        assert ex._inflight["prefill"].work is not None  # the eager slice is still being enqueued
        ex.launch(dec_b)
    results = {}
    overlapped = False
    while ex.busy("prefill") or ex.busy("decode"):
        overlapped |= ex.busy("prefill") and ex.busy("decode")
        for res in ex.wait(None):
            results[res.batch.lane] = res
            if res.batch.lane == "prefill" and slices:
                ex.launch(slices.pop(0))
    assert overlapped
    assert np.array_equal(results["prefill"].tokens, pa.tokens)
    assert np.array_equal(results["decode"].tokens, da.tokens)


class SimTimed:
    """The GpuExecutor's CPU path runs every launch (its tokens come back); the simulator's clock times it, so
    ``serve()`` sees exactly the times the simulator alone would give (a fake clock for the real executor)."""

    def __init__(self, gpu_ex, sim) -> None:
        self.gpu, self.sim, self.tokens = gpu_ex, sim, {}
        self.now, self.busy, self.release = sim.now, sim.busy, gpu_ex.release

    def launch(self, batch):
        self.gpu.launch(batch)
        (res,) = self.gpu.wait(None)  # the CPU path computes inside launch
        self.tokens[batch.lane] = res.tokens
        self.sim.launch(batch)

    def wait(self, until):
        return [r._replace(tokens=self.tokens.pop(r.batch.lane)) for r in self.sim.wait(until)]


@pytest.mark.parametrize("arrays_from", [None, 2])
def test_bullet_parity_simulator_and_real_executor(weights, monkeypatch, arrays_from):
    """The bullet policy through serve() with the simulator, and with the real executor's CPU path on a fake
    clock, makes the identical sequence of batches (lanes, partitions, layer slices, chunks, fused steps), and
    the real run's outputs equal the float64 reference. TPOT loans off: with them decode's slower steps
    outlast every 1-layer slice, and this scenario would have no fused stretch to compare. ``arrays_from`` 2:
    decode launches planned from the decode arrays (``Bullet._array_decode``, 64 running requests or more by
    default) with 2 running, so that the real executor writes KV into blocks the block manager reserved and
    named only when the executor read the launch's tables."""
    from bullet.config import SloConfig
    from bullet.policies.bullet import Bullet
    from simulator import SimExecutor

    monkeypatch.setattr("bullet.policies.bullet.BORROW_CAP", 0.0)
    planned = []
    if arrays_from is not None:
        monkeypatch.setattr("bullet.policies.bullet.ARRAYS_FROM", arrays_from)
        plan_from_arrays = Bullet._array_decode

        def spy(self, *a, **k):
            batch = plan_from_arrays(self, *a, **k)
            planned.append(batch)
            return batch

        monkeypatch.setattr(Bullet, "_array_decode", spy)
        reserve = BlockManager.reserve

        def reserved(self, req_ids, blocks, added):
            planned.append(added)
            return reserve(self, req_ids, blocks, added)

        monkeypatch.setattr(BlockManager, "reserve", reserved)

    gpu = GPUS["h200"]
    lat = LinearLatency(SPEC.num_layers, base=2e-3, per_token=1e-3)
    slo = SloConfig(ttft=None, ttft_per_token=0.02, tpot=0.05)
    cfg = SchedulerConfig(policy="bullet", max_batched_tokens=48, layers_per_step=1)

    def go(executor_of):
        reqs = make_requests(9, seed=4, with_ids=True)
        for i, r in enumerate(reqs):
            r.arrival = 0.004 * i
        kv = BlockManager(64, 4)
        sched = make_scheduler(cfg, SPEC, gpu, kv, lat, slo=slo)
        steps = []
        done = serve(reqs, sched, executor_of(), on_step=steps.append)
        plan = [(s.batch.lane, s.batch.partition.num_sms, s.batch.layers, s.batch.steps,
                 tuple((c.req_id, c.start, c.num_tokens, tuple(c.block_ids), c.sample) for c in s.batch.chunks),
                 s.start, s.end) for s in steps]
        return done, plan, reqs

    _, sim_plan, _ = go(lambda: SimExecutor(lat, SPEC.num_layers, gpu))
    from bullet.gpu.partitions import PartitionMenu

    real = GpuExecutor(SPEC, "dummy", "cpu", block_size=4, num_blocks=64, seed=SEED, weights=weights,
                       menu=PartitionMenu.fallback())  # the menu's sizes: the executor checks every launch
    done, real_plan, reqs = go(lambda: SimTimed(real, SimExecutor(lat, SPEC.num_layers, gpu)))
    real.close()
    assert real_plan == sim_plan
    assert len({p[1] for p in sim_plan if p[0] == "prefill"}) > 1  # the split really moved
    assert any(p[0] == "decode" and p[3] > 1 for p in sim_plan)  # fused decode steps ran on the real executor
    assert any(p[0] == "decode" and p[1] < 132 for p in sim_plan) and any(p[2].stop < SPEC.num_layers
                                                                             for p in sim_plan)
    check_against_reference(weights, done, reqs)
    if arrays_from is not None:  # the array path planned launches in both runs and reserved blocks for them
        assert sum(1 for b in planned if isinstance(b, Batch)) >= 2
        assert sum(b for b in planned if isinstance(b, int)) > 0


def test_bullet_pauses_a_job_for_an_urgent_prompt_on_both_executors(weights, monkeypatch):
    """A long prompt's two-slice job is set aside after its first slice for a short prompt that would miss its
    per-token TTFT target behind it, and resumed after; the real executor's CPU path (fake clock) runs the
    identical plan, holding the paused job's hidden state, with outputs equal to the reference. Times by hand
    (LinearLatency: (2 ms + 1 ms per token) x half the layers x 132 / 124 SMs per slice): the long slice takes
    80.9 ms, the short prompt's two layers 3.19 ms each after it (in one launch: nobody waits behind it): TTFT
    72.3 ms against its 80 ms target."""
    from bullet.config import SloConfig
    from bullet.gpu.partitions import PartitionMenu
    from simulator import SimExecutor

    gpu = GPUS["h200"]
    lat = LinearLatency(SPEC.num_layers, base=2e-3, per_token=1e-3)
    slo = SloConfig(ttft=None, ttft_per_token=0.02, tpot=0.5)
    cfg = SchedulerConfig(policy="bullet", max_batched_tokens=48, layers_per_step=1)
    # decode on its TPOT floor (8 SMs) even with nobody waiting, so the hand timing holds: prefill on 124 SMs
    monkeypatch.setattr("bullet.policies.bullet.IDLE_KNEE", math.inf)

    def go(executor_of, pause=True):
        reqs = [Request(0, 0.0, 4, 30), Request(1, 0.0, 4, 30), Request(2, 0.03, 150, 12), Request(3, 0.045, 4, 2)]
        sched = make_scheduler(cfg, SPEC, gpu, BlockManager(256, 4), lat, slo=slo)
        if not pause:
            monkeypatch.setattr(sched, "_urgent", lambda now, d: False)
        steps = []
        done = serve(reqs, sched, executor_of(), on_step=steps.append)
        plan = [(s.batch.lane, s.batch.partition.num_sms, s.batch.layers, s.batch.steps,
                 tuple((c.req_id, c.start, c.num_tokens) for c in s.batch.chunks), s.start, s.end) for s in steps]
        return {r.id: r for r in done}, plan, sched

    done, sim_plan, sched = go(lambda: SimExecutor(lat, SPEC.num_layers, gpu))
    assert sched.num_paused == 1
    prefill = [(p[2], p[4]) for p in sim_plan if p[0] == "prefill" and p[4][0][0] >= 2]
    # the short prompt's job, with nobody waiting and no arrival to come, runs both its layers in one launch
    assert prefill == [(range(1), ((2, 0, 150),)), (range(2), ((3, 0, 4),)), (range(1, 2), ((2, 0, 150),))]
    long_slice = (2e-3 + 150e-3 + 150e-7) / 2 * 132 / 124  # LinearLatency by hand (per_kv 1e-7 per KV token)
    short_slice = (2e-3 + 4e-3 + 4e-7) / 2 * 132 / 124
    first = next(p for p in sim_plan if p[4] == ((2, 0, 150),))
    assert first[6] - first[5] == pytest.approx(long_slice, rel=1e-9)
    assert done[3].first_token_time == pytest.approx(first[6] + 2 * short_slice, rel=1e-9)
    assert done[3].first_token_time - done[3].arrival < 0.08
    late, _, _ = go(lambda: SimExecutor(lat, SPEC.num_layers, gpu), pause=False)
    assert late[3].first_token_time - late[3].arrival > 0.08  # behind the whole job it misses
    L = SPEC.num_layers
    for graphs in (False, True):  # eager slices, and slices replaying prefill graphs (one hidden-state buffer)
        real = GpuExecutor(SPEC, "dummy", "cpu", block_size=4, num_blocks=256, seed=SEED, weights=weights,
                           menu=PartitionMenu.fallback(), token_buckets=(16, 32, 64, 256))
        if graphs:
            real.capture_prefill("prefill", 124, layer_ranges=[range(L)] + [range(i, i + 1) for i in range(L)])
        real_done, real_plan, _ = go(lambda real=real: SimTimed(real, SimExecutor(lat, SPEC.num_layers, gpu)))
        replays = sum(pg.replays for pg in real.prefill_graphs.values())
        real.close()
        assert real_plan == sim_plan
        assert (replays >= 4) == graphs  # both jobs' slices replayed graphs
        check_against_reference(weights, list(real_done.values()), list(real_done.values()))


def test_warm_up_launches_cover_split_and_unsplit_decode_attention():
    """The warm-up's eager launches put decode rows beside the prompts both ways the decode attention runs:
    split over context slices (few rows) and unsplit (from 1,024 (row, KV head) pairs: 128 rows of
    Llama-3.1-8B's 8 KV heads, by hand), so neither kernel variant is compiled in the middle of serving."""
    from bullet.gpu.executor import warm_shapes
    from bullet.gpu.kernels.decode_attention import decode_splits

    spec = MODELS["llama-3.1-8b"]
    shapes = warm_shapes(spec)
    rows = sorted({len(dec) for _, dec in shapes})
    assert rows == [0, 5, 128]
    ctx = max(c for _, dec in shapes for c in dec)
    assert decode_splits(5, 8, ctx) > 1 and decode_splits(128, 8, ctx) == 1
    assert {tuple(p) for p, _ in shapes} == {((2049, 0),), ((701, 0), (601, 0), (901, 0)), ((1501, 700),),
                                             ((601, 0), (301, 1200))}


def test_shape_chunks_by_hand():
    """Decode rows first (one new token at context - 1), then prompt chunks over their prefixes; KV allocated
    for each (16-token blocks: 20 -> 2 blocks, 5 + 30 -> 3), ids counted up from the first."""
    from bullet.gpu.executor import shape_chunks
    from bullet.kvcache import BlockManager

    kv = BlockManager(64, 16)
    chunks = shape_chunks(kv, 100, [(30, 5)], [20, 1])
    assert [(c.req_id, c.start, c.num_tokens, c.sample) for c in chunks] == [(100, 19, 1, True), (101, 0, 1, True),
                                                                               (102, 5, 30, True)]
    assert [len(c.block_ids) for c in chunks] == [2, 1, 3] and kv.num_free == 64 - 6
    assert chunks[2].token_ids == (1,) * 30


def test_a_model_too_big_for_the_hosts_memory_is_refused_before_any_allocation():
    """On the CPU the executor keeps float32 weights: Llama-3.1-8B's 8,030,261,248 parameters (bullet.config's
    shapes: 32 layers x 218,112,000 + 2 x 128,256 x 4,096 embeddings and LM head + 4,096) are 32.1 GB, over a
    24 GB host's ~20 GB available, so it says so (model, GB, what to do) instead of being killed by the kernel's
    OOM killer; the tiny model passes."""
    from bullet.gpu.executor import check_host_memory

    llama = MODELS["llama-3.1-8b"]
    params = 32 * 218_112_000 + 2 * 128_256 * 4_096 + 4_096
    assert llama.weight_bytes == 2 * params
    with pytest.raises(ValueError, match=r"llama-3\.1-8b's weights need 32\.1 GB in float32 on the CPU, this host "
                                         r"has 20\.0 GB available: use a smaller model \(--model tiny-llama\)"):
        check_host_memory(llama, torch.float32, available=20_000_000_000)
    check_host_memory(llama, torch.float32, available=33_000_000_000)
    check_host_memory(SPEC, torch.float32, available=1 << 30)
