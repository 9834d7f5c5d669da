"""``bullet``: the command line. Each command turns flags into configs and calls the library."""

from __future__ import annotations

import copy
import csv
import enum
import gc
import hashlib
import importlib
import io
import json
import math
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from typer.core import TyperCommand
from typer.main import get_command_name

from . import __version__
from .cli_options import (
    DEFAULT_ARRIVAL,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CV,
    DEFAULT_GPU,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_HASH_BLOCK_SIZE,
    DEFAULT_LATENCY,
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_MODEL,
    DEFAULT_POLICY,
    DEFAULT_PREFILL_SMS,
    DEFAULT_PREFIX_CACHING,
    DEFAULT_SEED,
    DEFAULT_SLO,
    DEFAULT_SLO_MARGIN,
    DEFAULT_TRACE,
    HARDWARE,
    OUTPUT,
    POLICY,
    POLICY_FLAGS,
    WORKLOAD,
    AdmissionControlOpt,
    ArrivalOpt,
    AsyncSchedulingOpt,
    BlockSizeOpt,
    BurstinessOpt,
    CvOpt,
    DecodeSizesOpt,
    FormatOpt,
    GoodputOpt,
    GpuMemoryUtilizationOpt,
    GpuOpt,
    HashBlockSizeOpt,
    LatencyOpt,
    LayersPerStepOpt,
    MaxBatchedTokensOpt,
    MaxConcurrencyOpt,
    MaxNumSeqsOpt,
    MetricPercentilesOpt,
    ModelOpt,
    NumBlocksOpt,
    NumPromptsOpt,
    OverloadDeferralOpt,
    PolicyOpt,
    PrefillSmsOpt,
    PrefixCachingOpt,
    RequestRateOpt,
    SeedOpt,
    SloMarginOpt,
    SloOpt,
    SloTpotOpt,
    SloTtftOpt,
    SloTtftPerTokenOpt,
    TraceOpt,
    arrival_settings,
    check_finite,
    check_policy_flags,
    given_flags,
    load_requests,
    parse_goodput,
    parse_percentiles,
    slo_config,
    slo_name,
)
from .cli_trace import ArrivalChoice as Arrival
from .cli_trace import SummaryGroup, fail, parse_host_gap, parse_sizes, trace_app
from .config import (
    CacheConfig,
    ConfigError,
    ModelSpec,
    SchedulerConfig,
    gpu_short_name,
    resolve_gpu,
    resolve_model,
)
from .request import Request

if TYPE_CHECKING:
    from .traces import TraceTable

# click's UsageError: from the click typer uses (newer typer versions vendor their own copy of click)
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_GOODPUT_ITEM = re.compile(r"(ttft|tpot|e2el):", re.IGNORECASE)


def expand_goodput(args: list[str]) -> list[str]:
    """vLLM's ``--goodput ttft:MS tpot:MS`` (one flag, several values) as repeated ``--goodput`` options."""
    out: list[str] = []
    i, after_goodput = 0, False
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        if after_goodput and _GOODPUT_ITEM.match(arg):
            out += ["--goodput", arg]
        else:
            out.append(arg)
            after_goodput = arg.startswith("--goodput=")
            if arg == "--goodput" and i + 1 < len(args):
                out.append(args[i + 1])
                i, after_goodput = i + 1, True
        i += 1
    return out


_DECIMAL = re.compile(r"[0-9]+(\.[0-9]+)?")
_TYPER = object()  # plain_value's "not plain: typer's own coercion"


def plain_value(value, param, ctx):
    """``value`` as typer's pydantic coercion would return it, where that needs no work (None, a value of the
    option's own type within its bounds, an int or decimal written in digits, a choice's exact name), else
    ``_TYPER``."""
    desc = param.type_descriptor
    if value is None:
        return () if param.multiple or param.nargs == -1 else None
    kind, info = desc.annotation, desc.parameter_info
    if param.multiple or param.nargs != 1 or info.parser is not None or desc.file_annotation is not None:
        return _TYPER
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        if type(value) is kind:
            return value
        if type(value) is str and info.case_sensitive and ctx.token_normalize_func is None:
            return next((c for c in kind if str(c.value) == value), _TYPER)
        return _TYPER
    if type(value) is str:
        if kind is str:
            return value
        if kind not in (int, float) or len(value) > 18 or not _DECIMAL.fullmatch(value):
            return _TYPER
        if kind is int and not value.isdigit():
            return _TYPER
        value = kind(value)
    if type(value) is not kind or kind not in (int, float) or not math.isfinite(value):
        return _TYPER
    inside = (info.min is None or value >= info.min) and (info.max is None or value <= info.max)
    return value if inside else _TYPER


class PlainValues:
    """Coerces an option's value as typer 0.2x does, without building its pydantic TypeAdapter where
    :func:`plain_value` can say the result: typer coerces every value, defaults included, through an adapter
    it builds on first use, and importing pydantic and building a command's ~35 adapters was about a fifth of
    a ``bullet simulate`` run's start-up. Anything else, errors included, goes to typer's coercion, built
    then."""

    def coerce(self, value, param, ctx):
        plain = plain_value(value, param, ctx)
        if plain is not _TYPER:
            return plain
        param._runtime_param = None  # typer's own, built now
        return param.get_runtime_param().coerce(value, param=param, ctx=ctx)


def plain_values(command, ctx) -> None:
    """:class:`PlainValues` for the options of ``command`` whose coercion typer (0.2x) has not built yet."""
    for param in command.get_params(ctx):
        if getattr(param, "_runtime_param", False) is None and hasattr(param, "type_descriptor"):
            param._runtime_param = PlainValues()


class BulletGroup(SummaryGroup):
    """The ``bullet`` command group: reads vLLM's multi-value ``--goodput``, and reports a bad flag of a
    command (unknown option, value of the wrong type) in one red line with exit code 2, as every other bad
    input, instead of click's usage box."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        plain_values(self, ctx)
        return super().parse_args(ctx, expand_goodput(args))

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as e:
            raise fail(f"{ctx.invoked_subcommand or 'bullet'}: {e.format_message()}") from None


class PlainHelpCommand(TyperCommand):
    """A command whose --help is click's plain layout, its options grouped under their panel names: at 80
    columns every flag name stays whole (rich's table truncates long ones)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        plain_values(self, ctx)
        return super().parse_args(ctx, args)

    def format_help(self, ctx, formatter) -> None:
        super(TyperCommand, self).format_help(ctx, formatter)  # click's own, not Typer's rich one

    def format_options(self, ctx, formatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for name, rows in panels.items():
            with formatter.section(name):
                formatter.write_dl(rows)


app = typer.Typer(cls=BulletGroup, help="bullet: LLM serving with prefill and decode on disjoint SM partitions, "
                                        "and the simulator that plans it.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"bullet {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """bullet: LLM serving with prefill and decode on disjoint SM partitions, and the simulator that plans it."""


for _info in trace_app.registered_commands:  # the same plain --help as every other command
    _info.cls = PlainHelpCommand
app.add_typer(trace_app, name="trace", help="Inspect and generate request traces.")

from .cli_whatif import CONTEXT as _WHATIF_CONTEXT
from .cli_whatif import whatif

app.command(cls=PlainHelpCommand, context_settings=_WHATIF_CONTEXT)(whatif)

from .cli_validate import validate

app.command(cls=PlainHelpCommand)(validate)

def check_out_dir(out: Path, flag: str = "--out") -> None:
    """Fail now, not after the simulation, where ``out`` cannot be a folder to write into. Nothing is created:
    the folder itself is made when the files are written."""
    if out.exists() and not out.is_dir():
        raise fail(f"{flag} {out}: exists and is not a folder")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise fail(f"{flag} {out}: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".bullet-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise fail(f"{flag} {out}: cannot write in {probe}: {e.strerror or e}") from None


def check_out_file(path: Path, flag: str) -> None:
    """Fail now, not when the file is due, where ``path`` cannot be written (a folder, or no writable folder)."""
    if path.is_dir():
        raise fail(f"{flag} {path}: is a folder, not a file")
    check_out_dir(path.parent, flag)


def need_module(module: str, flag: str, extra: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise fail(f"{flag} needs {module}: pip install -e '.[{extra}]'") from None


def trace_row_lines(path: Path, fmt: str) -> list[int]:
    """The 1-based line of each data row of a trace file, in file order (blank lines skipped, as the readers
    skip them)."""
    text = path.read_text(encoding="utf-8-sig")
    if fmt == "mooncake":
        return [i for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    reader = csv.reader(io.StringIO(text))
    next(reader)
    return [reader.line_num for row in reader if row and not (len(row) == 1 and not row[0].strip())]


def trace_line(table: TraceTable, req_id: int) -> int:
    """The file line of the request ``load_trace`` numbered ``req_id`` from ``table``: ids follow arrival order
    (a stable sort of the rows by time) from the first row, and file order in a length-only trace."""
    import numpy as np

    row = req_id if table.arrivals is None else int(np.argsort(table.arrivals, kind="stable")[req_id])
    return trace_row_lines(Path(table.path), table.format)[row]


def too_long(requests: list[Request], model: ModelSpec, blocks: int, block_size: int) -> list[tuple[Request, str]]:
    """The requests no server could hold, each with why: more positions than the model has, or more KV than
    the whole cache."""
    out = []
    for r in requests:
        total = r.prompt_len + r.max_new_tokens
        need = -(-total // block_size)
        if total <= model.max_position and need <= blocks:
            continue
        lengths = f"{r.prompt_len} prompt + {r.max_new_tokens} output tokens"
        if total > model.max_position:
            why = f"{lengths} need {total} positions, more than {model.name} has ({model.max_position})"
        else:
            why = (f"{lengths} need {need} KV blocks of {block_size} tokens, more than the whole cache holds "
                   f"({blocks}; see --gpu-memory-utilization, --num-gpu-blocks-override)")
        out.append((r, why))
    return out


def reproduce_command(st: dict) -> str:
    """The ``bullet simulate`` command line that reruns a run from its recorded settings, every one explicit."""
    args = ["bullet", "simulate", "--trace", st["trace"], "--format", st["format"]]
    if st["num_prompts"] is not None:
        args += ["--num-prompts", str(st["num_prompts"])]
    if st["request_rate"] is not None:
        args += ["--request-rate", str(st["request_rate"])]
    if st["arrival"] is not None:
        args += ["--arrival", st["arrival"]] + (["--cv", repr(st["cv"])] if st["cv"] is not None else [])
    args += ["--seed", str(st["seed"])]
    if st["max_concurrency"] is not None:
        args += ["--max-concurrency", str(st["max_concurrency"])]
    if st["skip_oversized"]:
        args.append("--skip-oversized")
    if st.get("fuse_window_ms") is not None:
        args += ["--fuse-window-ms", repr(st["fuse_window_ms"])]
    if st.get("host_gap", "auto") != "auto":
        args += ["--host-gap", st["host_gap"]]
    args += ["--policy", st["policy"], "--max-num-seqs", str(st["max_num_seqs"]),
             "--max-num-batched-tokens", str(st["max_num_batched_tokens"])]
    for flag, (param, _) in POLICY_FLAGS.items():
        value = st.get(param)
        if value is None or value is False:
            continue
        args += [flag] if value is True else [flag, ",".join(map(str, value)) if isinstance(value, list) else
                                              repr(value) if isinstance(value, float) else str(value)]
    args += ["--model", st["model"], "--tensor-parallel-size", str(st["tensor_parallel_size"]), "--gpu", st["gpu"],
             "--latency", st["latency"], "--slo", st["slo"] or "none"]
    if st["slo"] is None:
        for flag, key in (("--slo-ttft", "slo_ttft_ms"), ("--slo-ttft-per-token", "slo_ttft_per_token_ms"),
                          ("--slo-tpot", "slo_tpot_ms")):
            if st[key] is not None:
                args += [flag, repr(st[key])]
    args += ["--block-size", str(st["block_size"])]
    if st["num_gpu_blocks_override"] is not None:
        args += ["--num-gpu-blocks-override", str(st["num_gpu_blocks_override"])]
    else:
        args += ["--gpu-memory-utilization", repr(st["gpu_memory_utilization"])]
    args += ["--prefix-caching" if st["prefix_caching"] else "--no-prefix-caching",
             "--hash-block-size", str(st["hash_block_size"]),
             "--metric-percentiles", ",".join(f"{p:g}" for p in st["metric_percentiles"])]
    return shlex.join(args)


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@app.command(cls=PlainHelpCommand)
def simulate(
    ctx: typer.Context,
    trace: TraceOpt = DEFAULT_TRACE,
    trace_format: FormatOpt = None,
    num_requests: NumPromptsOpt = None,
    request_rate: RequestRateOpt = None,
    arrival: ArrivalOpt = DEFAULT_ARRIVAL,
    cv: CvOpt = DEFAULT_CV,
    burstiness: BurstinessOpt = None,
    seed: SeedOpt = DEFAULT_SEED,
    max_concurrency: MaxConcurrencyOpt = None,
    skip_oversized: Annotated[bool, typer.Option(
        "--skip-oversized", help="Leave out requests longer than the model or the whole KV cache (counted in "
        "the summary) instead of stopping at the first.", rich_help_panel=WORKLOAD)] = False,
    hash_block_size: HashBlockSizeOpt = DEFAULT_HASH_BLOCK_SIZE,
    fuse_window_ms: Annotated[float | None, typer.Option(
        help="Plan as a live `bullet run --fuse-window-ms MS` engine does, not knowing the next arrival: fused "
             "decode launches end this far ahead (and, on the whole GPU, a launch that samples a first token "
             "ends with it), to compare with a live server. [default: plan to the next arrival]",
        show_default=False, rich_help_panel=POLICY)] = None,
    host_gap: Annotated[str, typer.Option(
        help="The engine's host time before each launch starts on the GPU (reading results back, planning, "
             "preparing inputs), 'A,B': A ms plus B ms per request of the launch; 'auto': the fitted latency "
             "model's (`bullet profile` measures it, `bullet fit` fits it; none with the roofline); 'off': "
             "none.", rich_help_panel=POLICY)] = "auto",
    policy: PolicyOpt = DEFAULT_POLICY,
    max_num_seqs: MaxNumSeqsOpt = DEFAULT_MAX_NUM_SEQS,
    max_batched_tokens: MaxBatchedTokensOpt = DEFAULT_MAX_BATCHED_TOKENS,
    prefill_sms: PrefillSmsOpt = DEFAULT_PREFILL_SMS,
    layers_per_step: LayersPerStepOpt = None,
    slo_margin: SloMarginOpt = DEFAULT_SLO_MARGIN,
    admission_control: AdmissionControlOpt = False,
    overload_deferral: OverloadDeferralOpt = True,
    async_scheduling: AsyncSchedulingOpt = False,
    decode_sizes: DecodeSizesOpt = None,
    model: ModelOpt = DEFAULT_MODEL,
    tp: Annotated[int | None, typer.Option(
        "--tensor-parallel-size", "-tp", "--tp", min=1, help="Tensor-parallel degree. [default: the preset's]",
        show_default=False, rich_help_panel=HARDWARE)] = None,
    gpu: GpuOpt = DEFAULT_GPU,
    latency: LatencyOpt = DEFAULT_LATENCY,
    slo: SloOpt = DEFAULT_SLO,
    slo_ttft: SloTtftOpt = None,
    slo_ttft_per_token: SloTtftPerTokenOpt = None,
    slo_tpot: SloTpotOpt = None,
    goodput: GoodputOpt = None,
    metric_percentiles: MetricPercentilesOpt = DEFAULT_METRIC_PERCENTILES,
    block_size: BlockSizeOpt = DEFAULT_BLOCK_SIZE,
    num_blocks: NumBlocksOpt = None,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = DEFAULT_GPU_MEMORY_UTILIZATION,
    prefix_caching: PrefixCachingOpt = DEFAULT_PREFIX_CACHING,
    out: Annotated[Path | None, typer.Option(
        help="Folder for summary.json, requests.csv (or .parquet) and timeline.csv.", show_default=False,
        rich_help_panel=OUTPUT)] = None,
    parquet: Annotated[bool, typer.Option(help="requests.parquet instead of .csv (needs pandas, pyarrow).",
                                          rich_help_panel=OUTPUT)] = False,
    plot: Annotated[bool, typer.Option(help="Also latency.png and timeline.png in --out (needs matplotlib).",
                                       rich_help_panel=OUTPUT)] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.",
                                          rich_help_panel=OUTPUT)] = False,
) -> None:
    """Simulate serving a trace on a virtual GPU: latency, throughput, SLO attainment and goodput."""
    given = given_flags(ctx)
    # Everything that can be wrong is found before the simulation runs.
    check_finite({"--request-rate": request_rate, "--cv": cv, "--burstiness": burstiness, "--slo-ttft": slo_ttft,
                  "--slo-tpot": slo_tpot, "--slo-ttft-per-token": slo_ttft_per_token, "--slo-margin": slo_margin,
                  "--gpu-memory-utilization": gpu_memory_utilization, "--fuse-window-ms": fuse_window_ms},
                 allow_inf=("--request-rate",))
    if fuse_window_ms is not None and fuse_window_ms <= 0:
        raise fail(f"--fuse-window-ms must be a positive number of milliseconds, got {fuse_window_ms:g}")
    gap = parse_host_gap(host_gap)
    arrival, cv = arrival_settings(request_rate, arrival, cv, burstiness, given)
    if plot and out is None:
        raise fail("--plot needs --out DIR (the folder the PNG files go to)")
    if out is not None:
        check_out_dir(out)
    if parquet:
        if out is None:
            raise fail("--parquet needs --out DIR (the folder requests.parquet goes to)")
        need_module("pandas", "--parquet", "data")
        need_module("pyarrow", "--parquet", "data")
    if plot:
        need_module("matplotlib", "--plot", "plot")
    percentiles = parse_percentiles(metric_percentiles)
    slo_cfg = slo_config(slo.value, given, slo_ttft, slo_ttft_per_token, slo_tpot, parse_goodput(goodput or []))
    slo_label = slo_name(slo.value, given)
    from simulator import simulate as run_simulation
    from simulator.run import latency_model, latency_name

    from .traces import TraceError

    try:
        model_spec = resolve_model(model, tp)
        gpu_spec = resolve_gpu(gpu)
        check_policy_flags(policy.value, given, layers_per_step, model_spec)
        sizes = parse_sizes(decode_sizes)
        sched = SchedulerConfig(policy=policy.value, max_num_seqs=max_num_seqs,
                                max_batched_tokens=max_batched_tokens, prefill_sms=prefill_sms,
                                layers_per_step=layers_per_step, slo_margin=slo_margin,
                                admission_control=admission_control, overload_deferral=overload_deferral and policy.value == "bullet",
                                decode_sizes=sizes, async_scheduling=async_scheduling)
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            gpu_memory_utilization=gpu_memory_utilization, prefix_caching=prefix_caching)
        kv_blocks = cache.blocks_for(model_spec, gpu_spec)
        requests, table = load_requests(trace, trace_format, num_requests, request_rate, arrival.value, cv, seed,
                                        hash_block_size, given)
        latency_backend = latency_model(latency, model_spec, gpu_spec)
    except (ConfigError, TraceError) as e:
        raise fail(str(e)) from None
    oversized = too_long(requests, model_spec, kv_blocks, block_size)
    if oversized and not skip_oversized:
        req, why = oversized[0]
        others = f" ({len(oversized) - 1} more such requests)" if len(oversized) > 1 else ""
        raise fail(f"{table.path}:{trace_line(table, req.id)}: {why}{others}; --skip-oversized leaves them out")
    if oversized:
        drop = {r.id for r, _ in oversized}
        requests = [r for r in requests if r.id not in drop]
        if not requests:
            raise fail(f"{table.path}: every request is too long: {oversized[0][1]}")
    console = Console(stderr=as_json)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("", total=len(requests))
        step = max(1, len(requests) // 200)
        count = 0

        def advance(_req) -> None:
            nonlocal count
            count += 1
            if count % step == 0:
                bar.update(task, completed=count)

        try:
            result = run_simulation(requests, model_spec, gpu_spec, sched, cache, slo_cfg, latency=latency_backend,
                                    on_finish=advance, max_concurrency=max_concurrency, percentiles=percentiles,
                                    live_window=None if fuse_window_ms is None else fuse_window_ms / 1e3,
                                    host_gap=gap, timeline=out is not None)  # (rows only for --out)
        except (ConfigError, RuntimeError, ValueError) as e:
            raise fail(str(e)) from None
    summary = result.summary
    summary["trace"] = trace
    summary["skipped_oversized"] = len(oversized)
    generated = table.arrivals is None and request_rate != math.inf
    settings = {
        "trace": trace, "trace_file": table.path, "trace_sha256": _sha256(table.path), "format": table.format,
        "num_prompts": num_requests, "request_rate": None if request_rate is None else
        ("inf" if request_rate == math.inf else request_rate),
        "arrival": arrival.value if generated else None,
        "cv": cv if generated and arrival == Arrival.gamma else None, "seed": seed,
        "max_concurrency": max_concurrency, "skip_oversized": skip_oversized, "fuse_window_ms": fuse_window_ms,
        "host_gap": host_gap,
        "policy": policy.value, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched_tokens,
        "prefill_sms": prefill_sms if policy.value == "static-split" else None,
        "layers_per_step": layers_per_step,
        "slo_margin": slo_margin if policy.value == "bullet" else None,
        "admission_control": admission_control if policy.value == "bullet" else None,
        "overload_deferral": overload_deferral if policy.value == "bullet" else None,
        "decode_sizes": list(sizes) if sizes else None, "async_scheduling": async_scheduling,
        "model": model, "tensor_parallel_size": model_spec.tp, "gpu": gpu_spec.name, "latency": latency,
        "latency_model": latency_name(latency_backend),
        "slo": slo_label, "slo_ttft_ms": None if slo_cfg.ttft is None else slo_cfg.ttft * 1e3,
        "slo_ttft_per_token_ms": None if slo_cfg.ttft_per_token is None else slo_cfg.ttft_per_token * 1e3,
        "slo_tpot_ms": None if slo_cfg.tpot is None else slo_cfg.tpot * 1e3,
        "block_size": block_size, "num_gpu_blocks_override": num_blocks,
        "gpu_memory_utilization": gpu_memory_utilization, "prefix_caching": prefix_caching,
        "hash_block_size": hash_block_size, "metric_percentiles": list(percentiles), "bullet_version": __version__,
    }
    settings["command"] = reproduce_command(settings)
    summary["settings"] = settings
    if out is not None:
        write_outputs(result, summary, out, parquet, plot)
    if as_json:
        from .metrics import json_safe

        json.dump(json_safe(summary), sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        print_summary(summary, console)
        if out is not None:
            console.print(f"wrote {out}/summary.json, requests.{'parquet' if parquet else 'csv'}, timeline.csv"
                          + (", latency.png, timeline.png" if plot else ""))


def write_outputs(result, summary: dict, out: Path, parquet: bool, plot: bool) -> None:
    """Every output file, each written to a temporary name and renamed."""
    from .metrics import write_json, write_requests

    try:
        write_json(summary, out / "summary.json")
        write_requests(result.columns, out / ("requests.parquet" if parquet else "requests.csv"))
        result.timeline.write_csv(out / "timeline.csv")
        if plot:
            from .plots import plot_run

            plot_run(result.columns, result.timeline, summary, out)
    except OSError as e:
        raise fail(f"--out {out}: cannot write: {e.strerror or e}") from None


@app.command(cls=PlainHelpCommand)
def profile(
    model: Annotated[str, typer.Option(help="Model preset or a Hugging Face config.json / model folder.")]
    = "llama-3.1-8b",
    weights: Annotated[str, typer.Option(help="'dummy' (seeded random weights: timing does not depend on "
                                              "values) or a folder of *.safetensors.")] = "dummy",
    out: Annotated[Path | None, typer.Option(help="Profile folder (default: profiles/<gpu>/<model>/). An "
                                                    "existing one is resumed: points already measured are "
                                                    "skipped.")] = None,
    quick: Annotated[bool, typer.Option("--quick/--full", help="Quick grid (every other partition size, fewer "
                                                               "lengths, 24 random launches, 32 random chunked "
                                                               "steps, 20 random co-run pairs: 408 points for "
                                                               "Llama-3.1-8B on an H200; 352 took about 4 min, "
                                                               "and its 56 co-run points alone 165 s, each "
                                                               "after 2 s of sustained co-running) "
                                                               "or the full grid (about 1,540 points).")]
    = True,
    reps: Annotated[int, typer.Option(min=1, help="Timed runs per point (after one warm-up run); the median "
                                                  "is kept.")] = 3,
    device: Annotated[str, typer.Option(help="'cuda' (or 'cuda:N'), or 'cpu' to run the same code on the host "
                                             "(tests; use --model tiny-llama).")] = "cuda",
    gpu_memory_utilization: Annotated[float, typer.Option(help="Fraction of GPU memory for weights and the KV "
                                                               "pool.")] = 0.85,
    prefill_graphs: Annotated[bool, typer.Option(help="Prefill and mixed launches a prefill graph can serve "
                                                      "(up to 512 tokens, 64 chunks) replay one, as serving does; "
                                                      "--no-prefill-graphs measures them eager.")] = True,
    redo_coruns: Annotated[bool, typer.Option(
        help="Measure every co-run point again (their rows are replaced): needed to resume a profile whose "
             "co-run points were measured by an older protocol (metadata.json's corun_protocol).")] = False,
    sizes: Annotated[str | None, typer.Option(
        help="Partition sizes of the solo points: 'all' (every menu size of both lanes, with the quick grid's "
             "lengths: +245 points for Llama-3.1-8B on an H200) or 'alternate' (every other one; the quick "
             "grid's default, 'all' the full grid's). The co-run splits and random launches stay the grid's, "
             "so the quick grid's points keep their ids.")] = None,
    twins: Annotated[bool, typer.Option(help="Measure each co-run shape alone on its own partition too (the "
                                             "stand-alone time a co-run point's slowdown is read against).")]
    = False,
    corun_min: Annotated[int, typer.Option(min=0, help="Add seeded co-run pairs on each decode size the "
                                                       "co-runs use until it has this many (0: none added).")]
    = 0,
    corun_all_splits: Annotated[bool, typer.Option(
        help="With --corun-min N: add the N pairs on every decode size of the menu, not only those the grid's "
             "co-runs use, so that every prefill size has co-runs beside its complement (the quick H200 grid has "
             "none at prefill 20 / decode 112 and 108 / 24).")] = False,
    corun_sweep: Annotated[bool, typer.Option(
        help="Add the co-runner sweeps: at four splits (prefill 36/44/68/92 SMs on the H200, decode the rest), "
             "one 2,048-token prompt beside 1-128 decode rows and 8 rows beside prompts of 256-8,192 tokens "
             "(104 co-run points for Llama-3.1-8B on an H200).")] = False,
    corun_passes: Annotated[int | None, typer.Option(
        min=1, help="Measure every co-run point in this many passes over all of them (after the solo points), "
                    "keeping each pass in corun_passes.csv and the median of a point's passes in points.csv; a "
                    "one-pass co-run row already there counts as the first pass. Default: the profile's own "
                    "(metadata.json), 1 for a new one. The re-measurement of issue 9 takes 3 with --corun-min 3 "
                    "(bench/RESULTS.md): estimated from the shipped profile's per-point times at about 800 s on an H200 "
                    "resuming it with --sizes all --twins, --corun-min 4 about 950 s (bench/profile_resume_estimate.py; "
                    "not yet measured).")] = None,
    decode_passes: Annotated[int | None, typer.Option(
        min=1, help="Measure every solo decode point in this many passes (after the other solo points, each pass "
                    "in the reverse order of the one before), keeping each pass in decode_passes.csv and the "
                    "median in points.csv; a one-pass row already there counts as the first pass. For the first "
                    "decode step's noise between passes (2.3 %, against 0.7 % within one). Default: the "
                    "profile's own (metadata.json), 1 for a new one.")] = None,
) -> None:
    """Measure the executor's own launches (prefill, decode graphs, mixed steps, co-runs) on every partition
    size and write points.csv + metadata.json, then the engine's host time between launches by batch size
    (gaps.csv; delete it to measure it again): the measurements a fitted latency model is made from. A
    resumed profile keeps the grid options and the co-run and decode passes it was measured with (metadata.json)."""
    try:
        spec = resolve_model(model)
    except ConfigError as e:
        raise fail(str(e)) from None
    try:
        import torch
    except ImportError:
        raise fail("bullet profile needs torch (pip install -e '.[gpu]')") from None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .gpu.executor import GpuExecutor
    from .gpu.profile import resumed_grid_options, run_profile

    if sizes not in (None, "all", "alternate"):
        raise fail(f"--sizes: {sizes!r} is not 'all' or 'alternate'")
    cpu = device == "cpu"
    if not cpu and not torch.cuda.is_available():
        raise fail("no CUDA device: run on a GPU machine, or use --device cpu --model tiny-llama to test")
    try:
        gpu_name = "cpu" if cpu else gpu_short_name(torch.cuda.get_device_name(torch.device(device)))
    except (RuntimeError, AssertionError) as e:
        raise fail(f"--device {device}: {e}") from None
    out = out or Path("profiles") / gpu_name / spec.name
    try:  # (before the executor: a bad combination costs no start-up)
        resumed_grid_options(out, sizes, twins, corun_min, corun_sweep, corun_all_splits)  # type: ignore[arg-type]
    except ValueError as e:
        raise fail(str(e)) from None
    console = Console()
    console.print(f"profiling {spec.name} ({weights} weights) on {gpu_name}, {'quick' if quick else 'full'} grid "
                  f"-> {out}")
    try:
        ex = GpuExecutor(spec, weights, device, num_blocks=4096 if cpu else None,
                         gpu_memory_utilization=gpu_memory_utilization)
    except (ValueError, OSError, ConfigError) as e:
        raise fail(f"cannot start the executor: {e}") from None
    try:
        ex.warmup()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("points", total=None)

            def on_point(done: int, total: int, pid: str) -> None:
                bar.update(task, completed=done, total=total, description=pid[:60])

            measured, skipped = run_profile(ex, out, weights, quick, reps, on_point, prefill_graphs,
                                            redo_coruns, sizes, twins, corun_min, corun_passes,  # type: ignore[arg-type]
                                            corun_sweep, decode_passes, corun_all_splits)
    except ValueError as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise fail(f"{out}: cannot write the profile: {e.strerror or e}") from None
    finally:
        ex.close()
    console.print(f"measured {measured} points ({skipped} already there) -> {out}/points.csv, metadata.json"
                  + (" (a point measured in passes counts once a pass)"
                     if (corun_passes or 1) > 1 or (decode_passes or 1) > 1 else ""))


@app.command(cls=PlainHelpCommand)
def fit(
    profile_dir: Annotated[Path, typer.Argument(metavar="PROFILE_DIR", help="Profile folder from `bullet profile` (points.csv + "
                                                     "metadata.json).")],
    out: Annotated[Path | None, typer.Option(help="Where to write the model JSON (default: "
                                                    "PROFILE_DIR/model.json).")] = None,
    force: Annotated[bool, typer.Option(help="Write the model even when its held-out error is over the "
                                             "thresholds (it records that it was forced).")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random 20 % held-out split.")] = 0,
) -> None:
    """Fit the latency model to a profile: per-family non-negative regressions on physical terms (bytes,
    FLOPs, GEMM waves, rows, context) by SM count, the host time of eager launches, co-run slowdowns, and
    (from gaps.csv, where the profile has one) the engine's host time between launches.
    Prints the held-out error (a random 20 % of the points; each partition size left out in turn, loso; and
    interior loso, which keeps each lane's smallest and largest size in training) and writes the model only
    if, on the random and the interior split, every kernel family is within 3 % MAPE and whole launches
    within 5 % mean and 10 % p95 (exit 1 otherwise, unless --force). Where the profile has corun_passes.csv,
    the spread of the co-run points between passes is printed too."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    try:
        from .perfmodel import fit as fitting
    except ImportError:
        raise fail("bullet fit needs scikit-learn: pip install -e '.[fit]'") from None
    console = Console()
    try:
        with Progress(SpinnerColumn(), TextColumn("fitting: {task.description}"), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("loading")
            model = fitting.fit_profile(profile_dir, seed,
                                        on_fold=lambda name: bar.update(task, description=f"held out {name}"))
    except ConfigError as e:
        raise fail(str(e)) from None
    except ImportError as e:
        raise fail(f"bullet fit needs scikit-learn ({e}): pip install -e '.[fit]'") from None
    print_fit_table(model, console)
    from .gpu.profile import CORUN_PROTOCOL

    protocol = model["profile"]["metadata"].get("corun_protocol", {"name": "single burst"})
    if protocol.get("name") != CORUN_PROTOCOL["name"] and \
            any(model["families"][f]["points"] for f in ("co_eager", "co_decode")):
        console.print(f"[yellow]note[/yellow]: the co-run points were measured by the {protocol.get('name')!r} "
                      f"protocol, not the current {CORUN_PROTOCOL['name']!r} one (on the H200 a single burst "
                      "measured co-runs 3-5 % faster than serving runs them): re-measure them with bullet "
                      "profile --redo-coruns", highlight=False)
    problems = model["errors"]["failures"]
    out = out or profile_dir / "model.json"
    if problems and not force:
        console.print("[red]not written[/red]: held-out error over the thresholds: " + "; ".join(problems)
                      + " (--force writes it anyway)", highlight=False)
        raise typer.Exit(1)
    model["forced"] = bool(problems)
    try:
        fitting.write_model(model, out)
    except OSError as e:
        raise fail(f"{out}: cannot write the model: {e.strerror or e}") from None
    note = " [yellow](forced: over the thresholds)[/yellow]" if problems else ""
    console.print(f"wrote {out}{note}")


def print_fit_table(model: dict, console: Console) -> None:
    err = model["errors"]
    # narrow enough for 80 columns: no cell borders, one space between columns, no "%" in the cells
    table = Table(title=f"held-out MAPE (%) of the model: {model['model_spec']['name']} on {model['gpu']['name']}, "
                        f"{model['profile']['points']} points",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("family", no_wrap=True)
    splits_shown = [s for s in ("random", "loso", "interior")  # (a model file from before interior loso: two)
                    if any(s in v for v in err["held_out"].values())]
    for split in splits_shown:
        table.add_column(f"{ {'random': 'rand', 'interior': 'intr'}.get(split, split)}\nn", justify="right")
        table.add_column("\nmean", justify="right")
        table.add_column("\np95", justify="right")
    table.add_column("in-\nsample", justify="right")
    limit = {"launch": err["thresholds"]["launch_mean"]}

    def cell(v: float | None, bound: float | None) -> str:
        if v is None:
            return "-"
        text = f"{100 * v:.1f}"
        return f"[red]{text}[/red]" if bound is not None and v > bound else text

    for fam, splits in err["held_out"].items():
        bound = limit.get(fam, err["thresholds"]["family_mean"] if fam in err["gated"] else None)
        p95_bound = err["thresholds"]["launch_p95"] if fam == "launch" else None
        row = [fam if fam in err["gated"] or fam == "launch" else f"{fam} (*)"]
        for split in splits_shown:
            s = splits[split]
            gated = split in err.get("gated_splits", ("random", "loso"))
            row += [str(s["n"]), cell(s["mean"], bound if gated else None), cell(s["p95"], p95_bound if gated else None)]
        ins = err["in_sample"].get(fam, {}).get("mean")
        row.append(cell(ins, None))
        table.add_row(*row)
    console.print(table)
    console.print("rand: a random 20 % of the points held out (seed {}); loso: each SM count held out in turn; "
                  "intr: interior loso, loso without holding out a lane's smallest or largest size (extrapolation past "
                  "anything measured, which service never meets). Gated: {}. (*) not gated: host time counts "
                  "through whole launches.".format(err["seed"], " and ".join(err.get("gated_splits", ("random", "loso")))))
    for key, what in (("decode_passes", "solo decode points"), ("decode_first_passes", "their first steps")):
        if (spread := model["profile"].get(key)) is not None:
            console.print(f"{what} measured in passes ({spread['source']}): {spread['points']} points, up to "
                          f"{spread['passes']} passes each; (max - min) / median {100 * spread['spread_mean']:.1f} % "
                          f"mean, one pass's sd {100 * spread['pass_sd']:.1f} % (pooled)", highlight=False)
    spread = model["profile"].get("corun_passes")
    if spread is not None:
        console.print(f"co-run points measured in passes ({spread['source']}): {spread['points']} points, up to "
                      f"{spread['passes']} passes each; (max - min) / median {100 * spread['spread_mean']:.1f} % "
                      f"mean, one pass's sd {100 * spread['pass_sd']:.1f} % (pooled)", highlight=False)
        if spread.get("not_median") or spread.get("no_row"):
            console.print(f"warning: {spread['not_median']} co-run rows of points.csv are not the median of their "
                          f"passes and {spread['no_row']} points with passes have no row (a passes run stopped "
                          "before it wrote them; the next `bullet profile` run on the folder writes them): this "
                          "fit is of those rows", highlight=False)
    gap = model.get("host_gap")
    if gap is not None:
        pts = ", ".join(f"{n}: {g * 1e3:.3f} ms ({e:+.1f} %)"
                        for n, g, e in zip(gap["seqs"], gap["gap_s"], gap["loo_error_pct"]))
        console.print(f"host time between launches (gaps.csv): {gap['fixed_s'] * 1e3:.3f} ms + "
                      f"{gap['per_request_s'] * 1e6:.2f} us a request; by batch size, measured (error left out "
                      f"of the fit): {pts}", highlight=False)


def slo_label(s: dict, preset: str | None) -> str:
    """The SLOs of a summary in words, with the preset's name."""
    slo = s["slo"]
    parts = []
    if slo["ttft_per_token_ms"] is not None:
        parts.append(f"TTFT {slo['ttft_per_token_ms']:g} ms/token")
    elif slo["ttft_ms"] is not None:
        parts.append(f"TTFT {slo['ttft_ms']:g} ms")
    if slo["tpot_ms"] is not None:
        parts.append(f"TPOT {slo['tpot_ms']:g} ms")
    return (", ".join(parts) or "no SLO") + (f"; {preset}" if preset and preset != "none" else "")


def summary_tables(s: dict, title: str, cols: list[str], preset: str | None) -> tuple[Table, Table]:
    """The latency table (TTFT, TPOT, ITL, E2E by ``cols``) and the throughput / SLO table of a summary, as
    `bullet simulate` and `bullet bench` print them (callers add their own rows to the second)."""
    lat = Table(title=title, title_justify="left")
    lat.add_column("latency (ms)")
    for col in cols:
        lat.add_column(col, justify="right")
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = s[f"{name}_ms"]
        lat.add_row(name.upper(), *("-" if math.isnan(row[c]) else f"{row[c]:.1f}" for c in cols))
    tput = Table(show_header=False)
    tput.add_column(justify="left")
    tput.add_column(justify="right")
    tput.add_row("request throughput", f"{s['request_throughput']:.2f} req/s")
    tput.add_row("output token throughput", f"{s['output_throughput']:.0f} tok/s")
    tput.add_row("total token throughput", f"{s['total_token_throughput']:.0f} tok/s")
    tput.add_row(f"SLO attainment ({slo_label(s, preset)})", f"{100 * s['slo_attainment']:.1f} %")
    tput.add_row("goodput", f"{s['goodput']:.2f} req/s")
    return lat, tput


def print_summary(s: dict, console: Console) -> None:
    title = (f"{s['policy']} · {s['model']} on {s['gpu']} · {s['requests']} requests · "
             f"{s['duration_s']:.1f} s simulated in {s['sim_wall_s']:.2f} s")
    lat, tput = summary_tables(s, title, list(s["ttft_ms"]), s.get("settings", {}).get("slo"))
    console.print(lat)
    if s.get("rejected"):
        tput.add_row("[yellow]rejected (never served)[/yellow]", f"{s['rejected']:,}: {s['rejected_example']}")
    if s.get("skipped_oversized"):
        tput.add_row("[yellow]left out (--skip-oversized)[/yellow]", f"{s['skipped_oversized']:,}")
    tput.add_row("preemptions", str(s["preemptions"]))
    if "jobs_set_aside" in s:  # bullet: prefill jobs set aside between slices for an urgent prompt
        tput.add_row("prefill jobs set aside", f"{s['jobs_set_aside']:,}")
    if "requests_deferred" in s:  # bullet: arrivals deferred under overload (ordered as late requests)
        tput.add_row("requests deferred (overload)", f"{s['requests_deferred']:,}")
    if "latency_model" in s:
        tput.add_row("latency model", re.sub(r"^fitted: profiles/([^/]+/[^/]+)/model\.json$", r"fitted (shipped, \1)",
                                             s["latency_model"]))
    gap = s.get("config", {}).get("host_gap_s")
    if gap and any(gap):
        ahead = s.get("launches_planned_ahead")
        tput.add_row("host time before each launch", f"{gap[0] * 1e3:.2f} ms + {gap[1] * 1e6:.1f} us a request" + (
            f" (hidden for {100 * ahead / max(s['launches'], 1):.0f} %: async scheduling)" if ahead is not None else ""))
    if s.get("prefix_caching"):
        tput.add_row("prefix cache hit rate",
                     f"{100 * s['prefix_cache_hit_rate']:.1f} % ({s['prefix_cache_hit_tokens']:,} of "
                     f"{s['prefix_cache_query_tokens']:,} tokens)")
    for lane, busy in s.get("lane_busy_s", {}).items():
        tput.add_row(f"GPU busy, {lane} lane", f"{busy:.1f} s ({100 * s['lane_busy_frac'][lane]:.0f} %)")
    console.print(tput)


from .cli_run import register as _register_run  # `bullet run`: live serving (bullet/cli_run.py)

_register_run(app, PlainHelpCommand)

from .cli_bench import register as _register_bench  # `bullet bench`: load generator (bullet/cli_bench.py)

_register_bench(app, PlainHelpCommand)


def main() -> None:
    """The ``bullet`` command. ``bullet COMMAND ...`` builds COMMAND's click command alone, not the whole group's:
    typer builds every option of every command from its annotations, which cost about a sixth of a short
    command's start-up. Anything else (no command, ``--help``, ``--version``, a mistyped name) gets the group.

    The collector leaves alone what is alive when the command starts (modules, functions: never garbage) and,
    when the process ends with the command, what it made: a ``bullet simulate`` of the Azure conversation trace
    spent ~2 % of its instructions in collections scanning the imports, the trace's requests and the results,
    most of it in the one at exit (bench/RESULTS.md, seventeenth speed pass)."""
    name = sys.argv[1] if len(sys.argv) > 1 else None
    commands = [c for c in app.registered_commands
                if (c.name or get_command_name(c.callback.__name__)) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if commands or groups:
        entry = copy.copy(app)  # the same app (settings, callback, group class) with that one command
        entry.registered_commands, entry.registered_groups = commands, groups
    else:
        entry = app
    gc.freeze()
    try:
        entry()
    finally:
        gc.freeze()


if __name__ == "__main__":
    main()
