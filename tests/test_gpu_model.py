"""The paged model against the plain float32 reference: logits, layer slices, greedy decoding, HF folders,
weight errors, sampling. CPU tests use tiny shapes; ``gpu`` tests run on CUDA with real head layouts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from bullet.batch import Chunk
from bullet.config import MODELS, ModelSpec, RopeScaling
from bullet.gpu.attention import DecodeBuffers, build_meta
from bullet.gpu.kernels.gemv import GEMV_DEFAULT
from bullet.gpu.kvcache import PagedKvCache
from bullet.gpu.model import Model, reference_forward, rope_inv_freq
from bullet.gpu.sampling import sample
from bullet.gpu.weights import WeightError, load_tokenizer, load_weights, save_folder

TINY = MODELS["tiny-llama"]
VARIANTS = {
    "llama": TINY,
    "llama3-rope-tied": replace(TINY, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), tie_embeddings=True,
                                rope_theta=500000.0),
    "qwen2": replace(TINY, qkv_bias=True, rms_norm_eps=1e-6),
    "qwen3": replace(TINY, qk_norm=True, rms_norm_eps=1e-6),
}
BLOCK = 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


class Runner:
    """Drives Model over requests the way an executor would: block tables, chunks, metadata."""

    def __init__(self, spec: ModelSpec, weights, device, dtype, num_blocks: int = 256, block_size: int = BLOCK,
                 layout: str = "hnd"):
        self.spec, self.device, self.block_size = spec, torch.device(device), block_size
        self.model = Model(spec, weights, device, dtype)
        self.kv = PagedKvCache(spec, num_blocks, block_size, device, dtype, layout=layout)
        self.free = list(range(num_blocks - 1, -1, -1))
        np.random.default_rng(0).shuffle(self.free)  # scattered blocks: paging must not rely on order
        self.tables: dict[int, list[int]] = {}
        self.ids: dict[int, list[int]] = {}

    def chunk(self, rid: int, start: int, n: int) -> Chunk:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.block_size < start + n:
            table.append(self.free.pop())
        return Chunk(rid, start, n, tuple(table), True, tuple(self.ids[rid][start:start + n]))

    def run(self, chunks: list[Chunk], layers: range | None = None) -> tuple[torch.Tensor, object]:
        meta = build_meta(chunks, self.block_size, self.device, block_q=self.model.block_q)
        x = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device)
        h = self.model.forward(x, layers or range(self.spec.num_layers), meta, self.kv)
        return h, meta

    def logits_all(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        h, _ = self.run(chunks)
        rows = torch.arange(h.shape[0], device=self.device)
        logits = self.model.logits(h, rows)
        out, r = [], 0
        for c in chunks:
            out.append(logits[r:r + c.num_tokens])
            r += c.num_tokens
        return out


def random_ids(spec: ModelSpec, n: int, seed: int) -> list[int]:
    return torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", ["tiles", "sdpa", "sdpa-gqa"])
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_paged_fp32_matches_reference_prefill_chunked_and_decode(variant, path, layout):
    """Both prefill attention paths: the one-call kernel over the pool, SDPA per sequence (heads expanded or
    not)."""
    spec = VARIANTS[variant]
    w = load_weights(spec, "dummy", "cpu", torch.float32, seed=1)
    r = Runner(spec, w, "cpu", torch.float32, layout=layout)
    r.model.prefill_config = {} if path == "tiles" else {"sdpa": True, "enable_gqa": path == "sdpa-gqa"}
    lens = [5, 17, 33]
    for i, n in enumerate(lens):
        r.ids[i] = random_ids(spec, n + 8, seed=10 + i)
    ref = reference_forward(spec, w, [r.ids[i] for i in range(3)])
    # prefill: seq 0 whole, seq 1 and 2 in two chunks (the second over a cached prefix)
    got = r.logits_all([r.chunk(0, 0, 5), r.chunk(1, 0, 9), r.chunk(2, 0, 20)])
    assert rel(got[0], ref[0][:5]) < 1e-5
    assert rel(got[1], ref[1][:9]) < 1e-5
    assert rel(got[2], ref[2][:20]) < 1e-5
    # mixed batch: decode chunks first, then prefill continuations over a prefix
    got = r.logits_all([r.chunk(0, 5, 1), r.chunk(1, 9, 8), r.chunk(2, 20, 13)])
    assert rel(got[0], ref[0][5:6]) < 1e-5
    assert rel(got[1], ref[1][9:17]) < 1e-5
    assert rel(got[2], ref[2][20:33]) < 1e-5
    # decode steps for all three
    for step in range(4):
        starts = [6 + step, 17 + step, 33 + step]
        got = r.logits_all([r.chunk(i, s, 1) for i, s in enumerate(starts)])
        for i, s in enumerate(starts):
            assert rel(got[i], ref[i][s:s + 1]) < 1e-5, (step, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_token", [False, True])
def test_layer_slices_equal_full_forward(dtype, one_token):
    from bullet.gpu.kernels import INTERPRET

    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest)")
    spec = replace(TINY, num_layers=4)
    w = load_weights(spec, "dummy", "cpu", dtype, seed=2)
    outs = []
    for slices in ([range(4)], [range(1), range(1, 3), range(3, 4)]):
        r = Runner(spec, w, "cpu", dtype)
        r.ids[0], r.ids[1] = random_ids(spec, 12, 3), random_ids(spec, 7, 4)
        chunks = [r.chunk(0, 0, 12), r.chunk(1, 0, 7)]
        if one_token:  # a one-token forward after the prompt: the fused GEMV path
            r.run(chunks)
            r.model.gemv_config = {}
            r.ids[0].append(9)
            chunks = [r.chunk(0, 12, 1)]
        meta = build_meta(chunks, BLOCK, "cpu")
        h = torch.tensor([t for c in chunks for t in c.token_ids])
        for sl in slices:
            h = r.model.forward(h, sl, meta, r.kv)
        outs.append((h, r.kv.k.clone(), r.kv.v.clone()))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][2], outs[1][2])


def greedy_paged(r: Runner, prompts: list[list[int]], steps: int, buffers: DecodeBuffers | None) -> list[list[int]]:
    """Prefill every prompt in one launch, then ``steps - 1`` decode launches (through DecodeBuffers when
    given, padded to a bucket of 4 rows)."""
    n = len(prompts)
    for i, p in enumerate(prompts):
        r.ids[i] = list(p)
    chunks = [r.chunk(i, 0, len(p)) for i, p in enumerate(prompts)]
    h, meta = r.run(chunks)
    toks = sample(r.model.logits(h, meta.sample_rows), torch.zeros(n, device=r.device))
    out = [[int(t)] for t in toks.tolist()]
    for _ in range(steps - 1):
        for i in range(n):
            r.ids[i].append(out[i][-1])
        chunks = [r.chunk(i, len(r.ids[i]) - 1, 1) for i in range(n)]
        if buffers is None:
            h, meta = r.run(chunks)
            rows = meta.sample_rows
        else:
            bs = 4
            buffers.fill(chunks, bs)
            x = torch.zeros(bs, dtype=torch.int64, device=r.device)
            x[:n] = torch.tensor([c.token_ids[0] for c in chunks], device=r.device)
            h = r.model.forward(x, range(r.spec.num_layers), buffers.meta(bs), r.kv)
            rows = buffers.meta(bs).sample_rows[:n]
        toks = sample(r.model.logits(h, rows), torch.zeros(n, device=r.device))
        for i, t in enumerate(toks.tolist()):
            out[i].append(int(t))
    return out


def greedy_reference(spec, w, prompts, steps, device=None) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = list(p)
        for _ in range(steps):
            ids.append(int(reference_forward(spec, w, [ids], device=device)[0][-1].argmax()))
        outs.append(ids[len(p):])
    return outs


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("one_token_path", ["unfused", "fused-gemv"])
def test_greedy_64_tokens_paged_equals_reference(use_buffers, one_token_path):
    spec = TINY
    w = load_weights(spec, "dummy", "cpu", torch.float32, seed=5, scale=2.0)
    prompts = [random_ids(spec, 3, 6), random_ids(spec, 11, 7), random_ids(spec, 20, 8)]
    if one_token_path == "fused-gemv":
        prompts = prompts[1:2]  # one sequence: every decode step is a one-token forward
    r = Runner(spec, w, "cpu", torch.float32, num_blocks=128)
    if one_token_path == "fused-gemv":
        r.model.gemv_config = {}
    buffers = DecodeBuffers(8, 32, BLOCK, "cpu") if use_buffers else None
    got = greedy_paged(r, prompts, 64, buffers if one_token_path == "unfused" else None)
    want = greedy_reference(spec, w, prompts, 64)
    assert got == want
    assert len(set(got[0])) > 4  # not a degenerate repeat of one token


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_folder_loads_and_matches_reference(tmp_path, shards):
    spec = VARIANTS["qwen2"]
    w = load_weights(spec, "dummy", "cpu", torch.float32, seed=9)
    folder = save_folder(spec, w, tmp_path / "m", shards=shards)
    assert (folder / "model.safetensors.index.json").exists() == (shards > 1)
    spec2 = ModelSpec.from_hf_config(folder)
    assert (spec2.num_layers, spec2.hidden_size, spec2.num_kv_heads, spec2.qkv_bias) == (2, 64, 2, True)
    loaded = load_weights(spec, folder, "cpu", torch.float32)
    assert set(loaded) == set(w) and all(torch.equal(loaded[n], w[n]) for n in w)
    r = Runner(spec, loaded, "cpu", torch.float32)
    r.ids[0] = random_ids(spec, 9, 1)
    got = r.logits_all([r.chunk(0, 0, 9)])[0]
    assert rel(got, reference_forward(spec, w, [r.ids[0]])[0]) < 1e-5
    assert load_tokenizer(folder) is None


def test_weight_errors_name_the_tensor(tmp_path):
    spec = TINY
    w = load_weights(spec, "dummy", "cpu", torch.float32)
    bad = dict(w)
    del bad["model.layers.1.mlp.up_proj.weight"]
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    bad["model.layers.0.extra.weight"] = torch.zeros(2)
    with pytest.raises(WeightError) as e:
        Model(spec, bad, "cpu", torch.float32)
    msg = str(e.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "[128, 64]" in msg
    assert "model.layers.0.self_attn.k_proj.weight: expected [32, 64], got [3, 64]" in msg
    assert "model.layers.0.extra.weight" in msg
    folder = save_folder(spec, bad, tmp_path / "bad", shards=2)
    with pytest.raises(WeightError, match="up_proj"):
        load_weights(spec, folder, "cpu", torch.float32)
    with pytest.raises(WeightError, match="not a folder"):
        load_weights(spec, tmp_path / "nope", "cpu", torch.float32)


def test_rope_llama3_scaling_matches_elementwise_formula():
    import math

    spec = MODELS["llama-3.1-8b"]
    r = spec.rope_scaling
    got = rope_inv_freq(spec)
    for j, f in enumerate(spec.rope_theta ** (-(2 * j) / spec.head_dim) for j in range(spec.head_dim // 2)):
        wl = 2 * math.pi / f
        if wl < r.original_max_position / r.high_freq_factor:
            want = f
        elif wl > r.original_max_position / r.low_freq_factor:
            want = f / r.factor
        else:
            s = (r.original_max_position / wl - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
            want = (1 - s) * f / r.factor + s * f
        assert got[j].item() == pytest.approx(want, rel=1e-12)


def test_sampling_greedy_seeded_and_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    temp = torch.tensor([0.0, 1.0, 1.0, 0.7, 1.0, 0.0])
    seeds = torch.arange(6)
    a = sample(logits, temp, seeds=seeds, offsets=torch.full((6,), 3))
    b = sample(logits, temp, seeds=seeds, offsets=torch.full((6,), 3))
    assert torch.equal(a, b) and a.dtype == torch.int64
    assert torch.equal(sample(logits, None), logits.argmax(-1))
    assert a[0] == logits[0].argmax() and a[5] == logits[5].argmax()
    # a row's draw depends on its own seed/offset only, not on the batch around it
    c = sample(logits[1:2], temp[1:2], seeds=seeds[1:2], offsets=torch.full((1,), 3))
    assert c[0] == a[1]
    # top_p tiny: only the most likely token survives
    top = sample(logits, torch.ones(6), top_p=torch.full((6,), 1e-6), seeds=seeds)
    assert torch.equal(top, logits.argmax(-1))
    # the empirical distribution over many offsets matches softmax(logits / T)
    row = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    n = 20000
    draws = sample(row.expand(n, 5).contiguous(), torch.full((n,), 0.8), seeds=torch.full((n,), 42),
                   offsets=torch.arange(n))
    freq = torch.bincount(draws, minlength=5).double() / n
    assert torch.allclose(freq, torch.softmax(row.double() / 0.8, 0), atol=0.015)
    # top_p=0.6 on that row keeps tokens 4 and 0 only
    kept = sample(row.expand(2000, 5).contiguous(), torch.ones(2000), top_p=torch.full((2000,), 0.6),
                  seeds=torch.zeros(2000, dtype=torch.int64), offsets=torch.arange(2000))
    assert set(kept.tolist()) == {0, 4}


# --- GPU ---------------------------------------------------------------------------------------------


def _gpu_spec(kind: str) -> ModelSpec:
    """Real head layouts (32q/8kv or 28q/4kv, head_dim 128), few layers, a small vocabulary."""
    if kind == "llama":
        return replace(MODELS["llama-3.1-8b"], name="llama-2l", num_layers=2, vocab_size=4096)
    if kind == "qwen2":
        return replace(MODELS["qwen2.5-7b"], name="qwen2-2l", num_layers=2, vocab_size=4096)
    return replace(MODELS["qwen3-8b"], name="qwen3-2l", num_layers=2, vocab_size=4096)


PREFILL_CONFIGS = {"default": {}, "sdpa": {"sdpa": True}, "gqa": {"sdpa": True, "enable_gqa": True},
                   "flash": {"sdpa": True, "backends": ["FLASH_ATTENTION"]},
                   "cudnn": {"sdpa": True, "backends": ["CUDNN_ATTENTION"]},
                   "gqa+cudnn": {"sdpa": True, "enable_gqa": True, "backends": ["CUDNN_ATTENTION"]},
                   "tiles-32": {"tiles": {"block_n": 32, "num_warps": 4}}}


@pytest.mark.gpu
@pytest.mark.parametrize("kind,prefill", [("llama", "default"), ("qwen2", "default"), ("qwen3", "default"),
                                          ("llama", "sdpa"), ("qwen2", "tiles-32"), ("llama", "gqa"), ("llama", "flash"), ("llama", "cudnn"),
                                          ("qwen2", "gqa+cudnn")])
def test_gpu_bf16_logits_match_fp32_reference(kind, prefill):
    from torch.nn.attention import SDPBackend

    spec = _gpu_spec(kind)
    w = load_weights(spec, "dummy", "cuda", torch.float32, seed=3)
    r = Runner(spec, w, "cuda", torch.bfloat16, num_blocks=512, block_size=16)
    cfg = dict(PREFILL_CONFIGS[prefill])
    if "backends" in cfg:
        cfg["backends"] = [getattr(SDPBackend, b) for b in cfg["backends"]]
    r.model.prefill_config = cfg
    lens = [1, 37, 300]
    for i, n in enumerate(lens):
        r.ids[i] = random_ids(spec, n + 3, seed=i)
    ref = reference_forward(spec, w, [r.ids[i] for i in range(3)], device="cuda")
    got = r.logits_all([r.chunk(i, 0, n) for i, n in enumerate(lens)])
    for i, n in enumerate(lens):
        assert rel(got[i], ref[i][:n]) < 2e-2, (kind, i, rel(got[i], ref[i][:n]))
    for step in range(3):  # decode (paged kernel) and a prefix continuation
        chunks = [r.chunk(0, 1 + step, 1), r.chunk(1, 37 + step, 1), r.chunk(2, 300 + step, 1)]
        got = r.logits_all(chunks)
        for i, c in enumerate(chunks):
            assert rel(got[i], ref[i][c.start:c.start + 1]) < 2e-2, (kind, step, i)


@pytest.mark.gpu
def test_gpu_greedy_64_tokens_paged_equals_reference():
    spec = replace(_gpu_spec("llama"), num_layers=2)
    w = load_weights(spec, "dummy", "cuda", torch.float32, seed=5, scale=2.0)
    prompts = [random_ids(spec, 3, 6), random_ids(spec, 40, 7), random_ids(spec, 100, 8)]
    r = Runner(spec, w, "cuda", torch.float32, num_blocks=512, block_size=16)
    got = greedy_paged(r, prompts, 64, DecodeBuffers(8, 64, 16, "cuda"))
    assert got == greedy_reference(spec, w, prompts, 64, device="cuda")


@pytest.mark.gpu
def test_gpu_layer_slices_and_graph_replay_equal_eager():
    spec = replace(_gpu_spec("llama"), num_layers=4)
    w = load_weights(spec, "dummy", "cuda", torch.bfloat16, seed=2)
    outs = []
    for slices in ([range(4)], [range(1), range(1, 4)]):
        r = Runner(spec, w, "cuda", torch.bfloat16, num_blocks=256, block_size=16)
        r.ids[0], r.ids[1] = random_ids(spec, 120, 3), random_ids(spec, 70, 4)
        meta = build_meta([r.chunk(0, 0, 120), r.chunk(1, 0, 70)], 16, "cuda")
        h = torch.tensor(r.ids[0] + r.ids[1], device="cuda")
        for sl in slices:
            h = r.model.forward(h, sl, meta, r.kv)
        outs.append(h)
    assert torch.equal(outs[0], outs[1])
    # decode through a captured CUDA graph equals the eager decode on the same pool state
    buffers = DecodeBuffers(8, 32, 16, "cuda")
    r.ids[0].append(5)
    r.ids[1].append(6)
    chunks = [r.chunk(0, 120, 1), r.chunk(1, 70, 1)]
    buffers.fill(chunks, 4)
    x = buffers.input_ids[:4]
    x.zero_()
    x[:2] = torch.tensor([5, 6], device="cuda")
    meta = buffers.meta(4)
    layers = range(spec.num_layers)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        r.model.forward(x, layers, meta, r.kv)  # warm-up (Triton compile) outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h_graph = r.model.forward(x, layers, meta, r.kv)
    h_eager = r.model.forward(x, layers, meta, r.kv).clone()
    h_graph.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(h_graph[:2], h_eager[:2]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("cfg", [{"block_n": 8, "block_k": 512}, GEMV_DEFAULT])
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_gpu_batch1_decode_with_fused_gemv(kind, cfg, layout):
    spec = _gpu_spec(kind)
    w = load_weights(spec, "dummy", "cuda", torch.float32, seed=4)
    r = Runner(spec, w, "cuda", torch.bfloat16, num_blocks=64, block_size=16, layout=layout)
    r.model.gemv_config = dict(cfg)
    r.ids[0] = random_ids(spec, 50, seed=1)
    ref = reference_forward(spec, w, [r.ids[0]], device="cuda")[0]
    assert rel(r.logits_all([r.chunk(0, 0, 1)])[0], ref[:1]) < 2e-2  # one-token prefill: GEMV path too
    r.logits_all([r.chunk(0, 1, 40)])
    for p in range(41, 49):
        assert rel(r.logits_all([r.chunk(0, p, 1)])[0], ref[p:p + 1]) < 2e-2
    # the same step captured in a CUDA graph (PDL launches inside) equals the eager one
    meta = build_meta([r.chunk(0, 49, 1)], 16, "cuda")
    x = torch.tensor(r.ids[0][49:50], device="cuda")
    layers = range(spec.num_layers)
    h_eager = r.model.forward(x, layers, meta, r.kv).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h_graph = r.model.forward(x, layers, meta, r.kv)
    for _ in range(2):
        h_graph.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h_graph, h_eager)
    assert rel(r.model.logits(h_eager, meta.sample_rows), ref[49:50]) < 2e-2

def test_logits_padded_rows_hand_buckets_and_reference_values():
    """Several sampled rows run the lm_head product at a padded row count (warm-up shapes only); the rows
    asked for come back, in order, equal to the float64 product of those rows."""
    from bullet.gpu.model import logits_rows

    assert [logits_rows(n) for n in (1, 2, 3, 5, 64, 65, 128, 129, 300, 1025)] == \
        [1, 2, 4, 8, 64, 128, 128, 256, 384, 1152]
    model = Model(TINY, load_weights(TINY, "dummy", "cpu", torch.float32, seed=3), "cpu", torch.float32)
    hidden = torch.randn(300, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    for n in (2, 3, 57, 129):
        rows = torch.randperm(300, generator=torch.Generator().manual_seed(n))[:n]
        got = model.logits(hidden, rows, pad=True)
        ref = hidden[rows].double() @ model.lm_head.double().t()
        assert got.shape == (n, TINY.vocab_size) and got.dtype == torch.float32
        assert rel(got, ref) < 1e-5
