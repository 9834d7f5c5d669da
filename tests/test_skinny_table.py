"""The skinny GEMM table: loading (errors name the file and field), and Model routing the products a table
names to the skinny kernel, with the forward still equal to the float32 reference."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from bullet.batch import Chunk
from bullet.config import MODELS, ConfigError
from bullet.gpu import model as model_mod
from bullet.gpu.attention import build_meta
from bullet.gpu.kernels.skinny import PRODUCTS, SkinnyConfig, decode_products, load_table
from bullet.gpu.kvcache import PagedKvCache
from bullet.gpu.model import Model, reference_forward
from bullet.gpu.weights import load_weights

TINY = MODELS["tiny-llama"]
LLAMA = MODELS["llama-3.1-8b"]


def doc(spec=LLAMA, gpu="NVIDIA H200", choices=None) -> dict:
    return {"version": 1, "gpu": gpu, "model": spec.name,
            "products": {k: list(v) for k, v in decode_products(spec).items()},
            "choices": choices if choices is not None else [
                {"sms": 40, "rows": 16, "product": "o", "config": SkinnyConfig(64, 128, 1, 4, 4)._asdict()},
                {"sms": 40, "rows": 16, "product": "lm_head", "config": SkinnyConfig(128, 64, 1, 8, 3)._asdict()},
                {"sms": 132, "rows": 64, "product": "gate_up", "config": SkinnyConfig(64, 64, 1, 4, 4)._asdict()}]}


def write(tmp_path, d) -> str:
    p = tmp_path / "skinny.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_decode_products_are_llama_8b_shapes():
    # by hand from the Llama-3.1-8B config: 32 heads x 128, 8 KV heads, hidden 4096, ffn 14336, vocab 128256
    assert decode_products(LLAMA) == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                      "down": (4096, 14336), "lm_head": (128256, 4096)}


def test_load_table_reads_the_choices(tmp_path):
    table = load_table(write(tmp_path, doc()), LLAMA, "NVIDIA H200")
    assert table == {(40, 16): {"o": SkinnyConfig(64, 128, 1, 4, 4), "lm_head": SkinnyConfig(128, 64, 1, 8, 3)},
                     (132, 64): {"gate_up": SkinnyConfig(64, 64, 1, 4, 4)}}


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(gpu="NVIDIA H100 80GB HBM3"), "measured on NVIDIA H100 80GB HBM3, this GPU is NVIDIA H200"),
    (lambda d: d["products"].update(down=[4096, 12288]), "not llama-3.1-8b's"),
    (lambda d: d.update(version=7), "version 7"),
    (lambda d: d["choices"][1].pop("rows"), "choices[1].rows is missing"),
    (lambda d: d["choices"][0].update(product="up"), "choices[0].product 'up'"),
    (lambda d: d["choices"][2].update(rows=300), "choices[2].rows must be 1..256"),
    (lambda d: d["choices"][2]["config"].update(block_m=16), "choices[2].config"),
    (lambda d: d["choices"][0]["config"].update(splits=0), "positive integers"),
    (lambda d: d.pop("choices"), "choices is missing"),
])
def test_load_table_errors_name_file_and_field(tmp_path, edit, message):
    d = doc()
    edit(d)
    path = write(tmp_path, d)
    with pytest.raises(ConfigError, match="skinny.json") as e:
        load_table(path, LLAMA, "NVIDIA H200")
    assert message in str(e.value)


def test_load_table_refuses_a_truncated_file(tmp_path):
    p = tmp_path / "skinny.json"
    p.write_text(json.dumps(doc())[:50])
    with pytest.raises(ConfigError, match="cannot read"):
        load_table(p, LLAMA, "NVIDIA H200")


def run_decode(model, kv, tables, starts, ids, device):
    chunks = [Chunk(i, s, 1, tuple(tables[i]), True, (ids[i][s],)) for i, s in enumerate(starts)]
    meta = build_meta(chunks, kv.block_size, device, block_q=model.block_q)
    x = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.int64, device=device)
    h = model.forward(x, range(model.spec.num_layers), meta, kv)
    return model.logits(h, torch.arange(len(chunks), device=device))


def check_routing(device, dtype, tol, monkeypatch, sms=8):
    """Decode steps of 3 sequences with a table naming every product at (sms, 3 rows): each layer's four
    products and the LM head go to the skinny kernel, and the logits equal the float32 reference's."""
    spec = TINY
    w = load_weights(spec, "dummy", device, torch.float32, seed=2)
    model = Model(spec, w, device, dtype)
    model.gemv_config = None
    model.skinny = {(sms, 3): {p: SkinnyConfig(16, 32, 2 if p == "down" else 1, 4, 2) for p in PRODUCTS}}
    calls = []
    real = model_mod.skinny_linear

    def counted(x, w, **kw):
        calls.append((tuple(w.shape), kw.get("swiglu", False), kw.get("residual") is not None))
        return real(x, w, **kw)

    monkeypatch.setattr(model_mod, "skinny_linear", counted)
    kv = PagedKvCache(spec, 64, 4, device, dtype)
    lens = [6, 11, 3]
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, spec.vocab_size, (n + 3,), generator=gen).tolist() for n in lens]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    ref = reference_forward(spec, w, ids, device=device)
    with model.on_sms(sms):  # the prompts: 20 rows, not in the table: cuBLAS
        chunks = [Chunk(i, 0, n, tuple(tables[i]), True, tuple(ids[i][:n])) for i, n in enumerate(lens)]
        meta = build_meta(chunks, kv.block_size, device, block_q=model.block_q)
        x = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=device)
        model.forward(x, range(spec.num_layers), meta, kv)
        assert calls == []
        for step in range(2):
            starts = [n + step for n in lens]
            got = run_decode(model, kv, tables, starts, ids, device)
            for i, s in enumerate(starts):
                err = (got[i].double() - ref[i][s].double()).norm() / ref[i][s].double().norm()
                assert err < tol, (step, i, float(err))
    n = decode_products(spec)
    per_step = [((n["qkv"]), False, False), (n["o"], False, True), (n["gate_up"], True, False),
                (n["down"], False, True)] * spec.num_layers + [(n["lm_head"], False, False)]
    assert calls == per_step * 2
    calls.clear()
    with model.on_sms(sms + 8):  # another partition: not in the table
        run_decode(model, kv, tables, [n + 2 for n in lens], ids, device)
    assert calls == []


def test_model_routes_table_products_to_skinny_cpu(monkeypatch):
    check_routing("cpu", torch.float32, 1e-5, monkeypatch)


@pytest.mark.gpu
def test_gpu_model_routes_table_products_to_skinny(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    check_routing("cuda", torch.bfloat16, 2e-2, monkeypatch)


@pytest.mark.gpu
def test_gpu_executor_loads_a_table_and_refuses_another_gpus(tmp_path):
    """A table given by path is loaded (and named), one measured on another GPU is refused naming both; under
    "auto" a table from another GPU is skipped with a warning (the shipped file's folder is the GPU's short
    name, which two GPUs can share)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from bullet.gpu.executor import GpuExecutor

    name = torch.cuda.get_device_name()
    good = write(tmp_path, doc(TINY, gpu=name, choices=[
        {"sms": 8, "rows": 4, "product": "o", "config": SkinnyConfig(16, 32, 1, 4, 2)._asdict()}]))
    ex = GpuExecutor(TINY, "dummy", "cuda", num_blocks=256, skinny=good)
    try:
        assert ex.skinny_source == good and ex.model.skinny == {(8, 4): {"o": SkinnyConfig(16, 32, 1, 4, 2)}}
    finally:
        ex.close()
    other = tmp_path / "other"
    other.mkdir()
    bad = write(other, doc(TINY, gpu="NVIDIA B200"))
    with pytest.raises(ConfigError, match=f"measured on NVIDIA B200, this GPU is {name}"):
        GpuExecutor(TINY, "dummy", "cuda", num_blocks=256, skinny=bad)
