"""``bullet validate``: the simulator against the real executor on the same requests (see bullet/validate.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .cli_options import AsyncSchedulingOpt
from .cli_trace import fail, parse_host_gap, parse_sizes
from .config import POLICIES, ConfigError, SchedulerConfig, SloConfig, resolve_gpu, resolve_model


def _ms(v: float | None) -> float | None:
    return None if v is None else v / 1e3


def validate(
    policy: Annotated[str, typer.Option(help=f"Scheduling policy: {', '.join(POLICIES)}.")] = "chunked",
    model: Annotated[str, typer.Option(help="Model preset or a Hugging Face config.json / model folder.")]
    = "llama-3.1-8b",
    weights: Annotated[str, typer.Option(help="'dummy' (seeded random weights) or a folder of *.safetensors.")]
    = "dummy",
    device: Annotated[str, typer.Option(help="'cuda' (or 'cuda:N'), or 'cpu' (the tiny model: tests).")] = "cuda",
    gpu: Annotated[str, typer.Option(help="GPU preset the simulator and the policy plan for.")] = "h200",
    trace: Annotated[str, typer.Option(help="Trace file or bundled trace name; several, comma-separated, are "
                                            "served in turn on one executor.")] = "sharegpt",
    num_requests: Annotated[int, typer.Option(help="Requests served (the trace's first N after --start).",
                                              min=1)] = 200,
    rate: Annotated[str | None, typer.Option(help="Request rate (req/s); default: the trace's timing. "
                                                  "Several, comma-separated (e.g. 3,6,9: light, medium, near "
                                                  "capacity), are served in turn on one executor.")] = None,
    load: Annotated[str | None, typer.Option(
        help="Loads as fractions of the policy's simulated capacity on each trace, comma-separated (e.g. "
             "0.3,0.6,0.9: light, medium, near capacity); capacity = the highest rate at which >= 90 % of the "
             "same requests meet both SLOs in the simulator (same policy, KV pool and latency model), found "
             "before serving. Instead of --rate.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of synthetic arrivals and prompt ids.")] = 0,
    start: Annotated[int, typer.Option(help="Skip this many trace rows first.", min=0)] = 0,
    max_prompt: Annotated[int | None, typer.Option(help="Leave out prompts longer than this.")] = None,
    latency: Annotated[str, typer.Option(help="Latency model for the policy and the simulator: auto, roofline, "
                                              "fitted, or a model JSON path.")] = "auto",
    max_batched_tokens: Annotated[int, typer.Option(help="Token budget of one step (chunked, prefill-first; "
                                                         "bullet's prefill batch cap).")] = 8192,
    prefill_sms: Annotated[int, typer.Option(help="static-split: SMs of the prefill partition.")] = 92,
    layers_per_step: Annotated[int | None, typer.Option(help="Split policies: prefill layers per launch.")]
    = None,
    decode_sizes: Annotated[str | None, typer.Option(help="bullet: comma-separated decode partition sizes "
                                                          "(graphs are captured for each at start-up).")]
    = None,
    slo_ttft: Annotated[float, typer.Option(help="TTFT SLO in ms.")] = 3000.0,
    slo_tpot: Annotated[float, typer.Option(help="TPOT SLO in ms.")] = 150.0,
    slo_ttft_per_token: Annotated[float | None, typer.Option(help="TTFT SLO in ms per prompt token.")] = None,
    prefix_caching: Annotated[bool, typer.Option(help="Reuse cached prompt blocks.")] = False,
    async_scheduling: AsyncSchedulingOpt = False,
    num_blocks: Annotated[int | None, typer.Option(help="KV blocks (default: from GPU memory; 4096 on the "
                                                        "CPU).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="Fraction of GPU memory to use.")] = 0.85,
    max_error: Annotated[float, typer.Option(help="Exit with code 1 if the simulator misses the mean or p90 "
                                                  "TTFT or TPOT by more than this many percent.")] = 5.0,
    host_gap: Annotated[str, typer.Option(
        help="The simulator's host time before each launch: 'auto' (the fitted model's), 'off', or 'A,B' (A ms "
             "plus B ms per request), as `bullet simulate --host-gap`.")] = "auto",
    warmup: Annotated[bool, typer.Option(help="Build prefill attention plans before serving.")] = True,
    prefill_graphs: Annotated[bool, typer.Option(
        help="Capture prefill/mixed-launch CUDA graphs (token buckets up to 512) for the policy's partitions "
             "before serving; small launches then replay them instead of ~300 eager kernel launches.")] = True,
    prefill_graph_tokens: Annotated[int, typer.Option(
        help="The largest prefill graph's token bucket (a power of two, 16-8192; buckets are the powers of two "
             "from 16 up to it). Above 512 the fitted model's launches still count eager host time for the "
             "launches the profile ran eagerly (its metadata's prefill_graphs), so use it with --latency "
             "roofline or a profile measured with the same buckets.")] = 512,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    save_scaled: Annotated[Path | None, typer.Option(
        help="Write the fitted latency model scaled by the launch speed measured over all runs (this card's "
             "measured / predicted launch time, with prompt rows and decode-only) to this JSON file: a model of "
             "this card, for --latency PATH in every command, with the engine's host time between a lane's "
             "back-to-back launches as these runs paid it (serving_gap: the simulator's host gap). Measured on the "
             "H200 it helps single-lane policies (chunked) most; co-run contention is not a scale "
             "(bench/RESULTS.md).")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for report.json, cdf.png and launches.csv (every "
                                                   "real launch: its work, the fraction the other lane "
                                                   "overlapped, measured and predicted ms).")]
    = None,
) -> None:
    """Serve the same requests on the real executor and in the simulator (same arrivals, policy code and
    latency model) and print the simulator's error per metric and per launch kind."""
    from . import validate as lib
    from .traces import TraceError, load_trace, materialize_prompt_ids

    if policy not in POLICIES:
        raise fail(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if out is not None and out.exists() and not out.is_dir():
        raise fail(f"--out {out}: exists and is not a folder")
    gap = parse_host_gap(host_gap)
    if not (16 <= prefill_graph_tokens <= 8192 and prefill_graph_tokens & (prefill_graph_tokens - 1) == 0):
        raise fail(f"--prefill-graph-tokens must be a power of two in 16-8192, got {prefill_graph_tokens}")
    buckets = tuple(2 ** i for i in range(4, prefill_graph_tokens.bit_length()))
    if save_scaled is not None:
        from .cli import check_out_file

        check_out_file(save_scaled, "--save-scaled")
    try:
        from simulator.run import latency_model

        spec, gpu_spec = resolve_model(model), resolve_gpu(gpu)
        sizes = parse_sizes(decode_sizes)
        cfg = SchedulerConfig(policy=policy, max_batched_tokens=max_batched_tokens, prefill_sms=prefill_sms,
                              layers_per_step=layers_per_step, decode_sizes=sizes, async_scheduling=async_scheduling)
        slo = SloConfig(ttft=_ms(slo_ttft), tpot=_ms(slo_tpot), ttft_per_token=_ms(slo_ttft_per_token))
        lat = latency_model(latency, spec, gpu_spec)
        if save_scaled is not None and not hasattr(lat, "scaled"):
            raise ConfigError(f"--save-scaled scales a fitted latency model; --latency {latency} gives the "
                              f"{type(lat).__name__}")
        if rate is not None and load is not None:
            raise ConfigError("give --rate or --load, not both")
        traces, rates = parse_list(trace, str, "--trace"), parse_list(rate, float, "--rate") if rate else [None]
        if any(r is not None and not r > 0 for r in rates):
            raise ConfigError(f"--rate must be positive, got {rate!r}")
        loads = parse_list(load, float, "--load") if load is not None else None
        if loads is not None and not all(0 < x <= 10 for x in loads):
            raise ConfigError(f"--load must be fractions of capacity in (0, 10], got {load!r}")

        def requests_of(tr: str, rt: float | None):
            def make_requests():
                reqs = load_trace(tr, num_requests=num_requests, rate=rt, seed=seed, start=start)
                reqs = [r for r in reqs if max_prompt is None or r.prompt_len <= max_prompt]
                if any(r.hash_ids is not None for r in reqs):
                    reqs = materialize_prompt_ids(reqs, spec.vocab_size, seed=seed)
                return reqs
            return make_requests

        for tr in traces:  # bad trace input fails here, before the executor is built
            if not requests_of(tr, rates[0] if loads is None else 1.0)():
                raise ConfigError(f"no requests left to serve from {tr} (--max-prompt {max_prompt})")
    except (ConfigError, TraceError, ValueError) as e:
        raise fail(str(e)) from None
    try:
        from .gpu.executor import GpuExecutor, prepare_graphs
    except ImportError as e:
        raise fail(f"bullet validate needs torch ({e})") from None
    cuda = device.startswith("cuda")
    console = Console(stderr=as_json)
    with console.status("starting the executor"):
        try:
            ex = GpuExecutor(spec, weights, device, num_blocks=num_blocks if num_blocks or cuda else 4096,
                             gpu_memory_utilization=gpu_memory_utilization, token_buckets=buckets)
        except (ValueError, RuntimeError, OSError) as e:
            raise fail(f"cannot start the executor: {e}") from None
        if cuda:
            if warmup:
                ex.warmup()
            prepare_graphs(ex, cfg, gpu_spec, prefill=prefill_graphs)
    reports = []
    try:
        runs = [(tr, rt, requests_of(tr, rt)) for tr in traces for rt in rates]
        caps: dict[str, float] = {}  # --load: each trace's simulated capacity
        if loads is not None:
            runs = []
            for tr in traces:
                with console.status(f"{tr}: the simulated capacity of {policy}"):
                    cap = lib.simulated_capacity(lambda rt, tr=tr: requests_of(tr, rt)(), spec, gpu_spec, cfg, slo,
                                                 lat, ex.kv.num_blocks, ex.kv.block_size, prefix_caching,
                                                 host_gap=gap)
                caps[tr] = cap
                if not 0 < cap < float("inf"):
                    why = "for < 90 % of requests at any rate" if cap <= 0 else "even with every request at once"
                    raise fail(f"{tr}: {policy} meets the SLOs {why} in the simulator: no capacity to scale "
                               "--load by (use --rate, or other SLOs)")
                console.print(f"{tr}: simulated capacity of {policy} {cap:.3g} req/s (>= 90 % meeting the SLOs); "
                              f"serving at " + ", ".join(f"{x:g}x = {x * cap:.3g}" for x in loads) + " req/s")
                runs += [(tr, round(x * cap, 3), requests_of(tr, round(x * cap, 3))) for x in loads]
        for i, (tr, rt, make) in enumerate(runs, 1):
            where = f"{tr}" + ("" if rt is None else f" @ {rt:g} req/s")
            with console.status(f"run {i}/{len(runs)} ({where}): serving {num_requests} requests, then "
                                f"simulating them"):
                rep = lib.validate(make, ex, spec, gpu_spec, cfg, slo, lat, ex.kv.num_blocks,
                                   ex.kv.block_size, prefix_caching, host_gap=gap)
            reports.append((tr, rt, rep))
            title = f"{policy} · {spec.name} · {where} · {num_requests} requests"
            if out is not None:
                folder = out if len(runs) == 1 else out / (Path(tr).stem + ("" if rt is None else f"@{rt:g}"))
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "report.json").write_text(json.dumps(rep.to_json(), indent=1, default=float) + "\n")
                lib.write_launch_rows(rep.launch_rows, folder / "launches.csv")
                try:
                    lib.plot_cdfs(rep, folder / "cdf.png", title)
                except ImportError:
                    console.print("matplotlib missing: no cdf.png")
            if not as_json:
                print_report(rep, title, max_error, console)
        card = _card_name(device) if save_scaled is not None else ""
    finally:
        ex.close()
    if save_scaled is not None:
        _save_scaled(save_scaled, lat, reports, policy, card, console)
    if as_json:
        doc = reports[0][2].to_json() if len(reports) == 1 else \
            {"runs": [{"trace": tr, "rate": rt, **({"capacity": caps[tr]} if tr in caps else {}), **rep.to_json()}
                      for tr, rt, rep in reports]}
        json.dump(doc, sys.stdout, indent=1, default=float)
        sys.stdout.write("\n")
    elif len(reports) > 1:
        print_summary(reports, policy, max_error, console)
    if max(rep.worst() for *_, rep in reports) * 100 > max_error:
        raise typer.Exit(1)


def _card_name(device: str) -> str:
    """The device's name and UUID where torch knows them (the card a scale was measured on)."""
    import torch

    if not device.startswith("cuda"):
        return device
    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{props.name} {getattr(props, 'uuid', '')}".strip()


def _save_scaled(path: Path, lat, reports, policy: str, card: str, console: Console) -> None:
    """``lat`` scaled by the launch speed of all ``reports``' launches pooled, written to ``path``."""
    import datetime as dt

    from .metrics import atomic_write
    from .validate import launch_speed, serving_gap

    rows = [r for *_, rep in reports for r in rep.launch_rows]
    a, b = launch_speed(rows)
    runs = [f"{Path(tr).stem}@{rt:g}" if rt is not None else Path(tr).stem for tr, rt, _ in reports]
    note = {"card": card, "policy": policy, "runs": runs,
            "measured": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    scaled = lat.scaled(a, b, **note, launches=len(rows))
    data = dict(scaled.data)
    try:  # the engine's host time between launches as serving paid it (the simulator's host gap from now on)
        data["serving_gap"] = {**serving_gap([rep.launch_rows for *_, rep in reports]), **note}
    except ValueError:  # no back-to-back launches: the profile's gap stays
        data.pop("serving_gap", None)
    gap = type(lat)(data, lat.host, str(path)).host_gap  # (validated as it will be read)
    with atomic_write(path) as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    gap_note = "" if "serving_gap" not in data else \
        f"; host gap {gap[0] * 1e3:.3f} ms + {gap[1] * 1e6:.1f} us a request, from {data['serving_gap']['gaps']} gaps"
    console.print(f"wrote {path}: {scaled.name} (launches with prompt rows x{a:.3f}, decode-only x{b:.3f} of "
                  f"the model, {len(rows)} launches on {card}{gap_note})")


def parse_list(text: str, kind, flag: str) -> list:
    """A comma-separated flag value as a list of ``kind``; ConfigError naming the flag otherwise."""
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be a comma-separated list of numbers, got {text!r}") from None
    if not items:
        raise ConfigError(f"{flag} is empty")
    return items


def print_summary(reports, policy: str, max_error: float, console: Console) -> None:
    """One row per run: the gated errors side by side."""
    t = Table(title=f"{policy} · simulator error per run (gated at {max_error:g} %)", title_justify="left")
    cols = ("TTFT mean (ms)", "TTFT p90 (ms)", "TPOT mean (ms)", "TPOT p90 (ms)")
    for col in ("trace", "rate", *(c.replace(" (ms)", "") for c in cols), "worst", "speed", "at speed"):
        t.add_column(col, justify="left" if col == "trace" else "right")
    for tr, rt, rep in reports:
        err = {r["metric"]: 100 * r["error"] for r in rep.rows}
        cells = [f"{err[c]:+.1f} %" for c in cols]
        worst = 100 * rep.worst()
        mark = "[red]✗[/red]" if worst > max_error else "[green]✓[/green]"
        at = 100 * rep.worst(rep.speed_rows)
        t.add_row(Path(tr).stem, "trace" if rt is None else f"{rt:g}", *cells, f"{worst:.1f} % {mark}",
                  f"{rep.speed[0]:.3g}/{rep.speed[1]:.3g}", f"{at:.1f} %")
    console.print(t)
    console.print("speed: the run's launches took this many times the model's prediction (with prompt rows / "
                  "decode only); at speed: the worst gated error of the run simulated again with the "
                  "predictions scaled so (what is left when this card's speed is known)")


def print_report(rep, title: str, max_error: float, console: Console) -> None:
    t = Table(title=title + " · simulator vs real", title_justify="left")
    for col in ("metric", "real", "simulated", "error"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in rep.rows:
        err = r["error"] * 100
        mark = "" if not r["gated"] else (" [red]✗[/red]" if abs(err) > max_error else " [green]✓[/green]")
        t.add_row(r["metric"] + (" *" if r["gated"] else ""), f"{r['real']:.2f}", f"{r['sim']:.2f}",
                  f"{err:+.1f} %{mark}")
    console.print(t)
    k = Table(title="latency model on each real launch (error = predicted vs measured)", title_justify="left")
    widest = max((len(r["kind"]) for r in rep.launches), default=4)
    k.add_column("kind", no_wrap=True, min_width=widest)
    for col in ("n", "ms p50", "p10 %", "p50 %", "p90 %", "sum %"):
        k.add_column(col, justify="right", no_wrap=True)
    for r in rep.launches:
        k.add_row(r["kind"], str(r["launches"]), f"{r['measured_ms_p50']:.2f}", f"{r['error_pct_p10']:+.1f}",
                  f"{r['error_pct_p50']:+.1f}", f"{r['error_pct_p90']:+.1f}", f"{r['error_pct_sum']:+.1f}")
    console.print(k)
    console.print("p10-p90: error per launch; sum: all the kind's predicted time against all its measured time "
                  "(what a queue sees); beside: the other lane ran for most of the launch; host gap: a lane's "
                  "time between back-to-back launches against the model's host_gap (the simulator's)")
    from .validate import STALL_FACTOR, stalls

    if stalled := stalls(rep.launch_rows):
        shown = "; ".join(f"#{r['n']} {r['kind']} {r['tokens']} tokens {r['seqs']} requests {r['measured_ms']:.0f} ms "
                          f"against {r['predicted_ms']:.0f}" for r in stalled[:3])
        typical = stalled[0]["typical_ratio"]
        scaled = f" x {typical:.2f} (the run's median measured / predicted)" if abs(typical - 1) > 0.05 else ""
        console.print(f"[yellow]{len(stalled)} launch(es) took over {STALL_FACTOR:g}x their prediction{scaled}: {shown}"
                      f"{' ...' if len(stalled) > 3 else ''} (a kernel compiled or an attention plan built in the "
                      "middle of the run? python3 bench/first_launch.py on the GPU shows what the warm-up "
                      "misses)[/yellow]")
    console.print(f"* gated at {max_error:g} %: worst {100 * rep.worst():.1f} %; at the run's own launch speed "
                  f"(x{rep.speed[0]:.3f} with prompt rows, x{rep.speed[1]:.3f} decode only): worst "
                  f"{100 * rep.worst(rep.speed_rows):.1f} %")
