"""The flags several commands share, each defined once: the policy, model, KV cache and SLO flags of
``bullet simulate`` and ``bullet run``, and the workload and SLO flags of ``bullet simulate`` and ``bullet bench``.

Each flag is an ``Annotated`` type (name, help, panel, bounds) and a ``DEFAULT_*`` constant; a command declares
``policy: PolicyOpt = DEFAULT_POLICY``. Typer cannot carry a default inside ``Annotated``, hence the pairs. The
checks that go with the flags (``slo_config``, ``check_policy_flags``, ...) are here too, so every command that
takes a flag reads it the same way."""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from .cli_trace import ArrivalChoice as Arrival
from .cli_trace import fail
from .config import POLICIES, SLO_PRESETS, ModelSpec, SloConfig
from .request import Request

if TYPE_CHECKING:
    from .traces import TraceTable

WORKLOAD, POLICY, HARDWARE, SLOS, CACHE, OUTPUT = ("Workload", "Policy", "Model and GPU", "SLOs and metrics",
                                                   "KV cache", "Output")

Policy = Enum("Policy", {p.replace("-", "_"): p for p in POLICIES}, type=str)
SloName = Enum("SloName", {k.replace("-", "_"): k for k in ("none", *SLO_PRESETS)}, type=str)
NO_SLO = SloConfig(ttft=None, tpot=None)

# ---- workload (simulate, bench) -------------------------------------------------------------------------
TraceOpt = Annotated[str, typer.Option(
    help="Trace file (Azure/Vidur CSV, Mooncake JSONL, length-only CSV) or a bundled trace: sharegpt, "
         "azure-conv, azure-code, arxiv.", rich_help_panel=WORKLOAD)]
DEFAULT_TRACE = "sharegpt"
FormatOpt = Annotated[str | None, typer.Option(
    "--format", help="Trace format, if not detected from the header: azure, vidur, mooncake, lengths.",
    rich_help_panel=WORKLOAD)]
NumPromptsOpt = Annotated[int | None, typer.Option(
    "--num-prompts", "--num-requests", min=1, help="Use the first N requests (by arrival).",
    rich_help_panel=WORKLOAD)]
RequestRateOpt = Annotated[float | None, typer.Option(
    "--request-rate", "--rate", help="Requests/s: rescales a timed trace's arrivals (burst shape kept) or "
    "generates arrivals for a length-only one; inf: all at once. [default: the trace's timing]",
    show_default=False, rich_help_panel=WORKLOAD)]
ArrivalOpt = Annotated[Arrival, typer.Option(
    help="Arrival process, where arrivals are generated (length-only traces).", rich_help_panel=WORKLOAD)]
DEFAULT_ARRIVAL = Arrival.poisson
CvOpt = Annotated[float, typer.Option(help="--arrival gamma: coefficient of variation of the gaps.",
                                      rich_help_panel=WORKLOAD)]
DEFAULT_CV = 1.0
BurstinessOpt = Annotated[float | None, typer.Option(
    help="vLLM's name for gamma arrivals: shape B, CV 1/sqrt(B) (1: Poisson, < 1: burstier).",
    show_default=False, rich_help_panel=WORKLOAD)]
SeedOpt = Annotated[int, typer.Option(help="Seed of every random choice (generated arrivals, prompt tokens).",
                                      rich_help_panel=WORKLOAD)]
DEFAULT_SEED = 0
MaxConcurrencyOpt = Annotated[int | None, typer.Option(
    min=1, help="As vllm bench serve: at most N requests in the server; later ones wait at the client and "
    "are timed from when they are sent.", rich_help_panel=WORKLOAD)]
HashBlockSizeOpt = Annotated[int, typer.Option(
    help="Prompt tokens per id in the trace's hash_ids (Mooncake: 512).", rich_help_panel=WORKLOAD)]
DEFAULT_HASH_BLOCK_SIZE = 512

# ---- policy (simulate, run) -----------------------------------------------------------------------------
PolicyOpt = Annotated[Policy, typer.Option(help="Scheduling policy.", rich_help_panel=POLICY)]
DEFAULT_POLICY = Policy.chunked
MaxNumSeqsOpt = Annotated[int, typer.Option(help="Most requests running at once.", rich_help_panel=POLICY)]
DEFAULT_MAX_NUM_SEQS = 256
MaxBatchedTokensOpt = Annotated[int, typer.Option(
    "--max-num-batched-tokens", "--max-batched-tokens", help="Token budget of a step: the chunk size of "
    "chunked and prefill-first; the prefill batch cap of the split policies.", rich_help_panel=POLICY)]
DEFAULT_MAX_BATCHED_TOKENS = 8192
PrefillSmsOpt = Annotated[int, typer.Option(
    help="static-split: SMs of the prefill partition, from the GPU's menu (H200: 20, 28, ..., 124); "
    "decode gets the rest.", rich_help_panel=POLICY)]
DEFAULT_PREFILL_SMS = 92
LayersPerStepOpt = Annotated[int | None, typer.Option(
    min=1, help="static-split, naive-concurrent, bullet: prefill layers per launch. [default: all; "
    "bullet: 8]", show_default=False, rich_help_panel=POLICY)]
SloMarginOpt = Annotated[float, typer.Option(
    min=0.0, max=0.99, help="bullet: fit decode steps into each request's TPOT budget with this fraction to "
    "spare.", rich_help_panel=POLICY)]
DEFAULT_SLO_MARGIN = 0.1
AdmissionControlOpt = Annotated[bool, typer.Option(
    help="bullet: reject at once a request predicted to miss its TTFT.", rich_help_panel=POLICY)]
OverloadDeferralOpt = Annotated[bool, typer.Option(
    "--overload-deferral/--no-overload-deferral",
    help="bullet: when the last 10 s of arrivals ask for more work than the GPU does (up to 1.8x) and 3/4 of "
         "the seats are taken, defer the costliest arrivals (ordered as requests predicted late: their TTFT is "
         "given up, their wait stays bounded) until arrivals lull. Raises capacity under a sustained overload.",
    rich_help_panel=POLICY)]
AsyncSchedulingOpt = Annotated[bool, typer.Option(
    "--async-scheduling/--no-async-scheduling",
    help="Plan each launch while the one before it runs on the GPU (as vLLM's --async-scheduling and SGLang's "
         "overlap scheduler do): the engine's host time between launches is hidden; live, a request that "
         "arrives in a launch's last 2 ms (or tenth) joins one launch later. chunked and prefill-first only.",
    rich_help_panel=POLICY)]
DecodeSizesOpt = Annotated[str | None, typer.Option(
    help="bullet: comma-separated decode partition sizes it may use. [default: the whole menu]",
    show_default=False, rich_help_panel=POLICY)]

# ---- model and GPU (simulate, run) ----------------------------------------------------------------------
ModelOpt = Annotated[str, typer.Option(
    help="Model preset (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, qwen3-8b; tiny-llama for the CPU) or a "
    "Hugging Face config.json / model folder (bullet run also loads its tokenizer.json and *.safetensors).",
    rich_help_panel=HARDWARE)]
DEFAULT_MODEL = "llama-3.1-8b"
GpuOpt = Annotated[str, typer.Option(help="GPU preset: h200, h100, a100.", rich_help_panel=HARDWARE)]
DEFAULT_GPU = "h200"
LatencyOpt = Annotated[str, typer.Option(
    help="Latency model: auto (the fitted one shipped for this model and GPU, else roofline), roofline, "
    "fitted, or a model JSON from `bullet fit`.", rich_help_panel=HARDWARE)]
DEFAULT_LATENCY = "auto"

# ---- KV cache (simulate, run) ---------------------------------------------------------------------------
BlockSizeOpt = Annotated[int, typer.Option(help="KV cache block size in tokens.", rich_help_panel=CACHE)]
DEFAULT_BLOCK_SIZE = 16
NumBlocksOpt = Annotated[int | None, typer.Option(
    "--num-gpu-blocks-override", "--num-blocks", help="KV cache blocks. [default: what fits in GPU memory; "
    "bullet run --device cpu: 1024]", show_default=False, rich_help_panel=CACHE)]
GpuMemoryUtilizationOpt = Annotated[float, typer.Option(
    help="Fraction of GPU memory for weights, activations and KV cache.", rich_help_panel=CACHE)]
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
PrefixCachingOpt = Annotated[bool, typer.Option(
    help="Reuse the KV of full prompt blocks computed before (simulate: needs the trace's hash_ids).",
    rich_help_panel=CACHE)]
DEFAULT_PREFIX_CACHING = True

# ---- SLOs (simulate, run, bench) ------------------------------------------------------------------------
SloOpt = Annotated[SloName, typer.Option(
    help="SLO set: the Bullet paper's per workload (TTFT ms per prompt token / TPOT ms: sharegpt 3/150, "
    "azure-code 1.5/200, arxiv 1.5/175), tight (500 ms / 50 ms) or none.", rich_help_panel=SLOS)]
DEFAULT_SLO = SloName.paper_sharegpt
SloTtftOpt = Annotated[float | None, typer.Option(
    help="TTFT SLO in ms (replaces the set's).", show_default=False, rich_help_panel=SLOS)]
SloTtftPerTokenOpt = Annotated[float | None, typer.Option(
    help="TTFT SLO in ms per prompt token (replaces the set's).", show_default=False, rich_help_panel=SLOS)]
SloTpotOpt = Annotated[float | None, typer.Option(
    help="TPOT SLO in ms (replaces the set's).", show_default=False, rich_help_panel=SLOS)]
GoodputOpt = Annotated[list[str] | None, typer.Option(
    metavar="KEY:MS", help="As vllm bench serve: --goodput ttft:MS tpot:MS; exactly these SLOs (instead of --slo).",
    show_default=False, rich_help_panel=SLOS)]
MetricPercentilesOpt = Annotated[str, typer.Option(
    help="Percentiles reported besides the mean, comma-separated.", rich_help_panel=SLOS)]
DEFAULT_METRIC_PERCENTILES = "50,90,99"

# Flags that mean something to some policies only: flag -> (parameter, the policies it applies to).
POLICY_FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "--prefill-sms": ("prefill_sms", ("static-split",)),
    "--layers-per-step": ("layers_per_step", ("static-split", "naive-concurrent", "bullet")),
    "--slo-margin": ("slo_margin", ("bullet",)),
    "--admission-control": ("admission_control", ("bullet",)),
    "--overload-deferral": ("overload_deferral", ("bullet",)),
    "--decode-sizes": ("decode_sizes", ("bullet",)),
}


# Flags that shape generated arrivals: they apply only to a length-only trace at a finite rate.
ARRIVAL_FLAGS: dict[str, str] = {"--arrival": "arrival", "--cv": "cv", "--burstiness": "burstiness"}


def given_flags(ctx: typer.Context) -> set[str]:
    """The parameters set on the command line (not defaults, not the environment)."""
    return {name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"}


def _ms(value: float | None) -> float | None:
    return None if value is None else value / 1e3


def check_finite(values: dict[str, float | None], allow_inf: tuple[str, ...] = ()) -> None:
    """Every number given must be finite (``inf`` only for the flags in ``allow_inf``)."""
    for flag, value in values.items():
        if value is None or math.isfinite(value) or (flag in allow_inf and value == math.inf):
            continue
        raise fail(f"{flag} must be a finite number, got {value:g}")


def check_policy_flags(policy: str, given: set[str], layers_per_step: int | None, model: ModelSpec) -> None:
    for flag, (param, policies) in POLICY_FLAGS.items():
        if param in given and policy not in policies:
            raise fail(f"{flag} does not apply to --policy {policy} (it is for {', '.join(policies)}): drop it "
                       "or change --policy")
    if layers_per_step is not None and layers_per_step > model.num_layers:
        raise fail(f"--layers-per-step {layers_per_step} is more than the {model.num_layers} layers of "
                   f"{model.name}")


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``vllm bench serve --goodput`` items ``ttft:MS`` / ``tpot:MS`` -> {'ttft': ms, 'tpot': ms}."""
    out: dict[str, float] = {}
    for item in items:
        for part in item.replace(",", " ").split():
            key, sep, value = part.partition(":")
            key = key.lower()
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise fail(f"--goodput takes ttft:MS and tpot:MS, got {part!r}")
            if key == "e2el":
                raise fail("--goodput e2el: an end-to-end latency SLO is not supported (give ttft and tpot)")
            try:
                ms = float(value)
            except ValueError:
                ms = math.nan
            if not (math.isfinite(ms) and ms > 0):
                raise fail(f"--goodput {key}: expected a positive number of milliseconds, got {value!r}")
            if key in out:
                raise fail(f"--goodput names {key} twice")
            out[key] = ms
    return out


def slo_config(preset: str, given: set[str], ttft_ms: float | None, ttft_per_token_ms: float | None,
               tpot_ms: float | None, goodput: dict[str, float]) -> SloConfig:
    """The SLOs: ``--goodput`` alone (vLLM: exactly the targets it names), or the ``--slo`` set with any of
    ``--slo-ttft`` / ``--slo-ttft-per-token`` / ``--slo-tpot`` replacing its values."""
    check_finite({"--slo-ttft": ttft_ms, "--slo-tpot": tpot_ms, "--slo-ttft-per-token": ttft_per_token_ms})
    own = [f for f, p in (("--slo", "slo"), ("--slo-ttft", "slo_ttft"), ("--slo-tpot", "slo_tpot"),
                          ("--slo-ttft-per-token", "slo_ttft_per_token")) if p in given]
    if goodput:
        if own:
            raise fail(f"give --goodput or {', '.join(own)}, not both")
        return SloConfig(ttft=_ms(goodput.get("ttft")), tpot=_ms(goodput.get("tpot")))
    if ttft_ms is not None and ttft_per_token_ms is not None:
        raise fail("give --slo-ttft (absolute) or --slo-ttft-per-token, not both")
    for flag, value in (("--slo-ttft", ttft_ms), ("--slo-tpot", tpot_ms), ("--slo-ttft-per-token", ttft_per_token_ms)):
        if value is not None and value <= 0:
            raise fail(f"{flag} must be a positive number of milliseconds, got {value:g}")
    base = NO_SLO if preset == "none" else SLO_PRESETS[preset]
    ttft, per_token, tpot = base.ttft, base.ttft_per_token, base.tpot
    if ttft_ms is not None:
        ttft, per_token = _ms(ttft_ms), None
    if ttft_per_token_ms is not None:
        ttft, per_token = None, _ms(ttft_per_token_ms)
    if tpot_ms is not None:
        tpot = _ms(tpot_ms)
    return SloConfig(ttft=ttft, ttft_per_token=per_token, tpot=tpot)


def slo_name(preset: str, given: set[str]) -> str | None:
    """The SLO set's name, or None where flags replaced (some of) its values."""
    return None if given & {"slo_ttft", "slo_ttft_per_token", "slo_tpot", "goodput"} else preset


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``--metric-percentiles 50,90,99`` (vLLM's form: comma-separated, each in (0, 100])."""
    out: list[float] = []
    for part in text.split(","):
        try:
            p = float(part)
        except ValueError:
            p = math.nan
        if not (0 < p <= 100):
            raise fail(f"--metric-percentiles takes comma-separated numbers in (0, 100], got {part.strip()!r}")
        if p in out:
            raise fail(f"--metric-percentiles names {p:g} twice")
        out.append(p)
    return tuple(out)


def arrival_settings(request_rate: float | None, arrival: Arrival, cv: float, burstiness: float | None,
                     given: set[str]) -> tuple[Arrival, float]:
    """Check ``--request-rate`` and ``--burstiness`` and return the arrival process and CV they mean."""
    if request_rate is not None and request_rate <= 0:
        raise fail(f"--request-rate must be a positive number of requests per second, got {request_rate:g}")
    if burstiness is not None:
        if burstiness <= 0:
            raise fail(f"--burstiness must be positive, got {burstiness:g}")
        if ("arrival" in given and arrival != Arrival.gamma) or "cv" in given:
            raise fail("--burstiness sets gamma arrivals with CV 1/sqrt(B): give it or --arrival/--cv, not both")
        arrival, cv = Arrival.gamma, 1.0 / math.sqrt(burstiness)
    return arrival, cv


def load_requests(trace: str, fmt: str | None, num_requests: int | None, rate: float | None, arrival: str,
                  cv: float, seed: int, hash_block_size: int, given: set[str]) -> tuple[list[Request], TraceTable]:
    """The trace's requests and its table. ``rate`` inf: every request arrives at once (``vllm bench serve
    --request-rate inf``). Arrival flags where arrivals are not generated (a timed trace, or rate inf) are
    refused."""
    from .traces import load_trace, read_table

    table = read_table(trace, fmt, hash_block_size=hash_block_size)
    arrival_flags = [f for f, p in ARRIVAL_FLAGS.items() if p in given]
    if arrival_flags and rate == math.inf:
        raise fail(f"{', '.join(arrival_flags)} shape generated arrivals; --request-rate inf sends every request "
                   "at once")
    if arrival_flags and table.arrivals is not None:
        raise fail(f"{', '.join(arrival_flags)} shape generated arrivals, but {table.path} has arrival times "
                   "(--request-rate rescales them, keeping their burst shape)")
    if "cv" in given and arrival != "gamma":
        raise fail(f"--cv applies to --arrival gamma, not {arrival}")
    if table.arrivals is None and rate is None:
        raise fail(f"{table.path} has no arrival times (a length-only trace): give --request-rate to generate "
                   "them")
    load_rate = rate if rate != math.inf else (None if table.arrivals is not None else 1.0)
    requests = load_trace(trace, fmt, num_requests=num_requests, rate=load_rate, arrival_process=arrival, cv=cv,
                          seed=seed, hash_block_size=hash_block_size, table=table)
    if rate == math.inf:
        for r in requests:
            r.arrival = 0.0
    return requests, table
