"""``bullet fit``: a profile folder (``points.csv`` + ``metadata.json`` from ``bullet profile``) -> a fitted
latency model (JSON, read by :class:`~bullet.perfmodel.fitted.FittedModel`), with its held-out error.

Each family of ``fitted.py`` is a non-negative least-squares fit (scikit-learn ``LinearRegression(positive=
True)``, weighted by 1 / target^2 so that it minimises relative error) of the measured times on the terms
of :func:`default_terms`; the eager family's per-size ramps are also pulled towards weights linear in 1/n
(:func:`ramp_penalty`, :data:`RAMP_SMOOTHING`). The contention families are fitted second, on the measured co-run time over the
stand-alone prediction (``co_eager`` weighted by 1 / (that ratio)^2: relative error of the co-run time).
Held-out error: a seeded random 20 % of the points, leave-one-partition-size-out (loso: every point measured on
that SM count held out, the rest fitted), and interior loso (the same, never holding out a lane's smallest or
largest size), as MAPE mean and p95 per family and for whole launches; the thresholds apply to the random and
the interior split. scikit-learn is imported here only; prediction never needs it.
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError, ModelSpec
from .base import Work, partly_co_run
from .fitted import (
    CO_DECODE_Q,
    CO_EAGER_Q,
    DEFAULT_KERNELS,
    FAMILIES,
    FORMAT,
    FORMAT_VERSION,
    GEMM_PRODUCTS,
    HOST_Q,
    SHAPE_KEYS,
    FittedModel,
    GemmTable,
    GraphLimits,
    Quantities,
    basis_table,
    spec_dict,
)

COLUMNS = ("id", "kind", "lane", "sms", "layers", "seqs", "tokens", "decode_seqs", "attn_pairs", "kv_read",
           "max_ctx", "samples", "embed", "steps", "co_kind", "co_sms", "co_tokens", "co_seqs", "co_kv_read",
           "co_attn_pairs", "co_layers", "overlap", "gpu_s", "first_s", "step_s", "host_s", "gpu_s_min",
           "gpu_s_max", "reps")  # bullet/gpu/profile.py's COLUMNS (tests check they agree)
INT_COLS = ("sms", "layers", "seqs", "tokens", "decode_seqs", "kv_read", "max_ctx", "samples", "embed", "steps",
            "co_sms", "co_tokens", "co_seqs", "co_kv_read", "co_layers", "reps")
FLOAT_COLS = ("attn_pairs", "co_attn_pairs", "overlap", "gpu_s", "first_s", "step_s", "host_s", "gpu_s_min",
              "gpu_s_max")
CHOICES = {"kind": ("prefill", "decode", "mixed"), "lane": ("all", "prefill", "decode"),
           "co_kind": ("", "prefill", "decode")}
META_KEYS = ("model", "model_spec", "gpu", "num_sms")

# Knots of the N / min(n, K) SM basis (fitted.py); the whole GPU is always one.
KNOTS = (16, 32, 48, 64, 96)
# The eager family's ramps fit a weight per measured partition size almost freely, so a physical term (the grid
# rounds) and the ramps can explain the same points in sample and split them arbitrarily; held out, the split decides
# the interpolation. The fit penalises each quantity's per-size weight for its distance from the line (in 1/n) through
# its two neighbouring sizes, times this factor and the quantity's mean contribution to a point's relative time:
# bumps go to the physical terms. bench/RESULTS.md, "Co-run prefill and the eager ramps": prefill interior 2.70 ->
# 2.48 % (0.3: 2.50, 3: 2.57, 10: 2.70), co-run prefill interior 3.52 -> 2.85 % on the H200 Llama-3.1-8B profile.
RAMP_SMOOTHING = 1.0
# a launch counts as GPU-bound (its gpu_s measures the GPU, not the host) above this multiple of host_s
GPU_BOUND = 1.15
THRESHOLDS = {"family_mean": 0.03, "launch_mean": 0.05, "launch_p95": 0.10}
# families whose MAPE is gated (host time is reported, and gated through whole launches)
GATED = ("decode step", "decode first", "prefill", "mixed", "co-run prefill", "co-run decode")


def ramp_bases(sms) -> list[str]:
    """The ramps (fitted.py ``r<first>_<knot>_<next>``) on the partition sizes ``sms``, one per size."""
    ks = sorted(set(sms))
    return [f"r{ks[0]}_{k}_{ks[i + 1] if i + 1 < len(ks) else 0}" for i, k in enumerate(ks)]


def default_terms(num_sms: int, knots=KNOTS, eager_sms=(), gemm: bool = False) -> dict[str, list[tuple[str, str]]]:
    """The terms of every family. ``eager_sms``: the partition sizes (below the whole GPU) that solo prefill or
    mixed points were measured on; with any, the eager family's quantities take one ramp per size (a
    non-increasing weight per size, interpolated in 1/n between them), else the ``k<K>`` bases. ``gemm``: the
    profile has a measured GEMM table (``gemm.csv``): the decode families take its time as one more term, and the
    co-run prefill its co-runner's GEMM share (``co_gemm_co_sm``; without a table, ``co_tc_co_sm``: whether the
    co-runner runs GEMMs on the tensor cores at all)."""
    ks = [f"k{k}" for k in knots if k < num_sms] + [f"k{num_sms}"]
    dec = [(q, b) for q in ("weights", "weights_gemv", "kv", "rows") for b in ks]
    dec += [("weights", "full"), ("kv", "full"), ("rows", "full"), ("longest", "one"), ("longest_extra", "one"),
            ("gemm_waves", "one"), ("layers", "one"), ("launch", "one")]
    if gemm:
        dec.append(("gemm_table", "one"))
    hs = ramp_bases(s for s in eager_sms if s < num_sms)
    if hs:
        # gemm_flops is tokens times a constant: one of the two is enough with a weight per size.
        # Attention keeps the k<K> bases: its FLOPs scale as 1/n (per-size weights did no better held out)
        eager = [(q, b) for q in ("weights", "prefix_attn", "prefix_kv", "kv", "tokens", "eager_tokens")
                 for b in [*hs, "full"]]
        eager += [("attn", b) for b in [*ks, "full"]]
        # the same FLOPs where the tile kernel runs them instead of SDPA (format version 12, fitted.py ``attn_tiles``)
        eager += [("attn_tiles", b) for b in [*ks, "full"]]
        eager += [("gemm_waves", "one"), ("samples", "one"), ("layers", "one"), ("launch", "one"),
                  ("attn_extra", "one")]
        # GEMM FLOPs in rounds of a grid sized for the whole GPU (fitted.py ``grid``): interior loso of the shipped
        # H200 profiles, prefill 3.55 -> 3.19 % (Llama-3.1-8B), 4.27 -> 3.72 % (Qwen3-8B); bench/fit_residuals.py
        eager.append(("gemm_flops", "grid"))
        # the same rounds for the GEMMs with few output tiles only (format version 8): with the ramps' curvature
        # penalised (RAMP_SMOOTHING) the step at 66 SMs is theirs, not a big launch's (bench/RESULTS.md, "Co-run
        # prefill and the eager ramps")
        eager.append(("small_gemm_flops", "grid"))
    else:
        eager = [(q, b) for q in ("gemm_flops", "weights", "attn", "prefix_attn", "prefix_kv", "kv", "tokens")
                 for b in ks]
        eager += [("eager_tokens", b) for b in ks]
        eager += [("gemm_flops", "full"), ("weights", "part"), ("tokens", "part"), ("gemm_waves", "one"),
                  ("samples", "one"), ("layers", "one"), ("launch", "one"), ("attn_extra", "one")]
    # the co-runner's tensor cores: its measured GEMM share where there is a table, else whether it has GEMMs at all.
    # With a table (format version 8) the share counts the co-runner's SMs up to half the GPU (``co_gemm_half``) and no
    # term grows linearly in its SMs (``co_sm_share``, ``co_gemm_co_sm`` left out): the slowdown is flat past ~56 of
    # the H200's SMs (bench/RESULTS.md, "Co-run prefill and the eager ramps")
    drop = {"co_gemm_co_sm", "co_sm_share", "co_tc_co_sm"} if gemm else {"co_gemm_co_sm", "co_gemm_half"}
    co_eager = [(q, "one") for q in CO_EAGER_Q if q not in drop]
    return {"decode_step": dec, "decode_first": list(dec), "eager": eager,
            "host": [(q, "one") for q in HOST_Q if q != "seq_layers"],
            "co_eager": co_eager, "co_decode": [(q, "one") for q in CO_DECODE_Q]}


# ---------------------------------------------------------------------------------------------- loading

@dataclass(frozen=True)
class Profile:
    folder: Path
    meta: dict
    spec: ModelSpec
    gpu: str  # short name: h200
    num_sms: int
    rows: list[dict]  # typed, each with "line"
    sha256: str
    gemm: dict | None = None  # gemm.csv summed per layer (the model's ``gemm_table``), where the folder has one


def gpu_short_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; the folder name of a profile."""
    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name.upper())
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def load_profile(folder: str | Path) -> Profile:
    """Read and validate a profile folder; any defect raises ConfigError naming the file, line and field."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a profile folder (no such directory)")
    meta_path, points_path = folder / "metadata.json", folder / "points.csv"
    meta = _read_meta(meta_path)
    ms = meta["model_spec"]
    try:
        spec = ModelSpec(name=str(meta["model"]), **{k: ms[k] for k in SHAPE_KEYS if k in ms})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{meta_path}: field 'model_spec': {e}") from None
    num_sms = meta["num_sms"]
    rows, digest = _read_points(points_path, num_sms)
    if not rows:
        raise ConfigError(f"{points_path}: no points")
    gemm = read_gemm(folder / "gemm.csv", num_sms) if (folder / "gemm.csv").exists() else None
    return Profile(folder, meta, spec, gpu_short_name(str(meta["gpu"])), num_sms, rows, digest, gemm)


GEMM_COLUMNS = ("sms", "rows", "product", "cublas_s", "skinny_s", "taken")


def read_gemm(path: Path, num_sms: int) -> dict:
    """A profile's ``gemm.csv``: the measured seconds of each decode GEMM product (:data:`GEMM_PRODUCTS`) by SM
    count and row count, with cuBLAS and with the skinny kernel, and which one the executor takes (``taken``:
    ``cublas`` or ``skinny``, as the profile's skinny table chose). Returns the model's ``gemm_table``: the
    taken kernels' seconds summed over one layer's products (:class:`~bullet.perfmodel.fitted.GemmTable`).
    Every (SM count, rows) must have every product; errors name the file, line and field."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None or tuple(header) != GEMM_COLUMNS:
        raise ConfigError(f"{path}: line 1: expected the columns {','.join(GEMM_COLUMNS)}, got {header!r}")
    times: dict[tuple[int, int, str], float] = {}
    for line, f in enumerate(reader, 2):
        if not f:
            continue
        if len(f) != len(GEMM_COLUMNS):
            raise ConfigError(f"{path}: line {line}: {len(f)} of {len(GEMM_COLUMNS)} fields")
        rec = dict(zip(GEMM_COLUMNS, f))
        try:
            sms, rows = int(rec["sms"]), int(rec["rows"])
        except ValueError:
            raise ConfigError(f"{path}: line {line}, field 'sms' or 'rows': not an integer") from None
        if not 1 <= sms <= num_sms:
            raise ConfigError(f"{path}: line {line}, field 'sms': {sms} is not in 1..{num_sms}")
        if rows < 2:
            raise ConfigError(f"{path}: line {line}, field 'rows': {rows} < 2 (one row takes the GEMV path)")
        if rec["product"] not in GEMM_PRODUCTS:
            raise ConfigError(f"{path}: line {line}, field 'product': {rec['product']!r} is not one of "
                              f"{', '.join(GEMM_PRODUCTS)}")
        if rec["taken"] not in ("cublas", "skinny"):
            raise ConfigError(f"{path}: line {line}, field 'taken': {rec['taken']!r} is not 'cublas' or 'skinny'")
        col = f"{rec['taken']}_s"
        try:
            t = float(rec[col])
        except ValueError:
            raise ConfigError(f"{path}: line {line}, field {col!r}: not a number: {rec[col]!r}") from None
        if not 0.0 < t < math.inf:
            raise ConfigError(f"{path}: line {line}, field {col!r}: must be a positive time, got {rec[col]!r}")
        key = (sms, rows, rec["product"])
        if key in times:
            raise ConfigError(f"{path}: line {line}: {rec['product']} at {rows} rows on {sms} SMs appears twice")
        times[key] = t
    sms_all = sorted({k[0] for k in times})
    rows_all = sorted({k[1] for k in times})
    if len(rows_all) < 2:
        raise ConfigError(f"{path}: needs two row counts at least")
    for s in sms_all:
        for r in rows_all:
            for p in GEMM_PRODUCTS:
                if (s, r, p) not in times:
                    raise ConfigError(f"{path}: no {p} at {r} rows on {s} SMs (every SM count needs every "
                                      f"row count and product)")
    layer_s = [[sum(times[(s, r, p)] for p in GEMM_PRODUCTS) for s in sms_all] for r in rows_all]
    return {"sms": sms_all, "rows": rows_all, "layer_s": layer_s, "source": "gemm.csv"}


def _read_meta(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}: not valid JSON: {e.msg}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path}: line 1: expected a JSON object")
    lines = text.splitlines()

    def line_of(key: str) -> str:
        for i, ln in enumerate(lines, 1):
            if f'"{key}"' in ln:
                return f"line {i}: "
        return ""

    for key in META_KEYS:
        if key not in meta:
            raise ConfigError(f"{path}: field {key!r} is missing")
    if not isinstance(meta["num_sms"], int) or isinstance(meta["num_sms"], bool) or meta["num_sms"] < 1:
        raise ConfigError(f"{path}: {line_of('num_sms')}field 'num_sms' must be a positive integer, "
                          f"got {meta['num_sms']!r}")
    if not isinstance(meta["gpu"], str) or not meta["gpu"] or meta["gpu"] == "cpu":
        raise ConfigError(f"{path}: {line_of('gpu')}field 'gpu' must name the GPU measured, got {meta['gpu']!r}")
    ms = meta["model_spec"]
    if not isinstance(ms, dict):
        raise ConfigError(f"{path}: {line_of('model_spec')}field 'model_spec' must be an object")
    for key in SHAPE_KEYS[:9]:  # the shapes every profile records
        v = ms.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{path}: {line_of(key)}field 'model_spec.{key}' must be a positive integer, "
                              f"got {v!r}")
    return meta


def _read_points(path: Path, num_sms: int) -> tuple[list[dict], str]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    text = raw.decode("utf-8", errors="replace")
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None:
        raise ConfigError(f"{path}: line 1: empty file (expected a header)")
    missing = [c for c in COLUMNS if c not in header]
    extra = [c for c in header if c not in COLUMNS]
    if missing or extra:
        what = "; ".join(x for x in (f"missing column(s) {', '.join(missing)}" if missing else "",
                                     f"unknown column(s) {', '.join(extra)}" if extra else "") if x)
        raise ConfigError(f"{path}: line 1: {what}")
    rows = []
    for line, fields_ in enumerate(reader, 2):
        if not fields_:
            continue
        if len(fields_) != len(header):
            field = header[len(fields_)] if len(fields_) < len(header) else "(extra values)"
            raise ConfigError(f"{path}: line {line}: truncated or malformed row: {len(fields_)} of "
                              f"{len(header)} fields (field {field!r} onwards)")
        raw_row = dict(zip(header, fields_))
        row: dict = {"line": line, "id": raw_row["id"]}
        for col, choices in CHOICES.items():
            if raw_row[col] not in choices:
                raise ConfigError(f"{path}: line {line}, field {col!r}: {raw_row[col]!r} is not one of "
                                  f"{', '.join(repr(c) for c in choices)}")
            row[col] = raw_row[col]
        for col in INT_COLS:
            try:
                v = float(raw_row[col])
            except ValueError:
                raise ConfigError(f"{path}: line {line}, field {col!r}: not a number: {raw_row[col]!r}") from None
            if not v.is_integer() or v < 0:
                raise ConfigError(f"{path}: line {line}, field {col!r}: expected a count, got {raw_row[col]!r}")
            row[col] = int(v)
        for col in FLOAT_COLS:
            try:
                v = float(raw_row[col])
            except ValueError:
                raise ConfigError(f"{path}: line {line}, field {col!r}: not a number: {raw_row[col]!r}") from None
            if not math.isfinite(v) and not (col == "step_s" and row["kind"] != "decode"):
                raise ConfigError(f"{path}: line {line}, field {col!r}: not a finite number: {raw_row[col]!r}")
            row[col] = v
        for col in ("gpu_s", "first_s", "host_s"):
            if not row[col] > 0:
                raise ConfigError(f"{path}: line {line}, field {col!r}: must be > 0, got {raw_row[col]!r}")
        if not 1 <= row["sms"] <= num_sms:
            raise ConfigError(f"{path}: line {line}, field 'sms': {row['sms']} is not in 1..{num_sms}")
        if row["tokens"] < 1 or row["seqs"] < 1 or row["layers"] < 1 or row["steps"] < 1 or row["reps"] < 1:
            raise ConfigError(f"{path}: line {line}: tokens, seqs, layers, steps and reps must be >= 1")
        if row["co_kind"] and not 1 <= row["co_sms"] <= num_sms:
            raise ConfigError(f"{path}: line {line}, field 'co_sms': {row['co_sms']} is not in 1..{num_sms}")
        rows.append(row)
    return rows, hashlib.sha256(raw).hexdigest()


# ---------------------------------------------------------------------------------------------- samples

def work_of_row(r: dict) -> Work:
    return Work(r["layers"], r["tokens"], r["seqs"], r["attn_pairs"], r["kv_read"], r["samples"],
                bool(r["embed"]), r["max_ctx"])


def co_work_of_row(r: dict) -> Work:
    seqs = max(1, r["co_seqs"])
    decode = r["co_kind"] == "decode"
    max_kv = r["co_kv_read"] // seqs if decode else r["co_kv_read"]
    return Work(r["co_layers"], r["co_tokens"], seqs, r["co_attn_pairs"], r["co_kv_read"], seqs if decode else 1,
                True, max_kv)


def decode_mid(w: Work, steps: float) -> Work:
    """The decode Work at the mean KV of steps 1..steps-1 of a fused launch (what step_s averages)."""
    i = steps / 2.0
    return w._replace(kv_read=w.kv_read + w.seqs * i, attn_pairs=w.attn_pairs + w.seqs * i,
                      max_kv=w.max_kv + i)


def is_solo(r: dict) -> bool:
    return not r["co_kind"]


def is_decode(r: dict) -> bool:
    return r["kind"] == "decode"


def gpu_bound(r: dict) -> bool:
    return r["gpu_s"] > GPU_BOUND * r["host_s"]


# ---------------------------------------------------------------------------------------------- fitting

def _design(q: Quantities, terms, items: list[tuple[dict, int]]) -> np.ndarray:
    """Rows: each (quantities, n) as the terms' values quantity x basis(n)."""
    tables = {b: basis_table(b, q.N) for _, b in terms}
    return np.array([[qv[name] * tables[b][n] for name, b in terms] for qv, n in items], dtype=np.float64)


def _nnls(X: np.ndarray, y: np.ndarray, relative: bool = True, weights: np.ndarray | None = None,
          penalty: np.ndarray | None = None) -> np.ndarray:
    """Non-negative least squares of ``y`` on ``X``, weighted by ``weights`` where given, else by 1 / y^2
    (``relative``: relative error) or not at all; ``penalty``: rows ``P`` whose ``P @ coef`` is pulled to 0 beside
    the weighted residuals (:func:`ramp_penalty`)."""
    from sklearn.linear_model import LinearRegression

    if len(y) == 0:
        return np.zeros(X.shape[1])
    w = weights if weights is not None else 1.0 / y**2 if relative else None
    reg = LinearRegression(positive=True, fit_intercept=False)
    if penalty is not None and len(penalty):
        sw = np.sqrt(w) if w is not None else np.ones(len(y))
        reg.fit(np.vstack([X * sw[:, None], penalty]), np.concatenate([y * sw, np.zeros(len(penalty))]))
    else:
        reg.fit(X, y, sample_weight=w)
    return np.maximum(reg.coef_, 0.0)


_RAMP_TERM = re.compile(r"r(\d+)_(\d+)_(\d+)")


def ramp_penalty(terms, X: np.ndarray, y: np.ndarray, strength: float = RAMP_SMOOTHING) -> np.ndarray:
    """Rows of the ramps' curvature penalty (:data:`RAMP_SMOOTHING`; the eager family's). A quantity's ramps at the measured sizes
    ``s_1 < ... < s_K`` give it the weight ``W_i = c_i + ... + c_K`` at ``s_i``; each row is, for one interior size,
    ``strength x mean_j(sum of the quantity's ramp columns / y_j) x (W_i - the value at s_i of the line in 1/n through
    W_{i-1} and W_{i+1})``: 0 where the weights are linear in 1/n, and in units of a point's relative error."""
    by_q: dict[str, list[tuple[int, int]]] = {}
    for j, (q, b) in enumerate(terms):
        if (m := _RAMP_TERM.fullmatch(b)) is not None:
            by_q.setdefault(q, []).append((int(m.group(2)), j))
    rows = []
    for cols in by_q.values():
        if len(cols) < 3:
            continue
        cols.sort()
        idx = [j for _, j in cols]
        scale = strength * float(np.mean(np.abs(X[:, idx]).sum(axis=1) / np.abs(y)))
        x = np.array([1.0 / s for s, _ in cols])
        up = np.triu(np.ones((len(cols), len(cols))))  # W = up @ c
        for i in range(1, len(cols) - 1):
            h1, h2 = x[i - 1] - x[i], x[i] - x[i + 1]
            d = np.zeros(len(cols))
            d[i - 1], d[i], d[i + 1] = -h2 / (h1 + h2), 1.0, -h1 / (h1 + h2)
            row = np.zeros(X.shape[1])
            row[idx] = scale * (d @ up)
            rows.append(row)
    return np.array(rows).reshape(-1, X.shape[1])


def fit_model(prof: Profile, rows: list[dict], terms: dict | None = None, kernels: dict | None = None,
              split: bool = True) -> dict:
    """Fit every family on ``rows`` (of ``prof``); returns the model dict (no errors yet). ``split``: the co-run
    prefill's factor per prefill size (:func:`split_factors`; False: version 8's fit, for comparisons)."""
    if terms is None:  # the eager family's ramps sit on the partition sizes these rows measured
        terms = default_terms(prof.num_sms, eager_sms={r["sms"] for r in rows if is_solo(r) and not is_decode(r)},
                              gemm=prof.gemm is not None)
    kernels = {**DEFAULT_KERNELS, **(kernels or {})}
    q = Quantities(prof.spec, prof.num_sms, kernels, GemmTable.of(prof.gemm))
    coef: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}

    def fit(family: str, items: list[tuple[dict, int]], y: list[float]) -> None:
        X = _design(q, terms[family], items) if items else np.zeros((0, len(terms[family])))
        ya = np.asarray(y, dtype=np.float64)
        # (only the eager family has ramps: the curvature penalty is empty for the others)
        pen = ramp_penalty(terms[family], X, ya, RAMP_SMOOTHING) if len(ya) and RAMP_SMOOTHING else None
        coef[family] = _nnls(X, ya, penalty=pen)
        counts[family] = len(y)

    solo_dec = [r for r in rows if is_solo(r) and is_decode(r)]
    fit("decode_step", [(q.decode(w, r["sms"]), r["sms"]) for r in solo_dec
                        for w in [decode_mid(work_of_row(r), r["steps"])]], [r["step_s"] for r in solo_dec])
    fit("decode_first", [(q.decode(work_of_row(r), r["sms"]), r["sms"]) for r in solo_dec],
        [r["first_s"] for r in solo_dec])
    solo_eager = [r for r in rows if is_solo(r) and not is_decode(r) and gpu_bound(r)]
    graphs = GraphLimits.of(prof.meta.get("prefill_graphs"))  # graphed launches: bucket rows, no host term
    pad = (lambda w: w) if graphs is None else graphs.padded
    served = (lambda w: False) if graphs is None else graphs.serves
    fit("eager", [(q.eager(pad(work_of_row(r)), r["sms"], served(work_of_row(r))), r["sms"])
                  for r in solo_eager],
        [r["gpu_s"] for r in solo_eager])
    eager_all = [r for r in rows if not is_decode(r) and not (graphs and graphs.serves(work_of_row(r)))]
    fit("host", [(q.host(work_of_row(r)), 0) for r in eager_all], [r["host_s"] for r in eager_all])
    # contention: measured over the stand-alone prediction of the model fitted so far
    model = _assemble(prof, terms, kernels, coef, counts)
    fm = FittedModel(model, host=False)
    _fit_contention(fm, q, terms, rows, coef, counts)
    model = _assemble(prof, terms, kernels, coef, counts)
    # what the smooth slowdown leaves on each prefill size (split_factors), on top of it: the smooth terms stay
    # the best fit to all sizes (an unmeasured size has them alone), the factors only the sizes' departures
    if split and (factors := split_factors(FittedModel(model, host=False), rows)):
        model["co_split_factor"] = factors
    return model


def _fit_contention(fm: FittedModel, q: Quantities, terms: dict, rows: list[dict], coef: dict, counts: dict) -> None:
    """The co-run families' slowdowns, measured over ``fm``'s stand-alone predictions."""
    for family, kind in (("co_eager", "prefill"), ("co_decode", "decode")):
        items, y = [], []
        for r in rows:
            if not r["co_kind"] or (r["kind"] == "decode") != (kind == "decode"):
                continue
            n, co, co_sms = r["sms"], co_work_of_row(r), r["co_sms"]
            if kind == "decode":
                if r["overlap"] <= 0.0:
                    continue  # no decode step ran next to the prefill: not a co-run measurement
                w = decode_mid(work_of_row(r), 2.0 * (r["steps"] / 2.0 + 1.0))
                alone = float(fm.decode_steps(w, 2, n)[1])
                ratio = r["step_s"] / alone
            else:
                w = work_of_row(r)
                alone = fm.gpu_time(w, n)
                t, o = r["gpu_s"], min(1.0, max(r["overlap"], 0.0))
                if o <= 0.0 or alone <= (1.0 - o) * t:
                    continue  # no overlap, or not measurable from this point
                ratio = o * t / (alone - (1.0 - o) * t) if o < 1.0 else t / alone
            # the slowed prefill's own HBM demand and FLOP rate
            own, own_fl = (fm.own_bw(w, alone), fm.own_flops(w, alone)) if kind == "prefill" else (0.0, 0.0)
            items.append((fm.co_features(n, co, co_sms, False, own, own_fl), 0))
            y.append(ratio - 1.0)
        X = _design(q, terms[family], items) if items else np.zeros((0, len(terms[family])))
        # co_eager weighted to the relative error of the co-run time, 1 + s; co_decode unweighted (weighted too,
        # its held-out error was 2.6 / 3.0 -> 2.7 / 3.0 %: bench/RESULTS.md, "Co-run prefill fit")
        wts = 1.0 / (1.0 + np.asarray(y)) ** 2 if family == "co_eager" else None
        coef[family] = _nnls(X, np.asarray(y), relative=False, weights=wts) if y else np.zeros(len(terms[family]))
        counts[family] = len(y)


def split_factors(fm: FittedModel, rows: list[dict]) -> dict[str, float]:
    """Per prefill partition size, the factor on a co-run prefill's time that its points ask for over the smooth
    slowdown terms of ``fm``: the mean of their log(measured / predicted), shrunk towards 0 by empirical Bayes
    (the share ``n tau^2 / (n tau^2 + sigma^2)``, with ``sigma^2`` the scatter within a size and ``tau^2`` the spread
    between sizes beyond what that scatter explains), so a size of few points moves little and sizes that differ no
    more than their points scatter not at all. Sizes with no co-run prefill point get none (1 in the model).
    The co-run slowdown is no smooth function of the split on the H200 (44 / 88 SMs 10-15 points under 36 / 96 and
    68 / 64 at every shape: bench/RESULTS.md, twenty-eighth session), and with nested partitions a prefill size has
    the same SMs whatever the decode lane takes, so the size is the key."""
    by: dict[int, list[float]] = {}
    for r in rows:
        if r["co_kind"] and r["kind"] != "decode" and r["overlap"] > 0.0:
            pred, meas = predictions(fm, r)["co-run prefill"]
            by.setdefault(r["sms"], []).append(float(np.log(meas / pred)))
    return {str(k): float(np.exp(v)) for k, v in sorted(shrunk_means(by).items())} if len(by) >= 2 else {}


def shrunk_means(groups: dict[int, list[float]]) -> dict[int, float]:
    """Each group's mean shrunk towards 0 by empirical Bayes: times ``n tau^2 / (n tau^2 + sigma^2)``, ``sigma^2``
    the pooled variance within groups, ``tau^2 = mean(m^2 - sigma^2 / n)`` (at least 0) the variance of the groups'
    true means about 0 (method of moments: a group mean's square is that plus its sampling variance)."""
    n = np.array([len(v) for v in groups.values()], dtype=np.float64)
    m = np.array([np.mean(v) for v in groups.values()])
    within = sum(float(((np.asarray(v) - np.mean(v)) ** 2).sum()) for v in groups.values())
    dof = n.sum() - len(n)
    sigma2 = within / dof if dof > 0 else 0.0
    tau2 = max(0.0, float(np.mean(m ** 2 - sigma2 / n)))
    share = n * tau2 / (n * tau2 + sigma2) if sigma2 > 0.0 else np.ones_like(n)
    return {k: float(s * mk) for k, s, mk in zip(groups, share, m)}


def _assemble(prof: Profile, terms: dict, kernels: dict, coef: dict, counts: dict) -> dict:
    fams = {}
    for name in FAMILIES:
        c = coef.get(name, np.zeros(len(terms[name])))
        fams[name] = {"terms": [list(t) for t in terms[name]], "coef": [float(x) for x in c],
                      "points": int(counts.get(name, 0))}
    return {"format": FORMAT, "version": FORMAT_VERSION, "model_spec": spec_dict(prof.spec),
            "gpu": {"name": prof.gpu, "num_sms": prof.num_sms, "device": prof.meta.get("gpu")},
            "kernels": kernels, "families": fams, "prefill_graphs": prof.meta.get("prefill_graphs"),
            "gemm_table": prof.gemm}


# ---------------------------------------------------------------------------------------------- evaluation

def predictions(fm: FittedModel, r: dict) -> dict[str, tuple[float, float]]:
    """(predicted, measured) of one profile point for each family it belongs to, and for its whole launch."""
    n, w = r["sms"], work_of_row(r)
    out: dict[str, tuple[float, float]] = {}
    if is_solo(r):
        if is_decode(r):
            steps = fm.decode_steps(w, r["steps"], n)
            out["decode first"] = (float(steps[0]), r["first_s"])
            if r["steps"] > 1:
                out["decode step"] = (float(steps[1:].mean()), r["step_s"])
            out["launch"] = (float(steps.sum()), r["gpu_s"])
        else:
            gpu = fm.gpu_time(w, n)
            host = fm.host_time(w)
            if gpu_bound(r):
                out[r["kind"]] = (gpu, r["gpu_s"])
            if not fm.graphed(w):
                out["host"] = (host, r["host_s"])
            out["launch"] = (max(gpu, host), r["gpu_s"])
        return out
    co, co_sms = co_work_of_row(r), r["co_sms"]
    if is_decode(r):
        wm = decode_mid(w, 2.0 * (r["steps"] / 2.0 + 1.0))
        t = float(fm.decode_steps(wm, 2, n, co, co_sms)[1])
        out["co-run decode"] = (t, r["step_s"])
        out["launch"] = (t, r["step_s"])
    else:
        alone = fm.gpu_time(w, n)
        t_co = fm.eager_next_to(w, alone, n, co, co_sms)
        t = partly_co_run(alone, t_co, min(1.0, max(r["overlap"], 0.0)))  # co-run for the overlap, alone after
        host = fm.host_time(w)
        out["co-run prefill"] = (t, r["gpu_s"])
        if not fm.graphed(w):
            out["host"] = (host, r["host_s"])
        out["launch"] = (max(t, host), r["gpu_s"])
    return out


FAMILY_ORDER = ("decode step", "decode first", "prefill", "mixed", "host", "co-run prefill", "co-run decode",
                "launch")


def _stats(errs: list[float]) -> dict:
    if not errs:
        return {"n": 0, "mean": None, "p95": None}
    a = np.asarray(errs)
    return {"n": len(errs), "mean": float(a.mean()), "p95": float(np.percentile(a, 95))}


SPLITS = ("random", "loso", "interior")
GATE_SPLITS = ("random", "interior")  # the splits the thresholds apply to (loso is shown, not gated)


def end_sizes(rows: list[dict]) -> dict[str, set[int]]:
    """Per lane (prefill, decode), the smallest and largest SM count measured on it: the menu's end sizes."""
    by_lane: dict[str, set[int]] = {}
    for r in rows:
        if r["lane"] != "all":
            by_lane.setdefault(r["lane"], set()).add(r["sms"])
    return {lane: {min(s), max(s)} for lane, s in by_lane.items()}


def folds(prof: Profile, seed: int = 0) -> list[tuple[str, str, list[bool]]]:
    """(name, split, held out) of each fold: a seeded random 20 %; each SM count below the whole GPU held out
    in turn (loso; the whole GPU is an ordinary stream, not a green-context partition, and every profile
    measures it: it stays in training); and interior loso, the same but never holding out a lane's end sizes
    (:func:`end_sizes`): held out, the smallest size tests extrapolation below anything measured, which
    service never meets where every menu size is profiled."""
    rows = prof.rows
    rng = np.random.default_rng(seed)
    test_idx = set(rng.permutation(len(rows))[: max(1, round(0.2 * len(rows)))].tolist())
    out = [("random 20 %", "random", [i in test_idx for i in range(len(rows))])]
    ends = end_sizes(rows)
    for s in sorted({r["sms"] for r in rows} - {prof.num_sms}):  # the whole GPU is no partition size
        out.append((f"{s} SMs", "loso", [r["sms"] == s for r in rows]))
        inner = [r["sms"] == s and s not in ends.get(r["lane"], ()) for r in rows]
        if any(inner):
            out.append((f"{s} SMs (interior)", "interior", inner))
    return out


def evaluate(prof: Profile, seed: int = 0, terms: dict | None = None,
             on_fold: Callable[[str], None] | None = None) -> dict:
    """Held-out absolute relative errors per family and split (:func:`folds`); a fold that holds out the same
    points as another is fitted once."""
    rows = prof.rows
    errs: dict[str, dict[str, list[float]]] = {split: {} for split in SPLITS}
    fitted: dict[tuple[bool, ...], FittedModel] = {}
    for name, split, held in folds(prof, seed):
        key = tuple(held)
        if key not in fitted:
            if on_fold is not None:
                on_fold(name)
            fitted[key] = FittedModel(fit_model(prof, [r for r, h in zip(rows, held) if not h], terms), host=True)
        for r, h in zip(rows, held):
            if h:
                for fam, (p, m) in predictions(fitted[key], r).items():
                    errs[split].setdefault(fam, []).append(abs(p / m - 1.0))
    return {fam: {split: _stats(errs[split].get(fam, [])) for split in SPLITS}
            for fam in FAMILY_ORDER if any(fam in errs[s] for s in errs)}


def failures(table: dict) -> list[str]:
    """What is over the thresholds on the gated splits (:data:`GATE_SPLITS`; empty: the model may be
    written)."""
    out = []
    for fam, splits in table.items():
        for split in GATE_SPLITS:
            s = splits.get(split, {"n": 0})
            if s["n"] == 0:
                continue
            if fam == "launch":
                if s["mean"] > THRESHOLDS["launch_mean"]:
                    out.append(f"whole launches ({split}): mean {100 * s['mean']:.1f} % > 5 %")
                if s["p95"] > THRESHOLDS["launch_p95"]:
                    out.append(f"whole launches ({split}): p95 {100 * s['p95']:.1f} % > 10 %")
            elif fam in GATED and s["mean"] > THRESHOLDS["family_mean"]:
                out.append(f"{fam} ({split}): mean {100 * s['mean']:.1f} % > 3 %")
    return out


def in_sample(prof: Profile, model: dict) -> dict:
    fm = FittedModel(model, host=True)
    errs: dict[str, list[float]] = {}
    for r in prof.rows:
        for fam, (p, m) in predictions(fm, r).items():
            errs.setdefault(fam, []).append(abs(p / m - 1.0))
    return {fam: _stats(errs[fam]) for fam in FAMILY_ORDER if fam in errs}


def fit_host_gap(rows: list[dict]) -> dict | None:
    """The engine's host time between launches (``gaps.csv``), ``a + b * requests`` by non-negative least
    squares on relative error, with each batch size's error when it is left out of the fit; None with fewer
    than two sizes."""
    if len(rows) < 2:
        return None
    n = np.array([r["seqs"] for r in rows], float)
    g = np.array([r["gap_s"] for r in rows], float)
    X = np.column_stack([np.ones_like(n), n])
    a, b = _nnls(X, g)
    loo = []
    for i in range(len(rows)):
        keep = np.arange(len(rows)) != i
        ai, bi = _nnls(X[keep], g[keep])
        loo.append(round(100 * ((ai + bi * n[i]) / g[i] - 1), 2))
    return {"fixed_s": float(a), "per_request_s": float(b), "seqs": [int(x) for x in n],
            "gap_s": [float(x) for x in g], "loo_error_pct": loo, "source": "gaps.csv"}


def pass_spread(path: Path, rows: list[dict] | None = None, col: str | None = None, solo: bool = False) -> dict | None:
    """How far a profile's co-run points moved between passes (``corun_passes.csv`` from ``bullet profile
    --corun-passes``; None without one): of each point with two passes or more, (max - min) / median of its
    time (a prefill's GPU time, a decode step), their mean, and the pooled relative sd of one pass. With the
    profile's ``rows``, also how many co-run rows are not the median of their passes (``not_median``) and how many
    points with passes have no row (``no_row``): a passes run stopped before it wrote them (the shipped H200
    Llama-3.1-8B profile of 2026-12-02 kept its first pass in all 74 rows, 69 of them not the median, and lacked
    18 points). Also for ``decode_passes.csv`` (``bullet profile --decode-passes``; ``solo``: its rows are checked
    against the solo rows); ``col``: the time read (default a decode step's ``step_s``, a prefill's ``gpu_s``)."""
    if not path.exists():
        return None
    with path.open(newline="") as f:
        passes = list(csv.DictReader(f))
    by: dict[str, list[float]] = {}
    for line, r in enumerate(passes, 2):
        if r.get("reps") in (None, ""):  # a torn last line
            continue
        c = col or ("step_s" if r.get("kind") == "decode" else "gpu_s")
        try:
            v = float(r.get(c) or "")
        except ValueError:
            raise ConfigError(f"{path}: line {line}, field {c!r}: not a number: {r.get(c)!r}") from None
        if math.isfinite(v) and v > 0:
            by.setdefault(str(r.get("id")), []).append(v)
    multi = [np.asarray(v) for v in by.values() if len(v) >= 2]
    if not multi:
        return None
    spread = [(v.max() - v.min()) / np.median(v) for v in multi]
    var = [np.var(v, ddof=1) / v.mean() ** 2 for v in multi]
    out = {"points": len(multi), "passes": max(len(v) for v in multi), "spread_mean": float(np.mean(spread)),
           "pass_sd": float(np.sqrt(np.mean(var))), "source": path.name}
    if rows is not None:
        have = {r["id"]: r[col or ("step_s" if is_decode(r) else "gpu_s")] for r in rows if bool(r["co_kind"]) != solo}
        out["not_median"] = sum(pid in have and not math.isclose(have[pid], float(np.median(v)), rel_tol=1e-6)
                                for pid, v in by.items())
        out["no_row"] = sum(pid not in have for pid in by)
    return out


def fit_profile(folder: str | Path, seed: int = 0, on_fold: Callable[[str], None] | None = None) -> dict:
    """Load, evaluate held out, fit on every point; returns the model dict with its errors."""
    prof = load_profile(folder)
    from ..gpu.profile import read_gaps  # (no torch at import)

    try:
        gaps = read_gaps(prof.folder / "gaps.csv")  # read first: a bad file fails before the long evaluation
    except ValueError as e:
        raise ConfigError(str(e)) from None
    table = evaluate(prof, seed, on_fold=on_fold)
    if on_fold is not None:
        on_fold("all points")
    model = fit_model(prof, prof.rows)
    model["fitted"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    model["profile"] = {"folder": str(folder), "points": len(prof.rows), "points_sha256": prof.sha256,
                        "metadata": prof.meta}
    model["errors"] = {"seed": seed, "held_out": table, "in_sample": in_sample(prof, model),
                       "thresholds": THRESHOLDS, "gated": list(GATED), "gated_splits": list(GATE_SPLITS),
                       "failures": failures(table)}
    gap = fit_host_gap(gaps)
    if gap is not None:
        model["host_gap"] = gap
    for key, file, col, solo in (("corun_passes", "corun_passes.csv", None, False),
                                 ("decode_passes", "decode_passes.csv", None, True),
                                 ("decode_first_passes", "decode_passes.csv", "first_s", True)):
        if (spread := pass_spread(prof.folder / file, prof.rows, col, solo)) is not None:
            model["profile"][key] = spread
    return model


def write_model(model: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(model, indent=1) + "\n")
    os.replace(tmp, path)
