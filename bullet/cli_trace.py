"""``bullet trace``: summarise a trace file, or generate a synthetic one."""

from __future__ import annotations

import json
import math
import re
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from .traces import TraceError, TraceStats, read_table, save_trace, synthesize, trace_stats


class SummaryGroup(TyperGroup):
    """A command group whose list shows each command's first paragraph as one paragraph: typer's rich layout
    keeps a docstring's line breaks, which then break lines mid-sentence at 80 columns."""

    def format_help(self, ctx, formatter) -> None:
        for command in self.commands.values():
            if command.short_help is None and command.help:
                command.short_help = " ".join(command.help.split("\n\n")[0].split())
        super().format_help(ctx, formatter)


trace_app = typer.Typer(
    cls=SummaryGroup,
    help="Inspect and generate request traces (Azure 2023, Vidur, Mooncake JSONL, length-only CSV).",
    no_args_is_help=True,
)


class FormatChoice(str, Enum):
    azure = "azure"
    vidur = "vidur"
    mooncake = "mooncake"
    lengths = "lengths"


class ArrivalChoice(str, Enum):
    poisson = "poisson"
    gamma = "gamma"
    constant = "constant"


def parse_sizes(text: str | None) -> tuple[int, ...] | None:
    """``--decode-sizes``: comma-separated SM counts (None: not given). ConfigError on anything else."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        from .config import ConfigError

        raise ConfigError(f"--decode-sizes must be comma-separated integers, got {text!r}") from None


def fail(message: str) -> typer.Exit:
    """Print ``message`` as one red line on stderr (config field names shown as the flags that set them);
    ``raise fail(...)`` exits with code 2 and no traceback. Shared by every ``bullet`` command."""
    message = re.sub(r"\b(?:SchedulerConfig|CacheConfig)\.(\w+)",
                     lambda m: "--" + m.group(1).replace("_", "-"), message)
    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _stats_table(s: TraceStats) -> Table:
    table = Table()
    table.add_column("")
    for col in ("count", "span s", "rate req/s", "inter-arrival CV", "prefix hit rate, infinite cache"):
        table.add_column(col, justify="right")
    table.add_row("requests", f"{s['count']:,}", _fmt(s["span_s"], 1), _fmt(s["rate"], 3),
                  _fmt(s["interarrival_cv"], 3), _percent(s["prefix_hit_rate_ideal"]))
    lengths = Table(title="tokens per request", title_justify="left")
    lengths.add_column("")
    for col in ("mean", "p50", "p90", "p99", "max"):
        lengths.add_column(col, justify="right")
    for key, label in (("input", "input"), ("output", "output")):
        lengths.add_row(label, *(_fmt(s[f"{key}_{q}"], 1) for q in ("mean", "p50", "p90", "p99")),  # type: ignore[literal-required]
                        f"{s[f'{key}_max']:,}")  # type: ignore[literal-required]
    outer = Table.grid()
    outer.add_row(table)
    outer.add_row(lengths)
    return outer


@trace_app.command()
def stats(
    file: Annotated[str, typer.Argument(help="Trace file, or a built-in name (sharegpt, azure-code, "
                                             "azure-conv, arxiv).")],
    format: Annotated[FormatChoice | None, typer.Option(
        "--format", help="Trace format; detected from the first line when omitted.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the statistics as one JSON object.")] = False,
    hash_block_size: Annotated[int, typer.Option(
        "--hash-block-size", min=1, help="Tokens per hash id in the trace's hash_ids (Mooncake: 512).")] = 512,
    block_size: Annotated[int, typer.Option(
        "--block-size", min=1, help="KV cache block size in tokens; the ideal prefix hit rate counts whole blocks.")] = 16,
) -> None:
    """Summarise a trace: count, span, rate, inter-arrival CV, input/output length percentiles, and for a trace
    with prompt hashes (hash_ids) the share of prompt tokens an infinite prefix cache would serve.

    Length-only traces have no arrival times, so span, rate and CV show as '-' (null in JSON); traces without
    hashes show the hit rate as '-' (null)."""
    try:
        table = read_table(file, format.value if format else None, hash_block_size=hash_block_size)
        s = trace_stats(table, block_size=block_size)
    except TraceError as e:
        raise fail(str(e)) from None
    if as_json:
        typer.echo(json.dumps({"file": table.path, "format": table.format, **s}))
        return
    console = Console(highlight=False)
    console.print(f"{escape(table.path)} ({table.format} format)", soft_wrap=True)
    console.print(_stats_table(s))


@trace_app.command()
def generate(
    out: Annotated[Path, typer.Argument(help="Output CSV (Vidur format: arrived_at,num_prefill_tokens,"
                                             "num_decode_tokens); replaced if it exists.")],
    rate: Annotated[float, typer.Option("--rate", help="Mean arrival rate in requests per second.")],
    num_requests: Annotated[int, typer.Option("--num-requests", "-n", help="Number of requests.")] = 1000,
    arrival: Annotated[ArrivalChoice, typer.Option(
        "--arrival", help="Arrival process: poisson (exponential gaps), gamma (gaps with CV --cv), "
                          "constant (evenly spaced).")] = ArrivalChoice.poisson,
    cv: Annotated[float, typer.Option(
        "--cv", help="Coefficient of variation of inter-arrival times (gamma only; >1 is bursty).")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Random seed for arrivals and lengths.")] = 0,
    input_mean: Annotated[float | None, typer.Option(
        "--input-mean", help="Mean prompt length in tokens (lognormal; default 1024).")] = None,
    input_cv: Annotated[float | None, typer.Option(
        "--input-cv", help="Coefficient of variation of prompt lengths; 0 = all equal (default 1.0).")] = None,
    output_mean: Annotated[float | None, typer.Option(
        "--output-mean", help="Mean output length in tokens (lognormal; default 256).")] = None,
    output_cv: Annotated[float | None, typer.Option(
        "--output-cv", help="Coefficient of variation of output lengths; 0 = all equal (default 1.0).")] = None,
    lengths_from: Annotated[str | None, typer.Option(
        "--lengths-from", help="Sample (prompt, output) pairs with replacement from this trace file or "
                               "built-in name instead of drawing lognormal lengths.")] = None,
    max_total: Annotated[int | None, typer.Option(
        "--max-total", help="Cap on prompt + output tokens per request (longer pairs are redrawn).")] = None,
) -> None:
    """Write a synthetic trace (Poisson, gamma or constant arrivals; lognormal or sampled lengths)."""
    lognormal = {"input_mean": input_mean, "input_cv": input_cv, "output_mean": output_mean,
                 "output_cv": output_cv}
    given = [k for k, v in lognormal.items() if v is not None]
    if lengths_from is not None and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise fail(f"--lengths-from takes lengths from a file; it cannot be combined with {flags}")
    try:
        requests = synthesize(num_requests, rate, arrival_process=arrival.value, cv=cv, seed=seed,
                              max_total=max_total, lengths_from=lengths_from,
                              **{k: v for k, v in lognormal.items() if v is not None})
        save_trace(requests, out)
    except TraceError as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise fail(f"{out}: cannot write: {e.strerror or e}") from None
    s = trace_stats(requests)
    Console(highlight=False).print(
        f"wrote {s['count']:,} requests to {escape(str(out))}: span {_fmt(s['span_s'], 1)} s, "
        f"rate {_fmt(s['rate'], 3)} req/s, input mean {s['input_mean']:.0f}, output mean "
        f"{s['output_mean']:.0f} tokens")


def parse_host_gap(text: str) -> tuple[float, float] | None:
    """``--host-gap``: None for 'auto' (the latency model's), (0, 0) for 'off', else 'A,B' in ms as seconds."""
    t = text.strip().lower()
    if t == "auto":
        return None
    if t == "off":
        return (0.0, 0.0)
    try:
        vals = [float(x) for x in t.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 2 or not all(math.isfinite(v) and v >= 0 for v in vals):
        raise fail(f"--host-gap {text!r}: give 'auto', 'off' or 'A,B' (milliseconds, each >= 0: A per launch "
                   "plus B per request)")
    return vals[0] / 1e3, vals[1] / 1e3
