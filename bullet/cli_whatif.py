"""``bullet whatif``: sweep configurations and find each one's capacity (bullet.whatif does the work)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .cli_trace import fail
from .config import ConfigError
from .traces import TraceError

if TYPE_CHECKING:
    from .whatif import Row, Sweep

SWEEP, SEARCH, RUN = "Sweep (lists or START:STOP:STEP ranges)", "Capacity search", "Running and output"
# Lets the command see unknown options itself (one red line instead of click's usage box).
CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}



def _opt(panel: str, help: str, *names: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, **kw)


def whatif(
    ctx: typer.Context,
    config: Annotated[Path | None, _opt(
        SWEEP, "TOML (or YAML, with PyYAML) file of settings: keys are the flag names "
        "(max_num_batched_tokens = [512, 2048]); flags given here override it.", "--config", "-c")] = None,
    policy: Annotated[str | None, _opt(SWEEP, "Policies: chunked, prefill-first, static-split, "
                                              "naive-concurrent, bullet. [chunked]")] = None,
    max_num_batched_tokens: Annotated[str | None, _opt(
        SWEEP, "Token budgets of a step. [8192]", "--max-num-batched-tokens", "--max-batched-tokens")] = None,
    prefill_sms: Annotated[str | None, _opt(SWEEP, "static-split: prefill partition sizes (the GPU's nested "
                                                   "menu; H200: 20, 28, ..., 124). [92]")] = None,
    layers_per_step: Annotated[str | None, _opt(SWEEP, "Split policies: prefill layers per launch.")] = None,
    max_num_seqs: Annotated[str | None, _opt(SWEEP, "Most requests running at once. [256]")] = None,
    async_scheduling: Annotated[str | None, _opt(SWEEP, "chunked, prefill-first: async scheduling off, on, or "
                                                        "both (off,on): each launch planned while the one "
                                                        "before it runs. [off]")] = None,
    request_rate: Annotated[str | None, _opt(SWEEP, "Rate grid (req/s), e.g. 2:20:2: exact SLO attainment at "
                                                    "each rate (the attainment plot's curves).")] = None,
    slo: Annotated[str | None, _opt(SWEEP, "Named SLO sets: paper-sharegpt, paper-azure-code, paper-arxiv "
                                           "(the Bullet paper's per workload), tight.")] = None,
    slo_ttft: Annotated[str | None, _opt(SWEEP, "TTFT SLOs in ms.")] = None,
    slo_tpot: Annotated[str | None, _opt(SWEEP, "TPOT SLOs in ms.")] = None,
    slo_ttft_per_token: Annotated[str | None, _opt(SWEEP, "TTFT SLOs in ms per prompt token (override "
                                                          "--slo-ttft).")] = None,
    model: Annotated[str | None, _opt(SWEEP, "Model presets or config.json paths. [llama-3.1-8b]")] = None,
    gpu: Annotated[str | None, _opt(SWEEP, "GPU presets: h200, h100, a100. [h200]")] = None,
    tensor_parallel_size: Annotated[str | None, _opt(
        SWEEP, "Tensor-parallel degrees (GPUs per replica; the cost counts each). [the model preset's]",
        "--tensor-parallel-size", "-tp", "--tp")] = None,
    trace: Annotated[str | None, _opt(SWEEP, "Traces: bundled names (sharegpt, azure-conv, azure-code, "
                                             "arxiv) or files. [sharegpt]")] = None,
    num_prompts: Annotated[str | None, _opt(SEARCH, "Requests per trace window. [1000]", "--num-prompts",
                                            "--num-requests")] = None,
    target_attainment: Annotated[str | None, _opt(SEARCH, "SLO attainment a capacity must reach. [0.9]")] \
        = None,
    rel_tol: Annotated[str | None, _opt(SEARCH, "Resolution of the capacity search: rates on a grid of this relative step. [0.02]")]
    = None,
    windows: Annotated[str | None, _opt(SEARCH, "Replicates over K consecutive trace windows (mean and "
                                                "spread reported). [1]")] = None,
    seeds: Annotated[str | None, _opt(SEARCH, "Replicates over N seeds of synthetic arrivals. [1]")] = None,
    seed: Annotated[str | None, _opt(SEARCH, "First seed. [0]")] = None,
    arrival: Annotated[str | None, _opt(SEARCH, "trace (its own arrivals rescaled to each rate; poisson "
                                                "for a length-only trace), poisson, gamma or constant. "
                                                "[trace]")] = None,
    cv: Annotated[str | None, _opt(SEARCH, "Gamma arrivals' coefficient of variation. [1]")] = None,
    latency: Annotated[str | None, _opt(SEARCH, "Latency model: auto, roofline, fitted or a model JSON. "
                                                "[auto]")] = None,
    guess: Annotated[str | None, _opt(SEARCH, "Rate where each capacity search starts. [the best grid rate, "
                                              "else a pilot run's estimate]")] = None,
    gpu_hour_cost: Annotated[str | None, _opt(SEARCH, "Price of one GPU-hour: adds the cost per million "
                                                      "output tokens at capacity.")] = None,
    capacity: Annotated[bool | None, _opt(SEARCH, "Search each configuration's capacity. [on]",
                                          "--capacity/--no-capacity")] = None,
    early_stop: Annotated[bool | None, _opt(SEARCH, "Stop a search's simulation once its verdict is certain "
                                                    "(same capacity; its attainment is then a bound). [on]",
                                            "--early-stop/--no-early-stop")] = None,
    jobs: Annotated[int, _opt(RUN, "Local worker processes.", min=1)] = os.cpu_count() or 1,
    ray_address: Annotated[str | None, _opt(RUN, "Run on Ray instead: auto (a running cluster), local "
                                                 "(start one here) or HOST:PORT (pip install "
                                                 "'bullet[ray]').")] = None,
    out: Annotated[Path | None, _opt(RUN, "Folder for capacity.csv, runs.csv (+ .parquet with pandas and "
                                          "pyarrow) and plots.")] = None,
    plot: Annotated[bool, _opt(RUN, "Also write attainment.png, capacity.png, cost.png into --out (needs "
                                    "matplotlib).")] = False,
    parquet: Annotated[bool | None, _opt(RUN, "Parquet copies of the tables. [when pandas and pyarrow are "
                                              "installed]", "--parquet/--no-parquet")] = None,
    as_json: Annotated[bool, _opt(RUN, "Print the results as JSON on stdout.", "--json")] = False,
) -> None:
    """Sweep policies, knobs, SLOs, models, GPUs and traces; for each configuration find its capacity (the
    highest request rate meeting the SLO attainment target) by a search over a fixed grid of rates (the trace
    rescaled to each), in parallel. Prints a table; --out writes CSV/Parquet and plots."""
    from . import whatif as lib  # (here, not at the top: 33 ms of imports every other command would pay)
    from .whatif import AXES

    if ctx.args:
        raise fail(f"unknown option {ctx.args[0]!r}; settings a sweep can vary: "
                   + ", ".join(lib.flag_of(n) for n in AXES))
    given = {"policy": policy, "max_num_batched_tokens": max_num_batched_tokens, "prefill_sms": prefill_sms,
             "layers_per_step": layers_per_step, "max_num_seqs": max_num_seqs, "async_scheduling": async_scheduling,
             "request_rate": request_rate,
             "slo": slo, "slo_ttft": slo_ttft, "slo_tpot": slo_tpot, "slo_ttft_per_token": slo_ttft_per_token,
             "model": model, "gpu": gpu, "tensor_parallel_size": tensor_parallel_size, "trace": trace,
             "num_prompts": num_prompts, "target_attainment": target_attainment, "rel_tol": rel_tol,
             "windows": windows, "seeds": seeds, "seed": seed, "arrival": arrival, "cv": cv,
             "latency": latency,
             "guess": guess, "gpu_hour_cost": gpu_hour_cost, "capacity": capacity, "early_stop": early_stop}
    given = {k: v for k, v in given.items() if v is not None}
    try:
        sweep = load_sweep(config, given)
        if out is not None:
            lib.check_out_dir(out)
        timed = lib.timed_traces(sweep)
        lib.check_configs(sweep)
    except (lib.SweepError, ConfigError, TraceError) as e:
        raise fail(str(e)) from None
    if plot:
        if out is None:
            raise fail("--plot needs --out DIR (the folder the PNG files go to)")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise fail("--plot needs matplotlib: pip install matplotlib") from None
    parquet = _parquet_wanted(parquet) if out is not None else False
    if ray_address is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise fail("--ray-address needs Ray: pip install 'bullet[ray]'") from None

    tasks = sweep.tasks(timed.__getitem__)
    console = Console(stderr=as_json)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    where = f"Ray ({ray_address})" if ray_address else f"{min(jobs, len(tasks))} process(es)"
    label = f"sweeping {len(sweep.configs())} configurations on {escape(where)}"
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        task_bar = bar.add_task("", total=len(tasks))
        results = lib.run_tasks(tasks, jobs, ray_address, on_done=lambda _: bar.advance(task_bar))
    wall = time.perf_counter() - t0
    rows = lib.summarize(sweep, results)
    written = []
    if out is not None:
        try:
            written = lib.write_outputs(out, sweep, rows, results, parquet, plot)
        except OSError as e:
            raise fail(f"--out {out}: cannot write: {e.strerror or e}") from None
    sims = sum(r.simulations for r in rows)
    if as_json:
        json.dump({"settings": lib.settings_of(sweep), "results": lib.rows_table(rows)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_results(sweep, rows, console)
        console.print(escape(lib.replicates_note(sweep, rows)), highlight=False)
        console.print(f"{sims} simulations in {wall:.1f} s on {where}", highlight=False)
        if written:
            console.print(f"wrote {', '.join(f'{out}/{w}' for w in written)}", highlight=False)
    if any(r.error for r in rows):
        bad = next(r for r in rows if r.error)
        count = sum(1 for r in rows if r.error)
        raise fail(f"{count} configuration(s) failed; first: {bad.label}: {bad.error}")


def load_sweep(config: Path | None, given: dict[str, Any]) -> Sweep:
    """Settings from the file (if any) with the flags given on top -> a validated Sweep."""
    from . import whatif as lib

    if config is None:
        return lib.parse_sweep(given)
    raw, where_in_file = lib.read_sweep_file(config)
    flags = {lib.KEYS.get(k.replace("-", "_").lower(), k) for k in given}
    merged = {k: v for k, v in raw.items() if lib.KEYS.get(k.replace("-", "_").lower(), k) not in flags}
    merged.update(given)
    return lib.parse_sweep(merged, lambda key: where_in_file(key) if key in raw and key not in given
                       else lib.flag_of(lib.KEYS.get(key, key)))


def _parquet_wanted(asked: bool | None) -> bool:
    try:
        import pandas  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError:
        if asked:
            raise fail("--parquet needs pandas and pyarrow: pip install 'bullet[data]'") from None
        return False
    return asked is not False


def print_results(sweep: Sweep, rows: list[Row], console: Console) -> None:
    from .whatif import AXES

    varying = sweep.varying()
    configs = sweep.configs()
    fixed = [f"{name}={_show(getattr(configs[0], name))}" for name in AXES
             if name not in varying and getattr(configs[0], name) is not None]
    table = Table(title=f"capacity at >= {100 * sweep.target:g} % SLO attainment · {sweep.num_requests} "
                        f"requests per window · " + ", ".join(fixed), title_justify="left")
    for name in varying:
        table.add_column(name.replace("_", " "), justify="left" if AXES[name][0] is str else "right")
    replicated = any(len(r.capacities) > 1 for r in rows)
    table.add_column("capacity req/s", justify="right")
    if replicated:
        table.add_column("± sd", justify="right")
        table.add_column("[min, max]", justify="right")
    table.add_column("output tok/s", justify="right")
    if sweep.gpu_hour_cost is not None:
        table.add_column("cost / M output tok", justify="right")
    table.add_column("sims", justify="right")
    for r in rows:
        cells = [_show(getattr(r.config, n)) for n in varying]
        if r.error:
            cells.append(f"[red]error[/red]: {escape(r.error)}")
            cells += [""] * (len(table.columns) - len(cells) - 1)
        elif r.mean is None:
            cells += ["-"] * (len(table.columns) - len(cells) - 1)
        else:
            cells.append(f"{r.mean:.2f}" if math.isfinite(r.mean) else "unbounded")
            if replicated:
                spread = math.isfinite(r.high)  # type: ignore[arg-type]
                cells += [_num(r.sd), f"[{r.low:.2f}, {r.high:.2f}]" if spread else "-"]
            cells.append(f"{r.output_tok_s:,.0f}" if math.isfinite(r.output_tok_s) else "-")
            if sweep.gpu_hour_cost is not None:
                cells.append(_num(r.cost_per_m_tokens, 3))
        cells.append(str(r.simulations))
        table.add_row(*cells)
    console.print(table)
    if any(r.mean == math.inf for r in rows):
        console.print("unbounded: even the whole window arriving at once met the target; the window is too "
                      "short for these SLOs to bind (more --num-prompts)", highlight=False)
    if sweep.rates:
        grid = Table(title="SLO attainment (%) at each rate (req/s)", title_justify="left")
        grid.add_column("configuration")
        for rate in sweep.rates:
            grid.add_column(f"{rate:g}", justify="right")
        for r in rows:
            cells = (f"{100 * r.grid[x]:.0f}" if x in r.grid else "-" for x in sweep.rates)
            grid.add_row(escape(r.label), *cells)
        console.print(grid)


def _show(v: Any) -> str:
    from .whatif import fmt_value

    return "-" if v is None else fmt_value(v)


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
