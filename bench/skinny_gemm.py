"""Decode products on one GPU: cuBLAS (as ``Model.forward`` runs them today) against the skinny kernel
(``bullet/gpu/kernels/skinny.py``) over a sweep of its tile shapes and K splits, at a model's shapes.

    PYTHONPATH=. python3 bench/skinny_gemm.py [--model llama-3.1-8b] [--rows 16,64,128,256] [--sms 0,40,64]
        [--jobs 8] [--out F] [--table profiles/h200/llama-3.1-8b/skinny.json [--margin 0.03]
        [--gemm-csv profiles/h200/llama-3.1-8b/gemm.csv]]
    PYTHONPATH=. python3 bench/skinny_gemm.py --model qwen3-8b --cublas-only --rows ... --sms ... \
        --gemm-csv profiles/h200/qwen3-8b/gemm.csv

Per row count M and product (q/k/v, o + residual, gate/up + SiLU x up, down + residual, LM head): each
configuration is first checked against a float64 reference on random data (relative error < 1e-2 in bf16),
then timed as a CUDA graph replaying the product over enough weight copies that they do not fit in L2
(>= 256 MB a replay), median of 20 replays after warm-up, on the whole GPU (``--sms 0``) or on a decode
partition of the nested green-context menu (the graph is captured on the partition's stream, so it keeps
its SMs). Rate = weight bytes / time (the weights are what a decode product must move; x and y are a few
MB). The kernels are compiled first in ``--jobs`` processes (Triton's disk cache), then timed one at a time.
Prints, per M, the best configuration per product against cuBLAS, and the whole decode step's products
(all layers + LM head) summed. ``--out``: every timing as JSON. ``--table``: the choices the executor
loads (``kernels.skinny.load_table``): for each (SMs, M, product) the best skinny config where it took at least
``--margin`` less time than cuBLAS (else the product stays on cuBLAS there). For a table, give ``--rows`` the
decode graphs' batch buckets and ``--sms`` the decode partition sizes the policies use. ``--gemm-csv`` (with
``--table``): every (SMs, M, product) of the layers' four products with both times and the kernel the table
makes the executor take, the profile folder's ``gemm.csv`` that ``bullet fit`` reads (``fit.read_gemm``).
``--cublas-only`` times cuBLAS alone: the ``gemm.csv`` of a model the executor runs without a skinny table (its
profile folder has no ``skinny.json``: every product on cuBLAS), written without ``--table``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_kernels import graph_time
from bullet.config import resolve_model
from bullet.gpu.kernels import next_pow2
from bullet.gpu.kernels.activation import silu_mul
from bullet.gpu.kernels.skinny import SMEM_BYTES, TABLE_VERSION, SkinnyConfig, decode_products, skinny_linear

EPILOGUES = {"qkv": "plain", "o": "residual", "gate_up": "swiglu", "down": "residual", "lm_head": "plain"}


def products(model: str) -> dict[str, tuple[int, int, str, int]]:
    """(N, K, epilogue, times per step) of each decode product of ``model``."""
    spec = resolve_model(model)
    return {name: (n, k, EPILOGUES[name], 1 if name == "lm_head" else spec.num_layers)
            for name, (n, k) in decode_products(spec).items()}



def candidates(n: int, k: int, m: int, mode: str, sms: int) -> list[SkinnyConfig]:
    """Tile shapes for an M x N x K product: W tiles of 32-128 rows by 64-256 columns, 3 or 4 stages, and the
    smallest K split (1-8) that gives at least one program per SM."""
    bm, out = max(16, next_pow2(m)), []
    w_mult = 2 if mode == "swiglu" else 1
    for bn in (32, 64, 128):
        n_out = n // 2 if mode == "swiglu" else n
        tiles = -(-n_out // bn)
        splits = next((s for s in (1, 2, 4, 8) if tiles * s >= sms and k // s >= 512), 8)
        for bk in (64, 128, 256):
            for stages in (3, 4):
                if (bn * bk * w_mult + bm * bk) * 2 * stages > SMEM_BYTES:
                    continue
                warps = 8 if bn * bm >= 128 * 64 else 4
                out.append(SkinnyConfig(bn, bk, splits, warps, stages))
    return out


def make(n: int, k: int, m: int, mode: str, copies: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(m * 7 + n)
    ws = [(torch.randn(n, k, generator=g, device=dev) / k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
    return {"ws": ws, "x": torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16),
            "r": torch.randn(m, n // 2 if mode == "swiglu" else n, generator=g, device=dev).to(torch.bfloat16)}


def run_cublas(t: dict, w: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "residual":
        return t["r"].addmm_(t["x"], w.t())
    if mode == "swiglu":
        return silu_mul(F.linear(t["x"], w))
    return F.linear(t["x"], w)


def run_skinny(t: dict, w: torch.Tensor, mode: str, cfg: SkinnyConfig) -> torch.Tensor:
    if mode == "residual":
        return skinny_linear(t["x"], w, residual=t["r"], config=cfg)
    return skinny_linear(t["x"], w, swiglu=mode == "swiglu", config=cfg)


def reference(t: dict, w: torch.Tensor, mode: str, r0: torch.Tensor) -> torch.Tensor:
    y = t["x"].double() @ w.double().T
    if mode == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return gate * torch.sigmoid(gate) * up
    return y + r0.double() if mode == "residual" else y


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    return float((a - b).norm() / b.norm()) if not torch.isnan(a).any() else float("inf")


def compile_worker(args: tuple[str, list]) -> int:
    """Run each (product, M, config) once so that Triton compiles it into its disk cache."""
    model, jobs = args
    prods = products(model)
    dev = torch.device("cuda")
    for name, m, cfgs in jobs:
        n, k, mode, _ = prods[name]
        t = make(n, k, m, mode, 1, dev)
        for c in cfgs:
            run_skinny(t, t["ws"][0], mode, SkinnyConfig(*c))
    torch.cuda.synchronize()
    return len(jobs)


def time_product(name: str, shape: tuple[int, int, str, int], m: int, sms: int, cfgs: list[SkinnyConfig], stream,
                 dev) -> dict:
    """cuBLAS and every config of one product (``shape``: N, K, epilogue) at M rows on one partition: checked,
    then timed."""
    n, k, mode, _ = shape
    copies = max(1, -(-(256 << 20) // (n * k * 2)))
    t = make(n, k, m, mode, copies, dev)
    r0 = t["r"].clone()
    row = {"product": name, "rows": m, "sms": sms, "N": n, "K": k, "copies": copies}

    def over_copies(fn):
        def go():
            for w in t["ws"]:
                fn(w)
        return go

    want = reference(t, t["ws"][0], mode, r0)
    row["cublas_err"] = rel(run_cublas(t, t["ws"][0], mode), want)
    row["cublas_s"] = graph_time(over_copies(lambda w: run_cublas(t, w, mode)), stream) / copies
    best = None
    for c in cfgs:
        t["r"].copy_(r0)
        with torch.cuda.stream(stream):
            got = run_skinny(t, t["ws"][0], mode, c)
            torch.cuda.current_stream().synchronize()
        err = rel(got, want)
        if err > 1e-2:
            print(f"WRONG {name} M={m} {c}: rel {err:.3g}", flush=True)
            row.setdefault("wrong", []).append([list(c), err])
            continue
        s = graph_time(over_copies(lambda w, c=c: run_skinny(t, w, mode, c)), stream) / copies
        row.setdefault("skinny", []).append([list(c), s, err])
        if best is None or s < best[1]:
            best = (c, s)
    row["best"] = [list(best[0]), best[1]] if best else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="model preset whose products are measured")
    ap.add_argument("--rows", default="16,64,128,256", help="row counts M (comma-separated, <= 256)")
    ap.add_argument("--sms", default="0", help="SM counts to run on: 0 = the whole GPU, else decode partitions")
    ap.add_argument("--products", default=",".join(EPILOGUES), help="which products (default: all five)")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the kernels first")
    ap.add_argument("--out", default="", help="write every timing here as JSON")
    ap.add_argument("--table", default="", help="write the executor's table of skinny choices here (JSON)")
    ap.add_argument("--gemm-csv", default="",
                    help="with --table: write every cell's cuBLAS and skinny times and the kernel taken here (CSV), "
                         "the profile's gemm.csv for `bullet fit`")
    ap.add_argument("--margin", type=float, default=0.03,
                    help="a skinny config enters the table only if it took at least this fraction less time")
    ap.add_argument("--shapes", default="",
                    help="tile shapes to try, as BN:BK:STAGES,... (default: all of candidates())")
    ap.add_argument("--cublas-only", action="store_true",
                    help="time cuBLAS alone (no skinny configs): with --gemm-csv, the table of a model whose executor "
                         "has no skinny table (every cell taken by cuBLAS); --table is then refused")
    args = ap.parse_args()
    if args.cublas_only and args.table:
        ap.error("--cublas-only measures no skinny config: there is no table to write (leave --table out)")
    if args.gemm_csv and not (args.table or args.cublas_only):
        ap.error("--gemm-csv needs --table (the table decides which kernel each cell takes) or --cublas-only")
    prods = products(args.model)
    shapes = {tuple(int(v) for v in x.split(":")) for x in args.shapes.split(",")} if args.shapes else None
    rows = [int(x) for x in args.rows.split(",")]
    names = args.products.split(",")
    dev = torch.device("cuda")
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    from bullet.gpu.partitions import PartitionMenu

    menu = PartitionMenu.create()
    sides = []
    for s in (int(x) for x in args.sms.split(",")):
        side = menu.full if s in (0, total_sms) else menu.side("decode", s)
        sides.append((side.num_sms, side.stream))

    work = [(name, m, sms, [c for c in candidates(*prods[name][:2], m, prods[name][2], sms)
                            if not args.cublas_only
                            and (shapes is None or (c.block_n, c.block_k, c.num_stages) in shapes)])
            for sms, _ in sides for m in rows for name in names]
    t0 = time.time()
    jobs: dict[tuple, set] = {}
    for name, m, _, cfgs in work:
        jobs.setdefault((name, m), set()).update(tuple(c) for c in cfgs)
    chunks = [[] for _ in range(max(1, args.jobs))]
    for i, (key, cfgs) in enumerate(sorted(jobs.items())):
        for j, c in enumerate(sorted(cfgs)):
            chunks[(i + j) % len(chunks)].append((key[0], key[1], [c]))
    with mp.get_context("spawn").Pool(len(chunks)) as pool:
        pool.map(compile_worker, [(args.model, c) for c in chunks if c])
    print(f"compiled {sum(len(c) for c in jobs.values())} kernels in {time.time() - t0:.0f} s", flush=True)

    results = []
    for name, m, sms, cfgs in work:
        row = time_product(name, prods[name], m, sms, cfgs, dict(sides)[sms], dev)
        results.append(row)
        wbytes, best = row["N"] * row["K"] * 2, row["best"]
        sk = f"{best[1] * 1e6:8.1f} us {wbytes / best[1] / 1e12:.2f} TB/s {tuple(best[0])}" if best else "-"
        print(f"{sms:>3} SMs  M={m:<3} {name:<8} cuBLAS {row['cublas_s'] * 1e6:8.1f} us "
              f"{wbytes / row['cublas_s'] / 1e12:.2f} TB/s | skinny {sk}", flush=True)

    print("\n| SMs | M | product | cuBLAS us (TB/s) | skinny best us (TB/s) | config (block_n, block_k, splits, "
          "warps, stages) | speed-up |")
    print("|---:|---:|---|---:|---:|---|---:|")
    for r in results:
        wb = r["N"] * r["K"] * 2
        b = r["best"]
        print(f"| {r['sms']} | {r['rows']} | {r['product']} | {r['cublas_s'] * 1e6:.1f} ({wb / r['cublas_s'] / 1e12:.2f}) | "
              + (f"{b[1] * 1e6:.1f} ({wb / b[1] / 1e12:.2f}) | {tuple(b[0])} | {r['cublas_s'] / b[1]:.2f}x |"
                 if b else "- | - | - |"))
    print("\nWhole step's products (all layers + LM head), from the rows above:")
    print("| SMs | M | weights GB | cuBLAS ms (TB/s) | best skinny or cuBLAS per product ms (TB/s) |")
    print("|---:|---:|---:|---:|---:|")
    for sms, _ in sides:
        for m in rows:
            rs = [r for r in results if r["sms"] == sms and r["rows"] == m]
            if len(rs) != len(prods):
                continue
            wb = sum(r["N"] * r["K"] * 2 * prods[r["product"]][3] for r in rs)
            cb = sum(r["cublas_s"] * prods[r["product"]][3] for r in rs)
            mix = sum(min(r["cublas_s"], r["best"][1] if r["best"] else 1.0) * prods[r["product"]][3] for r in rs)
            print(f"| {sms} | {m} | {wb / 1e9:.2f} | {cb * 1e3:.2f} ({wb / cb / 1e12:.2f}) | {mix * 1e3:.2f} "
                  f"({wb / mix / 1e12:.2f}) |")
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "model": args.model,
                                              "date": date, "results": results}, indent=1))
    if args.table:
        taken = write_table(Path(args.table), args, prods, results, date)
        if args.gemm_csv:
            write_gemm_csv(Path(args.gemm_csv), results, taken)
    elif args.gemm_csv:  # --cublas-only: the executor takes cuBLAS everywhere
        write_gemm_csv(Path(args.gemm_csv), results, set())
    menu.close()


def write_table(path: Path, args, prods: dict, results: list[dict], date: str) -> set[tuple[int, int, str]]:
    """The executor's table (``kernels.skinny.load_table``): the winning skinny configs, where they won by
    ``args.margin``; written to a temporary file and renamed. Returns the (SMs, M, product) cells it lists."""
    choices = [{"sms": r["sms"], "rows": r["rows"], "product": r["product"],
                "config": SkinnyConfig(*r["best"][0])._asdict(), "skinny_s": r["best"][1], "cublas_s": r["cublas_s"]}
               for r in results if r["best"] and r["best"][1] <= (1 - args.margin) * r["cublas_s"]]
    doc = {"version": TABLE_VERSION, "gpu": torch.cuda.get_device_name(), "model": args.model,
           "products": {name: list(v[:2]) for name, v in prods.items()}, "measured": date,
           "command": "python3 bench/skinny_gemm.py " + " ".join(sys.argv[1:]), "margin": args.margin,
           "sms": sorted({r["sms"] for r in results}), "rows": sorted({r["rows"] for r in results}),
           "choices": choices}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    print(f"{path}: {len(choices)} of {len(results)} (SMs, M, product) take the skinny kernel")
    return {(c["sms"], c["rows"], c["product"]) for c in choices}


def write_gemm_csv(path: Path, results: list[dict], taken: set[tuple[int, int, str]]) -> None:
    """``gemm.csv`` for ``bullet fit``: the layers' products (the LM head left out, as the fit does) at every
    (SMs, M), seconds with cuBLAS and with the best skinny config (empty where none ran), and which one the
    executor takes; written to a temporary file and renamed."""
    from bullet.perfmodel.fit import GEMM_COLUMNS
    from bullet.perfmodel.fitted import GEMM_PRODUCTS

    lines = [",".join(GEMM_COLUMNS)]
    for r in sorted((r for r in results if r["product"] in GEMM_PRODUCTS),
                    key=lambda r: (r["sms"], r["rows"], GEMM_PRODUCTS.index(r["product"]))):
        sk = f"{r['best'][1]:.4g}" if r["best"] else ""
        kind = "skinny" if (r["sms"], r["rows"], r["product"]) in taken else "cublas"
        lines.append(f"{r['sms']},{r['rows']},{r['product']},{r['cublas_s']:.4g},{sk},{kind}")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    print(f"{path}: {len(lines) - 1} cells")


if __name__ == "__main__":
    main()
