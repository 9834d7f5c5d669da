"""``bullet``: the command line. Each command turns flags into configs and calls the library."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .cli_trace import ArrivalChoice as Arrival
from .cli_trace import fail, trace_app
from .config import POLICIES, CacheConfig, ConfigError, SchedulerConfig, SloConfig, resolve_gpu, resolve_model

app = typer.Typer(help="bullet: LLM serving with prefill and decode on disjoint SM partitions, and the "
                       "simulator that plans it.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
app.add_typer(trace_app, name="trace", help="Inspect and generate request traces.")

from .cli_validate import validate

app.command()(validate)

Policy = Enum("Policy", {p.replace("-", "_"): p for p in POLICIES}, type=str)


def _ms(value: float | None) -> float | None:
    return None if value is None else value / 1e3


@app.command()
def simulate(
    trace: Annotated[str, typer.Option(help="Trace file (Azure/Vidur CSV, Mooncake JSONL, length-only CSV) "
                                            "or a bundled trace name: sharegpt, azure-conv, azure-code, arxiv.")]
    = "sharegpt",
    trace_format: Annotated[str | None, typer.Option("--format", help="Trace format if detection from "
                                                        "the header is not wanted: azure, vidur, mooncake, "
                                                        "lengths.")] = None,
    policy: Annotated[Policy, typer.Option(help="Scheduling policy.")] = Policy.chunked,
    model: Annotated[str, typer.Option(help="Model preset (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, "
                                            "qwen3-8b) or a Hugging Face config.json / model folder.")]
    = "llama-3.1-8b",
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel degree (shapes per GPU); default: "
                                                   "the preset's.")] = None,
    gpu: Annotated[str, typer.Option(help="GPU preset: h200, h100, a100.")] = "h200",
    rate: Annotated[float | None, typer.Option(help="Request rate (req/s): rescales a timed trace's "
                                                       "arrivals, or generates arrivals for a length-only "
                                                       "one. Default: the trace's own timing.")] = None,
    arrival: Annotated[Arrival, typer.Option(help="Arrival process when arrivals are generated.")]
    = Arrival.poisson,
    cv: Annotated[float, typer.Option(help="Coefficient of variation of inter-arrival times (gamma).")] = 1.0,
    num_requests: Annotated[int | None, typer.Option(help="Use the first N requests of the trace.")]
    = None,
    slo_ttft: Annotated[float, typer.Option(help="TTFT SLO in ms.")] = 3000.0,
    slo_tpot: Annotated[float, typer.Option(help="TPOT SLO in ms.")] = 150.0,
    slo_ttft_per_token: Annotated[float | None, typer.Option(
        help="TTFT SLO in ms per prompt token (Bullet paper: ShareGPT 3.0, Azure-Code 1.5, arXiv 1.5); "
             "overrides --slo-ttft.")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most requests running at once.")] = 256,
    max_batched_tokens: Annotated[int, typer.Option(help="Token budget of one step: the chunk size of "
                                                         "chunked prefill / prefill-first; for bullet, the "
                                                         "cap on its prefill batch (it batches up to where "
                                                         "the latency model says GEMMs stop gaining).")] = 8192,
    prefill_sms: Annotated[int, typer.Option(help="static-split: SMs of the prefill partition, a prefill "
                                                  "size of the GPU's nested menu (H200: 20, 28, ..., 124); "
                                                  "decode gets the rest.")]
    = 92,
    layers_per_step: Annotated[int | None, typer.Option(help="Split policies: prefill layers per "
                                                               "launch (default: all; bullet: 8).")] = None,
    slo_margin: Annotated[float, typer.Option(help="bullet: plan decode steps to fit each request's TPOT "
                                                   "budget with this fraction to spare (latency model error).",
                                              min=0.0, max=0.99)] = 0.1,
    admission_control: Annotated[bool, typer.Option(help="bullet: reject at once a request predicted to miss "
                                                         "its TTFT (counted as rejected) instead of serving "
                                                         "it best-effort behind the others.")] = False,
    decode_sizes: Annotated[str | None, typer.Option(help="bullet: comma-separated decode partition sizes it "
                                                          "may use (default: the whole decode menu; on a GPU "
                                                          "each size used costs its own decode graphs).")]
    = None,
    block_size: Annotated[int, typer.Option(help="KV cache block size in tokens.")] = 16,
    num_blocks: Annotated[int | None, typer.Option(help="KV cache blocks (default: sized from GPU "
                                                           "memory).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="Fraction of GPU memory for weights, "
                                                               "activations and KV cache.")] = 0.9,
    prefix_caching: Annotated[bool, typer.Option(help="Reuse the KV of full prompt blocks that an earlier "
                                                      "request computed (as vLLM's automatic prefix caching, "
                                                      "on by default there too). Needs prefix information: "
                                                      "the trace's hash_ids column or Mooncake hash_ids.")]
    = True,
    hash_block_size: Annotated[int, typer.Option(help="Prompt tokens per id in the trace's hash_ids "
                                                      "(Mooncake: 512).")] = 512,
    seed: Annotated[int, typer.Option(help="Seed of every random choice (generated arrivals).")] = 0,
    latency: Annotated[str, typer.Option(help="Latency model: 'auto' (the fitted model shipped in "
                                              "profiles/<gpu>/<model>/model.json if there is one, else the "
                                              "roofline), 'roofline', 'fitted' (the shipped one), or the path "
                                              "of a model JSON written by `bullet fit`.")] = "auto",
    out: Annotated[Path | None, typer.Option(help="Folder for summary.json, requests.csv (or .parquet) "
                                                     "and timeline.csv.")] = None,
    parquet: Annotated[bool, typer.Option(help="Write requests.parquet instead of requests.csv.")] = False,
    plot: Annotated[bool, typer.Option(help="Also write latency.png (TTFT/TPOT/E2E distributions) and "
                                            "timeline.png (each lane's launches over time) into --out "
                                            "(needs matplotlib).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout (progress "
                                                         "goes to stderr).")] = False,
) -> None:
    """Simulate serving a trace on a virtual GPU and print latency, throughput and SLO attainment."""
    if plot and out is None:
        raise fail("--plot needs --out DIR (the folder the PNG files go to)")
    from simulator import simulate as run_simulation
    from simulator.run import latency_model

    from .traces import TraceError, load_trace

    for flag, value in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot),
                        ("--slo-ttft-per-token", slo_ttft_per_token)):
        if value is not None and value <= 0:
            raise fail(f"{flag} must be a positive number of milliseconds, got {value:g}")
    try:
        model_spec = resolve_model(model, tp)
        gpu_spec = resolve_gpu(gpu)
        sizes = None
        if decode_sizes:
            try:
                sizes = tuple(int(x) for x in decode_sizes.split(","))
            except ValueError:
                raise ConfigError(f"--decode-sizes must be comma-separated integers, got {decode_sizes!r}") from None
        sched = SchedulerConfig(policy=policy.value, max_num_seqs=max_num_seqs,
                                max_batched_tokens=max_batched_tokens, prefill_sms=prefill_sms,
                                layers_per_step=layers_per_step, slo_margin=slo_margin,
                                admission_control=admission_control, decode_sizes=sizes)
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            gpu_memory_utilization=gpu_memory_utilization, prefix_caching=prefix_caching)
        slo = SloConfig(ttft=_ms(slo_ttft), tpot=_ms(slo_tpot), ttft_per_token=_ms(slo_ttft_per_token))
        requests = load_trace(trace, trace_format, num_requests=num_requests, rate=rate,
                              arrival_process=arrival.value, cv=cv, seed=seed,
                              hash_block_size=hash_block_size)
        latency_backend = latency_model(latency, model_spec, gpu_spec)
    except (ConfigError, TraceError) as e:
        raise fail(str(e)) from None
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
            result = run_simulation(requests, model_spec, gpu_spec, sched, cache, slo, latency=latency_backend,
                                    on_finish=advance)
        except (ConfigError, RuntimeError) as e:
            raise fail(str(e)) from None
    summary = result.summary
    summary["trace"] = trace
    if out is not None:
        from .metrics import write_json, write_requests

        write_json(summary, out / "summary.json")
        write_requests(result.columns, out / ("requests.parquet" if parquet else "requests.csv"))
        result.timeline.write_csv(out / "timeline.csv")
        if plot:
            try:
                from .plots import plot_run
            except ImportError:
                raise fail("--plot needs matplotlib: pip install matplotlib") from None
            plot_run(result.columns, result.timeline, summary, out)
    if as_json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_summary(summary, console)
        if out is not None:
            console.print(f"wrote {out}/summary.json, requests.{'parquet' if parquet else 'csv'}, timeline.csv"
                          + (", latency.png, timeline.png" if plot else ""))


def _gpu_short_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' -> 'a100'; the folder name of a profile."""
    import re

    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name.upper())
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@app.command()
def profile(
    model: Annotated[str, typer.Option(help="Model preset or a Hugging Face config.json / model folder.")]
    = "llama-3.1-8b",
    weights: Annotated[str, typer.Option(help="'dummy' (seeded random weights: timing does not depend on "
                                              "values) or a folder of *.safetensors.")] = "dummy",
    out: Annotated[Path | None, typer.Option(help="Profile folder (default: profiles/<gpu>/<model>/). An "
                                                    "existing one is resumed: points already measured are "
                                                    "skipped.")] = None,
    quick: Annotated[bool, typer.Option("--quick/--full", help="Quick grid (every other partition size, fewer "
                                                               "lengths: 225 s on an H200) or the full grid.")]
    = True,
    reps: Annotated[int, typer.Option(min=1, help="Timed runs per point (after one warm-up run); the median "
                                                  "is kept.")] = 3,
    device: Annotated[str, typer.Option(help="'cuda' (or 'cuda:N'), or 'cpu' to run the same code on the host "
                                             "(tests; use --model tiny-llama).")] = "cuda",
    gpu_memory_utilization: Annotated[float, typer.Option(help="Fraction of GPU memory for weights and the KV "
                                                               "pool.")] = 0.85,
) -> None:
    """Measure the executor's own launches (prefill, decode graphs, mixed steps, co-runs) on every partition
    size and write points.csv + metadata.json: the measurements a fitted latency model is made from."""
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
    from .gpu.profile import run_profile

    cpu = device == "cpu"
    if not cpu and not torch.cuda.is_available():
        raise fail("no CUDA device: run on a GPU machine, or use --device cpu --model tiny-llama to test")
    try:
        gpu_name = "cpu" if cpu else _gpu_short_name(torch.cuda.get_device_name(torch.device(device)))
    except (RuntimeError, AssertionError) as e:
        raise fail(f"--device {device}: {e}") from None
    out = out or Path("profiles") / gpu_name / spec.name
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

            measured, skipped = run_profile(ex, out, weights, quick, reps, on_point)
    except OSError as e:
        raise fail(f"{out}: cannot write the profile: {e.strerror or e}") from None
    finally:
        ex.close()
    console.print(f"measured {measured} points ({skipped} already there) -> {out}/points.csv, metadata.json")


@app.command()
def fit(
    profile_dir: Annotated[Path, typer.Argument(help="Profile folder from `bullet profile` (points.csv + "
                                                     "metadata.json).")],
    out: Annotated[Path | None, typer.Option(help="Where to write the model JSON (default: "
                                                    "PROFILE_DIR/model.json).")] = None,
    force: Annotated[bool, typer.Option(help="Write the model even when its held-out error is over the "
                                             "thresholds (it records that it was forced).")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random 20 % held-out split.")] = 0,
) -> None:
    """Fit the latency model to a profile: per-family non-negative regressions on physical terms (bytes,
    FLOPs, GEMM waves, rows, context) by SM count, the host time of eager launches, and co-run slowdowns.
    Prints the held-out error (a random 20 % of the points, and each partition size left out in turn) and
    writes the model only if every kernel family is within 3 % MAPE and whole launches within 5 % mean and
    10 % p95 (exit 1 otherwise, unless --force)."""
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
    table = Table(title=f"held-out error of the fitted model ({model['model_spec']['name']} on "
                        f"{model['gpu']['name']}, {model['profile']['points']} points; MAPE)",
                  title_justify="left")
    table.add_column("family")
    for split in ("rand", "loso"):
        table.add_column(f"{split} n", justify="right")
        table.add_column("mean", justify="right")
        table.add_column("p95", justify="right")
    table.add_column("in-sample", justify="right")
    limit = {"launch": err["thresholds"]["launch_mean"]}

    def cell(v: float | None, bound: float | None) -> str:
        if v is None:
            return "-"
        text = f"{100 * v:.1f} %"
        return f"[red]{text}[/red]" if bound is not None and v > bound else text

    for fam, splits in err["held_out"].items():
        bound = limit.get(fam, err["thresholds"]["family_mean"] if fam in err["gated"] else None)
        p95_bound = err["thresholds"]["launch_p95"] if fam == "launch" else None
        row = [fam if fam in err["gated"] or fam == "launch" else f"{fam} (*)"]
        for split in ("random", "loso"):
            s = splits[split]
            row += [str(s["n"]), cell(s["mean"], bound), cell(s["p95"], p95_bound)]
        ins = err["in_sample"].get(fam, {}).get("mean")
        row.append(cell(ins, None))
        table.add_row(*row)
    console.print(table)
    console.print("rand: a random 20 % of the points held out (seed {}); loso: each SM count held out in turn. "
                  "(*) not gated: host time counts through whole launches.".format(err["seed"]))


def print_summary(s: dict, console: Console) -> None:
    slo = s["slo"]
    ttft_slo = (f"{slo['ttft_per_token_ms']:g} ms/token" if slo["ttft_per_token_ms"] is not None
                else f"{slo['ttft_ms']:g} ms")
    title = (f"{s['policy']} · {s['model']} on {s['gpu']} · {s['requests']} requests · "
             f"{s['duration_s']:.1f} s simulated in {s['sim_wall_s']:.2f} s")
    lat = Table(title=title, title_justify="left")
    lat.add_column("latency (ms)")
    for col in ("mean", "p50", "p90", "p99"):
        lat.add_column(col, justify="right")
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = s[f"{name}_ms"]
        lat.add_row(name.upper(), *(f"{row[c]:.1f}" for c in ("mean", "p50", "p90", "p99")))
    console.print(lat)
    tput = Table(show_header=False)
    tput.add_column(justify="left")
    tput.add_column(justify="right")
    tput.add_row("request throughput", f"{s['request_throughput']:.2f} req/s")
    tput.add_row("output token throughput", f"{s['output_throughput']:.0f} tok/s")
    tput.add_row("total token throughput", f"{s['total_token_throughput']:.0f} tok/s")
    tput.add_row(f"SLO attainment (TTFT {ttft_slo}, TPOT {slo['tpot_ms']:g} ms)",
                 f"{100 * s['slo_attainment']:.1f} %")
    tput.add_row("goodput", f"{s['goodput']:.2f} req/s")
    if s.get("rejected"):
        tput.add_row("[yellow]rejected (never served)[/yellow]", f"{s['rejected']:,}: {s['rejected_example']}")
    tput.add_row("preemptions", str(s["preemptions"]))
    if "latency_model" in s:
        tput.add_row("latency model", s["latency_model"])
    if s.get("prefix_caching"):
        tput.add_row("prefix cache hit rate",
                     f"{100 * s['prefix_cache_hit_rate']:.1f} % ({s['prefix_cache_hit_tokens']:,} of "
                     f"{s['prefix_cache_query_tokens']:,} tokens)")
    for lane, busy in s.get("lane_busy_s", {}).items():
        tput.add_row(f"GPU busy, {lane} lane", f"{busy:.1f} s ({100 * s['lane_busy_frac'][lane]:.0f} %)")
    console.print(tput)


from .cli_run import register as _register_run  # `bullet run`: live serving (bullet/cli_run.py)

_register_run(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
