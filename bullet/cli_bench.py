"""``bullet bench``: load an OpenAI-compatible server with a trace and measure it as ``bullet simulate`` measures
a simulation (bullet/loadgen.py sends and records; bullet/metrics.py summarises)."""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from . import __version__
from .cli_options import (
    DEFAULT_ARRIVAL,
    DEFAULT_CV,
    DEFAULT_HASH_BLOCK_SIZE,
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_SEED,
    DEFAULT_SLO,
    DEFAULT_TRACE,
    OUTPUT,
    ArrivalOpt,
    BurstinessOpt,
    CvOpt,
    FormatOpt,
    GoodputOpt,
    HashBlockSizeOpt,
    MaxConcurrencyOpt,
    MetricPercentilesOpt,
    NumPromptsOpt,
    RequestRateOpt,
    SeedOpt,
    SloOpt,
    SloTpotOpt,
    SloTtftOpt,
    SloTtftPerTokenOpt,
    TraceOpt,
    arrival_settings,
    check_finite,
    given_flags,
    load_requests,
    parse_goodput,
    parse_percentiles,
    slo_config,
    slo_name,
)
from .cli_trace import fail

SERVER = "Server"
EndpointChoice = Enum("EndpointChoice", {"completions": "/v1/completions", "chat": "/v1/chat/completions"},
                      type=str)
PromptChoice = Enum("PromptChoice", {"ids": "ids", "text": "text"}, type=str)


def _check_file_target(path: Path | None, flag: str) -> None:
    """``path`` can be written: its folder exists (or can be made) and it is not a folder itself."""
    if path is None or str(path) == "-":
        return
    if path.is_dir():
        raise fail(f"{flag} {path}: is a folder; give a file name")
    probe = path.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise fail(f"{flag} {path}: {probe} is a file, not a folder")


def bench(
    ctx: typer.Context,
    base_url: Annotated[str, typer.Option(help="The server: http://HOST:PORT (bullet run, vLLM, SGLang, ...).",
                                          rich_help_panel=SERVER)] = "http://127.0.0.1:8000",
    endpoint: Annotated[EndpointChoice, typer.Option(
        help="API route: /v1/completions (prompts as token ids or text) or /v1/chat/completions (text).",
        rich_help_panel=SERVER)] = EndpointChoice.completions,
    model: Annotated[str | None, typer.Option(
        help="Model name sent with each request. [default: the first model the server lists at /v1/models]",
        show_default=False, rich_help_panel=SERVER)] = None,
    api_key: Annotated[str | None, typer.Option(
        help="Sent as 'Authorization: Bearer KEY'.", envvar="BULLET_API_KEY", show_default=False,
        rich_help_panel=SERVER)] = None,
    ignore_eos: Annotated[bool, typer.Option(
        help="Ask for exactly the trace's output length (the server ignores end-of-sequence tokens; vLLM, "
        "SGLang and bullet run support it).", rich_help_panel=SERVER)] = True,
    prompt_format: Annotated[PromptChoice | None, typer.Option(
        help="ids: prompts as token ids (exact lengths, no tokenizer needed; /v1/completions only); text: one "
        "word per token id (lengths as the server's tokenizer counts them, read from its usage). [default: ids "
        "for /v1/completions, text for chat]", show_default=False, rich_help_panel=SERVER)] = None,
    vocab_size: Annotated[int, typer.Option(
        min=1, help="Prompt token ids are drawn from [0, N) (requests sharing a trace hash id share tokens). "
        "256 is valid for every tokenizer; raise it to the model's vocabulary for more varied prompts.",
        rich_help_panel=SERVER)] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature sent.",
                                               rich_help_panel=SERVER)] = 0.0,
    request_timeout: Annotated[float, typer.Option(
        help="Seconds a request may take before it counts as failed.", rich_help_panel=SERVER)] = 600.0,
    trace: TraceOpt = DEFAULT_TRACE,
    trace_format: FormatOpt = None,
    num_requests: NumPromptsOpt = None,
    request_rate: RequestRateOpt = None,
    arrival: ArrivalOpt = DEFAULT_ARRIVAL,
    cv: CvOpt = DEFAULT_CV,
    burstiness: BurstinessOpt = None,
    seed: SeedOpt = DEFAULT_SEED,
    max_concurrency: MaxConcurrencyOpt = None,
    hash_block_size: HashBlockSizeOpt = DEFAULT_HASH_BLOCK_SIZE,
    slo: SloOpt = DEFAULT_SLO,
    slo_ttft: SloTtftOpt = None,
    slo_ttft_per_token: SloTtftPerTokenOpt = None,
    slo_tpot: SloTpotOpt = None,
    goodput: GoodputOpt = None,
    metric_percentiles: MetricPercentilesOpt = DEFAULT_METRIC_PERCENTILES,
    out: Annotated[Path | None, typer.Option(
        help="Per-request CSV (one row per request, failures with their error).", show_default=False,
        rich_help_panel=OUTPUT)] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Result JSON with vllm bench serve's keys (completed, mean_ttft_ms, p99_itl_ms, ...) and "
        "ours under 'bullet'; '-' prints it on stdout.", show_default=False, rich_help_panel=OUTPUT)] = None,
) -> None:
    """Load an OpenAI-compatible server (bullet run, vLLM, SGLang) with a trace at its arrival times, stream
    every request, and report TTFT, TPOT, ITL, E2E, throughput, SLO attainment and goodput with bullet
    simulate's definitions, measured at the client. Failed requests are counted, never fatal."""
    from . import loadgen
    from .traces import TraceError, materialize_prompt_ids

    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise fail("bullet bench needs aiohttp: pip install -e '.[bench]'") from None
    given = given_flags(ctx)
    check_finite({"--request-rate": request_rate, "--cv": cv, "--burstiness": burstiness,
                  "--temperature": temperature, "--request-timeout": request_timeout}, allow_inf=("--request-rate",))
    if request_timeout <= 0:
        raise fail(f"--request-timeout must be a positive number of seconds, got {request_timeout:g}")
    arrival, cv = arrival_settings(request_rate, arrival, cv, burstiness, given)
    percentiles = parse_percentiles(metric_percentiles)
    slo_cfg = slo_config(slo.value, given, slo_ttft, slo_ttft_per_token, slo_tpot, parse_goodput(goodput or []))
    chat = endpoint == EndpointChoice.chat
    fmt = prompt_format.value if prompt_format else ("text" if chat else "ids")
    if chat and fmt == "ids":
        raise fail("--prompt-format ids needs --endpoint /v1/completions (a chat message is text)")
    _check_file_target(out, "--out")
    _check_file_target(json_path, "--json")
    try:
        url = loadgen.normalize_url(base_url)
        requests, table = load_requests(trace, trace_format, num_requests, request_rate, arrival.value, cv, seed,
                                        hash_block_size, given)
        requests = materialize_prompt_ids(requests, vocab_size, seed=seed)
        served = loadgen.check_server(url, api_key)
    except (loadgen.BenchError, TraceError) as e:
        raise fail(str(e)) from None
    if model is None:
        if not served:
            raise fail(f"{url} lists no model at /v1/models: give --model")
        model = served[0]
    elif served and model not in served:
        raise fail(f"--model {model}: {url} serves {', '.join(served)}")
    cfg = loadgen.BenchConfig(base_url=url, model=model, endpoint=endpoint.value, api_key=api_key,
                              ignore_eos=ignore_eos, prompt_format=fmt, temperature=temperature,
                              max_concurrency=max_concurrency, timeout_s=request_timeout)
    records = loadgen.make_records(requests, fmt)
    to_stdout = json_path is not None and str(json_path) == "-"
    console = Console(stderr=to_stdout)
    rate_text = "trace timing" if request_rate is None else f"{request_rate:g} req/s"
    console.print(f"benchmarking {escape(model)} at {escape(url + cfg.endpoint)}: {len(records)} requests of "
                  f"{escape(table.path)}, {rate_text}" + (f", at most {max_concurrency} at once"
                                                          if max_concurrency else ""), highlight=False)
    _run(records, cfg, console)
    try:
        summary = loadgen.bench_summary(records, slo_cfg, sorted({*percentiles, 50.0}))
    except ValueError:  # nothing completed: not a usage error (exit 1), the run itself failed
        first = next(r.request.error for r in records if r.request.error)
        fail(f"all {len(records)} requests failed; the first: {first}")
        if out is not None:
            loadgen.write_records_csv(records, slo_cfg, out)
        raise typer.Exit(1) from None
    settings = {
        "base_url": url, "endpoint": cfg.endpoint, "model": model, "trace": trace, "trace_file": table.path,
        "num_prompts": num_requests, "request_rate": None if request_rate is None else
        ("inf" if request_rate == math.inf else request_rate), "burstiness": burstiness,
        "arrival": arrival.value, "cv": cv, "seed": seed, "max_concurrency": max_concurrency,
        "ignore_eos": ignore_eos, "prompt_format": fmt, "vocab_size": vocab_size, "temperature": temperature,
        "slo": slo_name(slo.value, given), "metric_percentiles": list(percentiles), "bullet_version": __version__,
    }
    summary["settings"] = settings
    print_bench(summary, percentiles, console)
    try:
        if out is not None:
            loadgen.write_records_csv(records, slo_cfg, out)
        if json_path is not None:
            result = {"date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
                      "backend": "openai-chat" if chat else "openai", "model_id": model, "tokenizer_id": None,
                      "num_prompts": len(records), "request_rate": settings["request_rate"] or "trace",
                      "burstiness": burstiness, "max_concurrency": max_concurrency,
                      **loadgen.vllm_result(records, summary, slo_cfg), "bullet": summary}
            _write_json(result, json_path)
    except OSError as e:
        raise fail(f"cannot write the results: {e.strerror or e}") from None


def _run(records, cfg, console: Console) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .loadgen import run_records

    with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("", total=len(records), failed="")
        failed = 0

        def done(rec) -> None:
            nonlocal failed
            failed += rec.request.error is not None
            bar.update(task, advance=1, failed=f"[red]{failed} failed[/red]" if failed else "")

        try:
            import asyncio  # (here: 25 ms of imports that every other command would pay at start-up)

            asyncio.run(run_records(records, cfg, done))
        except KeyboardInterrupt:
            raise fail("interrupted") from None


def _write_json(result: dict, path: Path) -> None:
    from .metrics import json_safe, write_json

    if str(path) == "-":
        json.dump(json_safe(result), sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        write_json(result, path)


def print_bench(s: dict, percentiles, console: Console) -> None:
    from .cli import summary_tables

    st = s["settings"]
    title = f"{st['model']} · {s['requests']} completed, {s['failed']} failed · {s['duration_s']:.1f} s"
    lat, tput = summary_tables(s, title, ["mean", *(f"p{p:g}" for p in percentiles)], st["slo"])
    console.print(lat)
    if s["failed"]:
        tput.add_row("[red]failed requests[/red]", f"{s['failed']:,}: {escape(_clip(s['failed_example']))}")
    console.print(tput)


def _clip(text: str, width: int = 120) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def register(app: typer.Typer, command_class=None) -> None:
    app.command("bench", cls=command_class)(bench)
