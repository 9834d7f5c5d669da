"""What-if sweeps and capacity search: ``bullet whatif``'s library.

A :class:`Sweep` names values for any of the axes in :data:`AXES` (policy, its knobs, SLOs, model, GPU,
tensor-parallel degree, trace); :meth:`Sweep.configs` expands their product into :class:`Config` points,
dropping a knob where the policy does not use it (``--prefill-sms`` means nothing to chunked prefill, so
chunked appears once). For each config and each replicate (a seed of synthetic arrivals, a window of the
trace) one :class:`Task`:

- simulates the trace rescaled to each rate of the optional rate grid (exact SLO attainment per rate);
- finds the **capacity**: the highest rate of the grid ``(1 + rel_tol) ** k`` req/s whose attainment is >=
  ``target`` (:func:`simulator.capacity.grid_capacity`: stepping out from a first rate, then bisecting the
  bracket). With attainment falling with rate the answer does not depend on where the search starts. With
  ``early_stop`` a simulation stops as soon as its verdict is certain (enough requests met their SLOs, or
  too many missed); the search takes the same steps as with full runs, and the attainment it records is
  then a bound, marked as such.

Tasks run in **units** (:func:`units`): the configs of one policy and replicate that differ only in the
policy's knobs or, for a policy that does not read its SLOs, in the SLOs. A unit runs its tasks in one
process, one after another; each search starts from the capacity of the closest config before it (a start at
the answer or one grid step off costs two runs), and configs that differ only in SLOs a policy ignores share
their simulations (:class:`Shared`: the same simulation, judged per SLO set). Neither changes an answer or a
verdict (tests/test_whatif.py compares each with the task searched alone). Tasks and units are deterministic,
so :func:`run_tasks` gives identical results serially, on a local process pool or on Ray. :func:`summarize` turns results into one row per config: capacity mean, spread
over replicates, output tokens/s at capacity and the cost per million output tokens.

Requests are built fresh for every simulation (simulate() may change the objects it is given).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .config import (
    POLICIES,
    SINGLE_LANE,
    SLO_PRESETS,
    CacheConfig,
    ConfigError,
    SchedulerConfig,
    SloConfig,
    resolve_gpu,
    resolve_model,
)
from .request import Request
from .traces import PROCESSES, TraceError, arrivals, load_trace, read_table


class SweepError(ValueError):
    """A sweep setting is invalid; the message names the flag, or the file, line and key."""


# ------------------------------------------------------------------------------------------------ spec

# Axes a sweep may vary: name -> (value type, the policies that use it; None: every policy).
AXES: dict[str, tuple[type, tuple[str, ...] | None]] = {
    "trace": (str, None),
    "model": (str, None),
    "tp": (int, None),
    "gpu": (str, None),
    "slo": (str, None),  # a named SLO set (bullet.config.SLO_PRESETS): sets the three below
    "slo_ttft": (float, None),  # ms
    "slo_tpot": (float, None),  # ms
    "slo_ttft_per_token": (float, None),  # ms per prompt token; overrides slo_ttft
    "policy": (str, None),
    "max_batched_tokens": (int, None),
    "prefill_sms": (int, ("static-split",)),
    "layers_per_step": (int, ("static-split", "naive-concurrent", "bullet")),
    "max_num_seqs": (int, None),
    "async_scheduling": (bool, SINGLE_LANE),
}

# Scalar settings of a sweep: name -> type.
SETTINGS: dict[str, type] = {
    "rates": float,  # a list: the rate grid
    "num_requests": int, "target": float, "rel_tol": float, "seeds": int, "seed": int, "windows": int,
    "arrival": str, "cv": float, "latency": str, "guess": float, "capacity": bool, "early_stop": bool,
    "gpu_hour_cost": float,
}

# The names users write (flags without dashes, file keys) -> the field they set.
KEYS: dict[str, str] = {
    "trace": "trace", "model": "model", "tensor_parallel_size": "tp", "tp": "tp", "gpu": "gpu",
    "slo": "slo", "slo_ttft": "slo_ttft", "slo_tpot": "slo_tpot", "slo_ttft_per_token": "slo_ttft_per_token",
    "policy": "policy", "max_num_batched_tokens": "max_batched_tokens",
    "max_batched_tokens": "max_batched_tokens",
    "prefill_sms": "prefill_sms", "layers_per_step": "layers_per_step", "max_num_seqs": "max_num_seqs",
    "async_scheduling": "async_scheduling",
    "request_rate": "rates", "num_prompts": "num_requests", "num_requests": "num_requests",
    "target_attainment": "target", "rel_tol": "rel_tol", "seeds": "seeds", "seed": "seed",
    "windows": "windows",
    "arrival": "arrival", "cv": "cv", "latency": "latency", "guess": "guess", "capacity": "capacity",
    "early_stop": "early_stop", "gpu_hour_cost": "gpu_hour_cost",
}
# How errors name a field: its primary flag.
FLAGS: dict[str, str] = {"tp": "--tensor-parallel-size", "max_batched_tokens": "--max-num-batched-tokens",
                         "rates": "--request-rate", "num_requests": "--num-prompts",
                         "target": "--target-attainment"}
ARRIVALS = ("trace", *PROCESSES)


def flag_of(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


@dataclass(frozen=True)
class Config:
    """One point of a sweep. SLOs in milliseconds; a knob the policy does not use is None."""

    trace: str = "sharegpt"
    model: str = "llama-3.1-8b"
    tp: int | None = None  # None: the model preset's
    gpu: str = "h200"
    slo: str | None = None  # a named SLO set; the three SLO fields hold its values
    slo_ttft: float | None = 1e3 * SloConfig().ttft if SloConfig().ttft else None
    slo_tpot: float | None = 1e3 * SloConfig().tpot if SloConfig().tpot else None
    slo_ttft_per_token: float | None = None
    policy: str = "chunked"
    max_batched_tokens: int = SchedulerConfig().max_batched_tokens
    prefill_sms: int | None = SchedulerConfig().prefill_sms
    layers_per_step: int | None = None
    max_num_seqs: int = SchedulerConfig().max_num_seqs
    async_scheduling: bool | None = None  # None: off (the default, and for policies without it)

    def normalized(self) -> Config:
        """Knobs the policy ignores set to None; a named SLO set's values filled in; the absolute TTFT
        dropped where a per-token one rules."""
        changes: dict[str, Any] = {}
        for name, (_, policies) in AXES.items():
            if policies is not None and self.policy not in policies:
                changes[name] = None
        ttft_per_token = self.slo_ttft_per_token
        if self.slo is not None:
            preset = SLO_PRESETS[self.slo]
            ttft_per_token = _ms(preset.ttft_per_token)
            changes.update(slo_ttft=_ms(preset.ttft), slo_tpot=_ms(preset.tpot),
                           slo_ttft_per_token=ttft_per_token)
        if ttft_per_token is not None:
            changes["slo_ttft"] = None
        return replace(self, **changes)

    def scheduler(self) -> SchedulerConfig:
        sms = SchedulerConfig().prefill_sms if self.prefill_sms is None else self.prefill_sms
        return SchedulerConfig(policy=self.policy, max_num_seqs=self.max_num_seqs,  # type: ignore[arg-type]
                               max_batched_tokens=self.max_batched_tokens, prefill_sms=sms,
                               layers_per_step=self.layers_per_step,
                               async_scheduling=bool(self.async_scheduling))

    def slo_config(self) -> SloConfig:
        def s(ms: float | None) -> float | None:
            return None if ms is None else ms / 1e3
        return SloConfig(ttft=s(self.slo_ttft), tpot=s(self.slo_tpot),
                         ttft_per_token=s(self.slo_ttft_per_token))

    def num_gpus(self) -> int:
        return resolve_model(self.model, self.tp).tp

    def label(self, axes: Iterable[str]) -> str:
        """The values of ``axes`` (those a sweep varies), e.g. 'chunked tokens=2048'."""
        parts = []
        for name in axes:
            value = getattr(self, name)
            if value is None:
                continue
            named = name in ("policy", "trace", "model", "gpu", "slo")
            parts.append(str(value) if named else f"{_SHORT[name]}={fmt_value(value)}")
        return " ".join(parts) or self.policy


_SHORT = {"tp": "tp", "slo_ttft": "ttft", "slo_tpot": "tpot", "slo_ttft_per_token": "ttft/tok",
          "max_batched_tokens": "tokens", "prefill_sms": "sms", "layers_per_step": "layers",
          "max_num_seqs": "seqs", "async_scheduling": "async"}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 9)


def fmt_value(value: Any) -> str:
    """A setting's value as the tables and labels show it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Sweep:
    """Values per axis (each a tuple; an axis left out keeps :class:`Config`'s default) and the search."""

    axes: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    rates: tuple[float, ...] = ()  # rate grid: exact attainment at each rate (req/s)
    num_requests: int = 1000  # requests per window
    target: float = 0.9  # SLO attainment that counts as sustained
    rel_tol: float = 0.02  # the capacity grid's step: rates (1 + rel_tol) ** k req/s
    seeds: int = 1  # replicates with synthetic arrivals: seeds seed, seed+1, ...
    seed: int = 0
    windows: int = 1  # replicates over consecutive windows of num_requests requests of the trace
    arrival: str = "trace"  # trace: its own timing rescaled (poisson if it has none); or a synthetic process
    cv: float = 1.0  # gamma arrivals' coefficient of variation
    latency: Any = "auto"  # latency_model() choice, or a LatencyModel object (library use)
    guess: float | None = None  # where the capacity search starts (req/s)
    capacity: bool = True
    early_stop: bool = True
    gpu_hour_cost: float | None = None  # per GPU per hour, any currency

    def values(self, name: str) -> tuple[Any, ...]:
        return dict(self.axes).get(name, (getattr(Config(), name),))

    def varying(self) -> list[str]:
        """Axes with more than one value after expansion (they label configs)."""
        configs = self.configs()
        named = "slo" in dict(self.axes)  # then the SLO set's name labels it, not its three values
        return [n for n in AXES if len({getattr(c, n) for c in configs}) > 1
                and not (named and n in ("slo_ttft", "slo_tpot", "slo_ttft_per_token"))]

    def configs(self) -> list[Config]:
        """The product of every axis's values, knobs a policy ignores dropped, duplicates removed (first
        occurrence order)."""
        seen: dict[Config, None] = {}
        for combo in itertools.product(*(self.values(n) for n in AXES)):
            seen.setdefault(Config(**dict(zip(AXES, combo))).normalized(), None)
        return list(seen)

    def tasks(self, timed: Callable[[str], bool] = lambda trace: True) -> list[Task]:
        """One task per config and replicate. ``timed(trace)`` says whether a trace has arrival times (seeds
        then vary nothing unless arrivals are synthetic)."""
        out = []
        for i, cfg in enumerate(self.configs()):
            synthetic = self.arrival != "trace" or not timed(cfg.trace)
            seeds = range(self.seed, self.seed + (self.seeds if synthetic else 1))
            for window in range(self.windows):
                for seed in seeds:
                    out.append(Task(i, cfg, seed, window, synthetic, self))
        return out


# --------------------------------------------------------------------------------------------- parsing

def parse_sweep(raw: dict[str, Any], where: Callable[[str], str] | None = None) -> Sweep:
    """Settings as users write them (flag names without dashes or file keys; values: a string such as
    'a,b,c' or 'START:STOP:STEP', a number, or a list) -> a validated :class:`Sweep`. ``where(key)`` names
    the key's place in error messages (default: the flag)."""
    where = where or (lambda key: flag_of(KEYS.get(key, key)))
    axes: dict[str, tuple[Any, ...]] = {}
    settings: dict[str, Any] = {}
    origin: dict[str, str] = {}  # field -> the key that set it
    for key, value in raw.items():
        norm = key.replace("-", "_").lower()
        if norm not in KEYS:
            raise SweepError(f"{where(key)}: unknown setting {key!r}; known: {', '.join(sorted(KEYS))}")
        name = KEYS[norm]
        if name in origin:
            raise SweepError(f"{where(key)}: {flag_of(name)} given twice")
        origin[name] = key
        try:
            if name in AXES:
                axes[name] = _parse_values(value, AXES[name][0], name)
            elif name == "rates":
                settings[name] = _parse_values(value, float, name)
            else:
                settings[name] = _parse_scalar(value, SETTINGS[name], name)
        except SweepError as e:
            raise SweepError(f"{where(key)}: {e}") from None
    def place(name: str) -> str:
        return where(origin[name]) if name in origin else flag_of(name)

    for name, values in axes.items():
        _check_axis(name, values, place(name))
    sweep = Sweep(axes=tuple((n, axes[n]) for n in AXES if n in axes), **settings)
    _check_settings(sweep, place)
    return sweep


def _parse_values(value: Any, kind: type, name: str) -> tuple[Any, ...]:
    if isinstance(value, str):
        text = value.strip()
        if kind is not str and text.count(":") == 2:
            return _parse_range(text, kind)
        items: list[Any] = [v.strip() for v in text.split(",")]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    if not items or any(v == "" for v in items):
        raise SweepError(f"empty value in {value!r}")
    out = tuple(_parse_scalar(v, kind, name) for v in items)
    if len(set(out)) != len(out):
        raise SweepError(f"repeated value in {value!r}")
    return out


def _parse_range(text: str, kind: type) -> tuple[Any, ...]:
    """'START:STOP:STEP', both ends included where STEP lands on STOP: '2:20:2' -> 2, 4, ..., 20."""
    try:
        start, stop, step = (float(p) for p in text.split(":"))
    except ValueError:
        raise SweepError(f"range {text!r} must be START:STOP:STEP with numbers") from None
    if not all(math.isfinite(v) for v in (start, stop, step)):
        raise SweepError(f"range {text!r} must have finite values")
    if kind is int and not all(v.is_integer() for v in (start, stop, step)):
        raise SweepError(f"range {text!r} must have integer values")
    if step <= 0:
        raise SweepError(f"range {text!r}: the step must be positive")
    if start > stop:
        raise SweepError(f"range {text!r}: the start ({start:g}) is above the stop ({stop:g})")
    count = math.floor((stop - start) / step * (1 + 1e-12)) + 1
    if count > 10_000:
        raise SweepError(f"range {text!r} has {count} values; at most 10,000")
    return tuple(kind(round(start + i * step, 9)) for i in range(count))


_NONE_OK = ("slo_ttft", "slo_tpot", "layers_per_step")  # settings where 'none' means no target / the default


def _parse_scalar(value: Any, kind: type, name: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise SweepError(f"expected on or off (true or false), got {value!r}")
    if kind is str:
        if not isinstance(value, str) or not value.strip():
            raise SweepError(f"expected a name, got {value!r}")
        return value.strip()
    if isinstance(value, str) and value.strip().lower() == "none" and name in _NONE_OK:
        return None
    if isinstance(value, bool):
        raise SweepError(f"expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SweepError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise SweepError(f"expected a finite number, got {value!r}")
    if kind is int:
        if not number.is_integer():
            raise SweepError(f"expected an integer, got {value!r}")
        return int(number)
    return number


def _check_axis(name: str, values: tuple[Any, ...], flag: str) -> None:
    for v in values:
        if name == "policy" and v not in POLICIES:
            raise SweepError(f"{flag}: unknown policy {v!r}; use one of {', '.join(POLICIES)}")
        if name == "slo" and v not in SLO_PRESETS:
            raise SweepError(f"{flag}: unknown SLO set {v!r}; use one of {', '.join(SLO_PRESETS)}")
        if AXES[name][0] in (int, float) and v is not None and v <= 0:
            raise SweepError(f"{flag}: values must be positive, got {fmt_value(v)}")
        try:
            if name == "gpu":
                resolve_gpu(v)
            elif name == "model":
                resolve_model(v)
        except ConfigError as e:
            raise SweepError(f"{flag}: {e}") from None


def _check_settings(s: Sweep, place: Callable[[str], str]) -> None:
    def bad(name: str, why: str) -> SweepError:
        return SweepError(f"{place(name)}: {why}")

    if any(r <= 0 for r in s.rates):
        raise bad("rates", "rates must be positive (requests per second)")
    for name in ("num_requests", "seeds", "windows"):
        if getattr(s, name) < 1:
            raise bad(name, "must be at least 1")
    if not 0 < s.target <= 1:
        raise bad("target", f"must be in (0, 1], got {s.target:g}")
    if not 0 < s.rel_tol < 1:
        raise bad("rel_tol", f"must be in (0, 1), got {s.rel_tol:g}")
    if s.arrival not in ARRIVALS:
        raise bad("arrival", f"unknown arrival process {s.arrival!r}; use one of {', '.join(ARRIVALS)}")
    if s.cv <= 0 or (s.cv != 1.0 and s.arrival != "gamma"):
        raise bad("cv", "must be positive, and applies to --arrival gamma only")
    for name in ("guess", "gpu_hour_cost"):
        value = getattr(s, name)
        if value is not None and value <= 0:
            raise bad(name, f"must be positive, got {value:g}")
    if not s.capacity and not s.rates:
        raise bad("capacity", "with no capacity search a --request-rate grid is needed")
    given = dict(s.axes)
    if "slo" in given and given.keys() & {"slo_ttft", "slo_tpot", "slo_ttft_per_token"}:
        raise bad("slo", "give either named SLO sets or --slo-ttft/--slo-tpot/--slo-ttft-per-token values")
    used = {p for p in s.values("policy")}
    for name, (_, policies) in AXES.items():
        if policies is not None and name in dict(s.axes) and not used & set(policies):
            raise bad(name, f"applies to {', '.join(policies)} only, and the sweep's policies are "
                            f"{', '.join(sorted(used))}")


def read_sweep_file(path: Path) -> tuple[dict[str, Any], Callable[[str], str]]:
    """A TOML (or YAML, with PyYAML) file of settings -> (raw settings, where(key) naming file and line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SweepError(f"{path}: cannot read: {e.strerror or e}") from None
    if Path(path).suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SweepError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write TOML") \
                from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f"{mark.line + 1}:" if mark is not None else ""
            raise SweepError(f"{path}:{line} not valid YAML ({getattr(e, 'problem', None) or e})") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SweepError(f"{path}: not valid TOML ({e})") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a table of settings (key = value lines)")
    for key, value in data.items():
        if isinstance(value, dict):
            raise SweepError(f"{_where_in(path, text, key)}: nested tables are not settings; write "
                             f"{key} = value at the top level")

    return data, lambda key: _where_in(path, text, key)


def _where_in(path: Path, text: str, key: str) -> str:
    m = re.search(rf"^[ \t]*[\"']?{re.escape(key)}[\"']?[ \t]*[=:]", text, re.MULTILINE)
    line = text.count("\n", 0, m.start()) + 1 if m else None
    return f"{path}:{line}: key {key!r}" if line else f"{path}: key {key!r}"


# ----------------------------------------------------------------------------------------------- tasks

@dataclass(frozen=True)
class Task:
    """Capacity search (and rate grid) of one config on one replicate."""

    index: int  # the config's position in Sweep.configs()
    config: Config
    seed: int
    window: int
    synthetic: bool  # arrivals drawn from sweep.arrival (poisson for a length-only trace under "trace")
    sweep: Sweep


@dataclass(frozen=True)
class Run:
    """One simulation. ``bound``: 'exact', or 'lower'/'upper' where an early stop left only a bound."""

    rate: float
    attainment: float
    bound: str
    kind: str  # 'grid' or 'search'
    goodput: float | None = None  # the rest only for exact runs
    output_throughput: float | None = None
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None


@dataclass(frozen=True)
class TaskResult:
    index: int
    seed: int
    window: int
    capacity: float | None  # None: no search asked for
    runs: tuple[Run, ...]
    mean_output_tokens: float
    error: str | None = None
    # the task's own wall and CPU seconds (in no table: not deterministic)
    wall_s: float = field(default=0.0, compare=False)
    cpu_s: float = field(default=0.0, compare=False)
    simulated: int = field(default=0, compare=False)  # runs it simulated (the others: its unit's, replayed)


class _Verdict(Exception):
    """Raised from on_finish once a run's pass/fail against the target is certain."""

    def __init__(self, bound: float, passed: bool) -> None:
        super().__init__(bound)
        self.bound, self.passed = bound, passed


def attained(req: Request, slo: SloConfig) -> bool:
    """bullet.metrics' definition for one finished request (same float operations): TTFT within its
    target and, past the first token, TPOT within the TPOT target; a rejected request attains nothing."""
    if req.error is not None:
        return False
    ttft = req.first_token_time - req.arrival  # type: ignore[operator]
    e2e = req.finish_time - req.arrival  # type: ignore[operator]
    if slo.ttft_per_token is not None:
        ttft_ok = ttft <= req.prompt_len * slo.ttft_per_token
    else:
        ttft_ok = slo.ttft is None or ttft <= slo.ttft
    out = req.num_output
    return ttft_ok and (out <= 1 or slo.tpot is None or (e2e - ttft) / max(out - 1, 1) <= slo.tpot)


class Judge:
    """on_finish hook: counts attaining and missing requests and raises :class:`_Verdict` once the final
    attainment is certainly >= target or certainly < target (the same comparison metrics make at the end).

    :meth:`watch` (given the scheduler and the requests it serves) also counts a miss before it finishes: a
    request with no first token, in no launch in flight, ``now - arrival`` past its TTFT target at the
    latest finish seen. Its first token can only come from a launch not yet started, at or after ``now``, and
    floating-point subtraction is monotone, so its TTFT (``first - arrival``) is past the target too: the
    same miss the finished request would count, found seconds earlier (failing runs near capacity stop at
    55-80 % of their span instead of 73-96 %)."""

    def __init__(self, total: int, slo: SloConfig, target: float) -> None:
        self.total, self.slo, self.target = total, slo, target
        self.good = self.bad = 0
        self.late: set[int] = set()  # counted as misses before they finished
        self.queue: list[tuple[float, Request]] = []  # (about when its TTFT target passes, request), by time
        self.waiting: list[Request] = []  # past that time but inside a launch then: looked at again
        self.busy: set[int] = set()

    def watch(self, scheduler: Any, requests: Sequence[Request]) -> None:
        """Follow ``requests`` (those the simulation serves) and ``scheduler.busy``."""
        if self.slo.ttft is not None or self.slo.ttft_per_token is not None:
            self.busy = scheduler.busy
            self.queue = sorted(((r.arrival + self._ttft(r), r) for r in requests), key=lambda x: x[0],
                                reverse=True)  # popped from the end: earliest first

    def _ttft(self, req: Request) -> float:
        slo = self.slo
        return req.prompt_len * slo.ttft_per_token if slo.ttft_per_token is not None else slo.ttft  # type: ignore[return-value]

    def __call__(self, req: Request) -> None:
        if req.id in self.late:
            return  # counted already
        if attained(req, self.slo):
            self.good += 1
            if self.good / self.total >= self.target:
                raise _Verdict(self.good / self.total, True)
        else:
            self._miss()
        if self.queue and req.finish_time is not None:
            self._overdue(req.finish_time)

    def _miss(self) -> None:
        self.bad += 1
        if (self.total - self.bad) / self.total < self.target:
            raise _Verdict((self.total - self.bad) / self.total, False)

    def _overdue(self, now: float) -> None:
        queue, again = self.queue, []
        candidates = self.waiting
        while queue and queue[-1][0] < now:
            candidates.append(queue.pop()[1])
        self.waiting = again
        for r in candidates:
            if r.finish_time is not None or r.first_token_time is not None or r.id in self.late:
                continue  # finished (counted then), or its TTFT is known and its finish will tell
            if r.id in self.busy or not now - r.arrival > self._ttft(r):
                again.append(r)  # inside a launch in flight (or at the edge by rounding): later
                continue
            self.late.add(r.id)
            self._miss()
class Window:
    """One replicate's requests: loaded once, rebuilt fresh for each rate."""

    def __init__(self, task: Task) -> None:
        s, cfg = task.sweep, task.config
        n = s.num_requests
        if task.synthetic:
            base = load_trace(cfg.trace, num_requests=n, start=task.window * n, rate=1.0,
                              arrival_process="constant")
        else:
            base = load_trace(cfg.trace, num_requests=n, start=task.window * n)
        self.base, self.task = base, task
        self.span = base[-1].arrival if base else 0.0
        if not task.synthetic and len(base) > 1 and self.span <= 0:
            raise TraceError("cannot rescale to a rate: every selected request arrives at the same time",
                             cfg.trace)

    def own_rate(self) -> float | None:
        """The window's mean rate, (n - 1) / span, when arrivals come from the trace."""
        return None if self.task.synthetic or self.span <= 0 else (len(self.base) - 1) / self.span

    def requests(self, rate: float) -> list[Request]:
        """Fresh requests at ``rate``: load_trace(..., rate=rate) without reading the file again."""
        s, n = self.task.sweep, len(self.base)
        if self.task.synthetic:
            process = "poisson" if s.arrival == "trace" else s.arrival
            times = arrivals(n, rate, process, s.cv, self.task.seed).tolist()  # type: ignore[arg-type]
        else:
            scale = (n - 1) / self.span / rate if n > 1 else 1.0
            times = [r.arrival * scale for r in self.base]
        return self._fresh(times)

    def at_once(self, count: int) -> list[Request]:
        """Fresh copies of the first ``count`` requests, all arriving at time 0."""
        return self._fresh([0.0] * min(count, len(self.base)))

    def _fresh(self, times: Sequence[float]) -> list[Request]:
        return [Request(r.id, t, r.prompt_len, r.max_new_tokens, prompt_ids=r.prompt_ids, hash_ids=r.hash_ids,
                        hash_block=r.hash_block) for r, t in zip(self.base, times)]


def run_task(task: Task, shared: Shared | None = None, hint: float | None = None) -> TaskResult:
    """Rate grid, then capacity search, of one config on one replicate. Errors come back as ``error``.
    ``shared``: simulations already run for tasks of the same unit (:func:`units`); ``hint``: where the
    capacity search starts (a neighbouring config's capacity; it changes the cost, not the answer)."""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        res = _Search(task, shared).run(hint)
    except (ConfigError, TraceError, RuntimeError, ValueError) as e:
        res = TaskResult(task.index, task.seed, task.window, None, (), 0.0, error=str(e))
    return replace(res, wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)


# Policies that plan with the SLOs (Scheduler.slo); every other policy's simulation does not depend on them.
PLANS_WITH_SLO = ("bullet",)


# Policy knobs: configs that differ only in these are neighbours whose capacities seed each other's search.
KNOBS = ("max_batched_tokens", "prefill_sms", "layers_per_step", "max_num_seqs", "async_scheduling")


def unit_key(task: Task) -> tuple:
    """Tasks with one key run in one process, one after another (:func:`run_unit`): same replicate and same
    config but for the policy's knobs and the SLOs. Those that differ only in the SLOs, for a policy outside
    :data:`PLANS_WITH_SLO` (which does not read them), simulate the same things and share the simulations;
    each search starts from a neighbour's capacity. (An SLO-aware policy's SLO sets are separate units.)"""
    cfg = replace(task.config, **{k: None for k in KNOBS})
    if cfg.policy not in PLANS_WITH_SLO:
        cfg = _without_slo(cfg)
    return cfg, task.seed, task.window, task.synthetic


def _without_slo(cfg: Config) -> Config:
    return replace(cfg, **dict.fromkeys(SLO_FIELDS))


def units(tasks: Sequence[Task]) -> list[list[int]]:
    """Task positions grouped by :func:`unit_key`, in order of first appearance: each group runs in one
    process, its searches sharing simulations (:class:`Shared`)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tasks):
        groups.setdefault(unit_key(t), []).append(i)
    return list(groups.values())


def run_unit(tasks: Sequence[Task]) -> list[TaskResult]:
    """:func:`run_task` of each task, one :class:`Shared` for all, each search starting from the capacity
    of the closest config before it (:func:`_nearest`): the results are those of separate runs."""
    shared = Shared()
    out: list[TaskResult] = []
    for t in tasks:
        out.append(run_task(t, shared, _nearest(t, tasks[:len(out)], out)))
    return out


SLO_FIELDS = ("slo", "slo_ttft", "slo_tpot", "slo_ttft_per_token")


def _nearest(task: Task, before: Sequence[Task], results: Sequence[TaskResult]) -> float | None:
    """The finite capacity of the config before ``task`` that differs from it in the fewest settings other
    than SLOs, then in the fewest SLOs (the latest of those), or None. (Same knobs first: for a policy that
    does not read its SLOs, that config's simulations are shared, so searching from its answer is free.)"""
    best, fewest = None, (math.inf, math.inf)
    for t, r in zip(before, results):
        if r.capacity is None or not 0 < r.capacity < math.inf:
            continue
        differ = [f.name for f in fields(Config) if getattr(t.config, f.name) != getattr(task.config, f.name)]
        slos = sum(name in SLO_FIELDS for name in differ)
        if (len(differ) - slos, slos) <= fewest:
            best, fewest = r.capacity, (len(differ) - slos, slos)
    return best


class Shared:
    """Simulations that tasks of one unit share. Each is kept as the requests it finished, in finishing order,
    as far as it ran (an early stop for one task's verdict ends it), keyed by what was simulated ('rate', r)
    or ('at once', n), after the config less its SLOs. Another task's verdict replays its judge over them: the same requests in the same order,
    so the same verdict and bound as its own run would give; where they do not settle it, it simulates anew
    (and keeps the longer record). A finished run's summary under another SLO comes from the same requests."""

    def __init__(self) -> None:
        self.window: Window | None = None
        self.records: dict[tuple, tuple[list[Request], bool]] = {}  # key -> (finished requests, complete)


PILOT_REQUESTS = 200  # requests of the pilot run whose throughput seeds the capacity search
BURST_FACTOR = 3  # a rate this far above the start still passing: check the whole window at once


class _Search:
    """One task's simulations. The capacity is the highest rate of a fixed geometric grid, ``(1 + rel_tol)
    ** k`` req/s, whose attainment meets the target, found by stepping from a first rate (1, 2, 4, ... grid
    steps) until the verdict flips and bisecting the bracket (:func:`simulator.capacity.grid_capacity`). With
    attainment falling with rate, where the search starts changes its cost, never its answer, so it starts
    from a neighbouring config's capacity where its unit has one (two runs when that is the answer or one step
    off), else from a pilot: the window's first requests all arriving at once, whose throughput (requests /
    makespan) estimates the capacity. A rate above a measured failure or below a measured success is decided
    without simulating."""

    def __init__(self, task: Task, shared: Shared | None = None) -> None:
        from simulator.run import latency_model

        cfg, s = task.config, task.sweep
        self.task, self.sweep = task, s
        self.shared = shared or Shared()
        if self.shared.window is None:
            self.shared.window = Window(task)
        self.window = self.shared.window
        self.model, self.gpu = resolve_model(cfg.model, cfg.tp), resolve_gpu(cfg.gpu)
        self.latency = (latency_model(s.latency, self.model, self.gpu) if isinstance(s.latency, str)
                        else s.latency)
        self.sched, self.slo = cfg.scheduler(), cfg.slo_config()
        # what the simulations depend on: the config, less the SLOs where the policy does not read them
        self.simulated = cfg if cfg.policy in PLANS_WITH_SLO else _without_slo(cfg)
        self.runs: list[Run] = []
        self.known: dict[float, float] = {}  # simulated rate -> attainment (exact, or a bound on its side)
        self.start = math.inf  # where the search started (set by capacity())
        self.simulations = 0  # simulated here (not replayed from the unit's)

    def simulate(self, key: tuple, make: Callable[[], list[Request]], judged: bool = False) -> dict:
        """The summary of simulating ``make()`` (or of the shared record of ``key``); ``judged``: stop, raising
        :class:`_Verdict`, once the verdict against the target is certain."""
        from simulator.run import simulate

        count = len(self.window.base) if key[0] == "rate" else min(key[1], len(self.window.base))
        judge = Judge(count, self.slo, self.sweep.target) if judged else None
        key = (self.simulated, *key)
        record = self.shared.records.get(key)
        if record is not None:
            if judge is not None:
                for req in record[0]:
                    judge(req)
            if record[1]:
                from bullet.metrics import summarize

                return summarize(record[0], self.slo)
            judge = Judge(count, self.slo, self.sweep.target) if judged else None
        finished: list[Request] = []
        self.simulations += 1

        def on_finish(req: Request) -> None:
            finished.append(req)
            if judge is not None:
                judge(req)

        # Misses found before requests finish (Judge.watch) stop failing runs sooner, but a record of such a
        # run replayed through another SLO's judge would not see them: only where nothing is shared.
        watch = judge.watch if judge is not None and self.task.config.policy in PLANS_WITH_SLO else None
        try:
            summary = simulate(make(), self.model, self.gpu, self.sched, CacheConfig(), self.slo, self.latency,
                               on_finish=on_finish, watch=watch, timeline=False).summary
        except _Verdict:
            if watch is None and (record is None or len(finished) > len(record[0])):
                self.shared.records[key] = (finished, False)
            raise
        self.shared.records[key] = (finished, True)
        return summary

    def measure(self, rate: float, kind: str) -> float:
        early = kind == "search" and self.sweep.early_stop
        try:
            summary = self.simulate(("rate", rate), lambda: self.window.requests(rate), early)
        except _Verdict as v:
            self.runs.append(Run(rate, v.bound, "lower" if v.passed else "upper", kind))
            self.known[rate] = v.bound
            return v.bound
        self.runs.append(_exact_run(rate, kind, summary))
        self.known[rate] = summary["slo_attainment"]
        return summary["slo_attainment"]

    def attainment(self, rate: float) -> float:
        """Measured, or implied by monotonicity: a success at a higher rate, a failure at a lower one."""
        if rate in self.known:
            return self.known[rate]
        if rate >= BURST_FACTOR * self.start and math.inf not in self.known:
            self.burst()  # passing far above where the search started: is the capacity unbounded?
        target = self.sweep.target
        passes = [a for r, a in self.known.items() if r > rate and a >= target]
        fails = [a for r, a in self.known.items() if r < rate and a < target]
        if passes and not fails:
            return min(passes)
        if fails and not passes:
            return max(fails)
        return self.measure(rate, "search")

    def pilot(self) -> float | None:
        """Requests per second of makespan when the window's first requests all arrive at time 0. When
        that is the whole window, its attainment is also the attainment at an infinite rate."""
        n = min(PILOT_REQUESTS, len(self.window.base))
        summary = self.simulate(("at once", n), lambda: self.window.at_once(n))
        self.runs.append(_exact_run(math.inf, "pilot", summary))
        if n == len(self.window.base):
            self.known[math.inf] = summary["slo_attainment"]
        return n / summary["duration_s"] if summary["duration_s"] > 0 else None

    def burst(self) -> None:
        """The whole window arriving at once: if even that meets the target, so does every rate."""
        n = len(self.window.base)
        try:
            summary = self.simulate(("at once", n), lambda: self.window.at_once(n), True)
        except _Verdict as v:
            self.runs.append(Run(math.inf, v.bound, "lower" if v.passed else "upper", "burst"))
            self.known[math.inf] = v.bound
            return
        self.runs.append(_exact_run(math.inf, "burst", summary))
        self.known[math.inf] = summary["slo_attainment"]

    def first_rate(self, hint: float | None) -> float:
        """Where the search starts: --guess; else ``hint`` (a neighbouring config's capacity); else the highest
        rate of the --request-rate grid that met the target (the lowest if none did); else the pilot's
        estimate. Only the cost depends on it, not the answer."""
        s = self.sweep
        if s.guess is not None:
            return s.guess
        if hint is not None:
            return hint
        if self.known:
            passing = [r for r, a in self.known.items() if a >= s.target]
            return max(passing) if passing else min(self.known)
        return self.pilot() or self.window.own_rate() or 1.0

    def capacity(self, hint: float | None) -> float:
        """The highest rate of the grid ``(1 + rel_tol) ** k`` whose attainment meets the target
        (:func:`simulator.capacity.grid_capacity`); inf when every request at once meets it, 0.0 when not
        even 1/1024 of the starting rate does."""
        from simulator.capacity import grid_capacity, grid_index, grid_rate

        s = self.sweep
        self.start = self.first_rate(hint)
        k0 = grid_index(self.start, s.rel_tol)

        def ok(k: int) -> bool:
            if self.known.get(math.inf, -1.0) >= s.target:
                raise _Unbounded
            return self.attainment(grid_rate(k, s.rel_tol)) >= s.target

        try:
            k = grid_capacity(ok, k0, k0 - math.ceil(math.log(1024) / math.log1p(s.rel_tol)))
        except _Unbounded:
            return math.inf
        if self.known.get(math.inf, -1.0) >= s.target:
            return math.inf  # every request at once meets the target: no rate is too high
        return 0.0 if k is None else grid_rate(k, s.rel_tol)

    def run(self, hint: float | None = None) -> TaskResult:
        s, task = self.sweep, self.task
        for rate in s.rates:
            self.measure(rate, "grid")
        cap = self.capacity(hint) if s.capacity else None
        mean_out = statistics.fmean(r.max_new_tokens for r in self.window.base)
        return TaskResult(task.index, task.seed, task.window, cap, tuple(self.runs), mean_out,
                          simulated=self.simulations)


class _Unbounded(Exception):
    """Every request arriving at once meets the target: the capacity search is over."""


def _exact_run(rate: float, kind: str, summary: dict) -> Run:
    return Run(rate, summary["slo_attainment"], "exact", kind, summary["goodput"],
               summary["output_throughput"], summary["ttft_ms"]["p90"], summary["tpot_ms"]["p90"])


def run_tasks(tasks: Sequence[Task], jobs: int = 1, ray_address: str | None = None,
              on_done: Callable[[TaskResult], None] | None = None) -> list[TaskResult]:
    """Every task's result, in task order: serially (jobs 1), on a local process pool, or as Ray tasks."""
    results: list[TaskResult | None] = [None] * len(tasks)

    def done(i: int, res: TaskResult) -> None:
        results[i] = res
        if on_done is not None:
            on_done(res)

    groups = units(tasks)

    def unit_done(group: list[int], res: list[TaskResult]) -> None:
        for i, r in zip(group, res):
            done(i, r)

    if ray_address is not None:
        _run_ray([[tasks[i] for i in g] for g in groups], ray_address, lambda k, res: unit_done(groups[k], res))
    elif jobs <= 1 or len(groups) <= 1:
        for g in groups:
            unit_done(g, run_unit([tasks[i] for i in g]))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn: the parent may hold threads (a progress bar, torch) that a fork would copy mid-lock
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(groups)), mp_context=spawn) as pool:
            futures = {pool.submit(run_unit, [tasks[i] for i in g]): k for k, g in enumerate(groups)}
            for f in as_completed(futures):
                unit_done(groups[futures[f]], f.result())
    return results  # type: ignore[return-value]


def _run_ray(groups: Sequence[Sequence[Task]], address: str, done: Callable[[int, list[TaskResult]], None]) -> None:
    """The same units (:func:`run_unit`) as Ray tasks (not actors). ``address``: 'auto' (a running cluster), 'local' (start a
    local runtime) or HOST:PORT / ray://HOST:PORT. Workers must be able to import bullet."""
    import ray

    started = not ray.is_initialized()
    if started:
        root = str(Path(__file__).resolve().parents[1])  # a local runtime's workers find bullet like we do
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        remote = ray.remote(num_cpus=1)(run_unit)
        refs = {remote.remote(list(g)): k for k, g in enumerate(groups)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                done(refs[ref], ray.get(ref))
    finally:
        if started:
            ray.shutdown()


# --------------------------------------------------------------------------------------------- results

@dataclass(frozen=True)
class Row:
    """One config's result over its replicates."""

    config: Config
    label: str
    capacities: tuple[float, ...]
    mean: float | None
    sd: float | None  # sample standard deviation over replicates (None with one)
    low: float | None
    high: float | None
    output_tok_s: float | None  # at the mean capacity: capacity x mean output tokens per request
    cost_per_m_tokens: float | None
    simulations: int
    grid: dict[float, float] = field(default_factory=dict)  # rate -> mean exact attainment over replicates
    error: str | None = None


def summarize(sweep: Sweep, results: Sequence[TaskResult]) -> list[Row]:
    configs = sweep.configs()
    varying = sweep.varying()
    by_config: dict[int, list[TaskResult]] = {}
    for r in results:
        by_config.setdefault(r.index, []).append(r)
    rows = []
    for i, cfg in enumerate(configs):
        mine = sorted(by_config.get(i, []), key=lambda r: (r.window, r.seed))
        label = cfg.label(varying)
        errors = [r.error for r in mine if r.error]
        sims = sum(len(r.runs) for r in mine)
        grid: dict[float, list[float]] = {}
        for r in mine:
            for run in r.runs:
                if run.kind == "grid":
                    grid.setdefault(run.rate, []).append(run.attainment)
        grid_mean = {rate: statistics.fmean(v) for rate, v in sorted(grid.items())}
        if errors:
            rows.append(Row(cfg, label, (), None, None, None, None, None, None, sims, grid_mean, errors[0]))
            continue
        caps = tuple(r.capacity for r in mine if r.capacity is not None)
        if not caps:
            rows.append(Row(cfg, label, (), None, None, None, None, None, None, sims, grid_mean))
            continue
        mean = statistics.fmean(caps)
        sd = statistics.stdev(caps) if len(caps) > 1 and math.isfinite(mean) else None
        tok_s = statistics.fmean(r.capacity * r.mean_output_tokens for r in mine)  # type: ignore[operator]
        cost = None
        if sweep.gpu_hour_cost is not None and 0 < tok_s < math.inf:
            cost = sweep.gpu_hour_cost * cfg.num_gpus() / (tok_s * 3600) * 1e6
        rows.append(Row(cfg, label, caps, mean, sd, min(caps), max(caps), tok_s, cost, sims, grid_mean))
    return rows


def replicates_note(sweep: Sweep, rows: Sequence[Row]) -> str:
    """How sure the capacities are: the replicates behind each and the search's resolution."""
    n = max((len(r.capacities) for r in rows), default=0)
    what = []
    if sweep.windows > 1:
        what.append(f"{sweep.windows} trace windows of {sweep.num_requests} requests")
    if n > sweep.windows:
        what.append(f"{n // sweep.windows} arrival seeds")
    spread = (f"mean ± sample sd and [min, max] over {' x '.join(what)}" if n > 1 else
              "one replicate: no sampling spread measured (--windows K or --seeds N for one)")
    return (f"capacity = highest rate with SLO attainment >= {100 * sweep.target:g} %, on a grid of "
            f"{100 * sweep.rel_tol:g} % steps (the true crossing lies in [capacity, capacity x "
            f"{1 + sweep.rel_tol:g}]); "
            f"{spread}")


CSV_FIELDS = ("capacity_req_s", "capacity_sd", "capacity_min", "capacity_max", "replicates",
              "output_tok_s_at_capacity", "cost_per_m_output_tokens", "simulations", "error")


def rows_table(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Rows as flat records (every axis, then the results): what the CSV and Parquet files hold."""
    out = []
    for r in rows:
        rec: dict[str, Any] = {name: getattr(r.config, name) for name in AXES}
        rec.update(zip(CSV_FIELDS, (r.mean, r.sd, r.low, r.high, len(r.capacities), r.output_tok_s,
                                    r.cost_per_m_tokens, r.simulations, r.error)))
        out.append(rec)
    return out


def runs_table(sweep: Sweep, results: Sequence[TaskResult]) -> list[dict[str, Any]]:
    """Every simulation: its config's axes, the replicate, the rate and what was measured."""
    configs = sweep.configs()
    out = []
    for res in sorted(results, key=lambda r: (r.index, r.window, r.seed)):
        for run in res.runs:
            rec: dict[str, Any] = {name: getattr(configs[res.index], name) for name in AXES}
            rec.update(window=res.window, seed=res.seed, **asdict(run))
            out.append(rec)
    return out


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def csv_text(records: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if records:
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(records[0])
        for rec in records:
            w.writerow([_cell(v) for v in rec.values()])
    return buf.getvalue()


# --------------------------------------------------------------------------------------------- writing

def check_out_dir(out: Path) -> None:
    """Fail before any work if ``out`` cannot become a folder we can write (nothing is created here)."""
    if out.exists():
        if not out.is_dir():
            raise SweepError(f"--out {out}: exists and is not a folder")
        if not os.access(out, os.W_OK | os.X_OK):
            raise SweepError(f"--out {out}: folder is not writable")
        return
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise SweepError(f"--out {out}: cannot create it ({parent} is not a writable folder)")


def write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` into a temporary file beside ``path``, then rename it into place (mode 0644 less
    the umask, like any file the user writes); the temporary file is removed on failure."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_outputs(out: Path, sweep: Sweep, rows: Sequence[Row], results: Sequence[TaskResult],
                  parquet: bool, plot: bool) -> list[str]:
    """capacity.csv and runs.csv (and .parquet, and PNG plots) under ``out``; returns the file names."""
    out.mkdir(parents=True, exist_ok=True)
    tables = {"capacity": rows_table(rows), "runs": runs_table(sweep, results)}
    written = []
    for name, records in tables.items():
        text = csv_text(records)
        write_atomic(out / f"{name}.csv", lambda p, t=text: Path(p).write_text(t))
        written.append(f"{name}.csv")
        if parquet and records:
            import pandas as pd

            frame = pd.DataFrame(records)
            write_atomic(out / f"{name}.parquet", lambda p, f=frame: f.to_parquet(p, index=False))
            written.append(f"{name}.parquet")
    if plot:
        written += plot_results(out, sweep, rows)
    return written


def plot_results(out: Path, sweep: Sweep, rows: Sequence[Row]) -> list[str]:
    """attainment.png (attainment vs rate, one panel per policy; needs a rate grid), capacity.png (capacity
    per config, spread as error bars), cost.png (cost per million output tokens, with --gpu-hour-cost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        write_atomic(out / name, lambda p: fig.savefig(p, dpi=110, format="png"))
        plt.close(fig)
        made.append(name)

    policies = list(dict.fromkeys(r.config.policy for r in rows))
    if any(r.grid for r in rows):
        fig, axes = plt.subplots(len(policies), 1, figsize=(8, 3.0 * len(policies)), squeeze=False,
                                 sharex=True)
        for ax, policy in zip(axes[:, 0], policies):
            for r in rows:
                if r.config.policy != policy or not r.grid:
                    continue
                line, = ax.plot(list(r.grid), list(r.grid.values()), marker=".", label=r.label)
                if r.mean is not None and math.isfinite(r.mean):
                    ax.plot([r.mean], [sweep.target], marker="x", color=line.get_color(), ms=8)
            ax.axhline(sweep.target, color="grey", lw=0.8, ls="--")
            ax.set_title(f"{policy}: SLO attainment vs request rate (x: capacity)", fontsize=10)
            ax.set_ylabel("SLO attainment")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[-1, 0].set_xlabel("request rate (req/s)")
        save(fig, "attainment.png")
    shown = [r for r in rows if r.mean is not None and math.isfinite(r.mean)]
    if shown:
        spread = any(r.sd is not None for r in shown)
        err = [[r.mean - r.low for r in shown], [r.high - r.mean for r in shown]] if spread else None
        fig = _bars(plt, shown, [r.mean for r in shown], policies, err)
        fig.axes[0].set_xlabel(f"capacity (req/s at {100 * sweep.target:g} % SLO attainment)"
                               + ("; bars: [min, max] over replicates" if spread else ""))
        save(fig, "capacity.png")
    priced = [r for r in shown if r.cost_per_m_tokens is not None]
    if priced:
        fig = _bars(plt, priced, [r.cost_per_m_tokens for r in priced], policies, None)
        fig.axes[0].set_xlabel(f"cost per million output tokens at capacity ({sweep.gpu_hour_cost:g} per "
                               "GPU-hour)")
        save(fig, "cost.png")
    return made


def _bars(plt, rows: Sequence[Row], values: list, policies: list[str], err):
    """A horizontal bar per config, coloured by policy, in sweep order from the top."""
    fig, ax = plt.subplots(figsize=(8, 1.3 + 0.28 * len(rows)))
    ys = list(range(len(rows)))
    ax.barh(ys, values, xerr=err, capsize=3, color=[f"C{policies.index(r.config.policy) % 10}" for r in rows])
    ax.set_yticks(ys, [r.label for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    return fig


def settings_of(sweep: Sweep) -> dict[str, Any]:
    """The sweep as a flat dict (for a summary or a log)."""
    out = {f.name: getattr(sweep, f.name) for f in fields(sweep) if f.name != "axes"}
    out["axes"] = {name: list(values) for name, values in sweep.axes}
    if not isinstance(out["latency"], str):
        out["latency"] = type(out["latency"]).__name__
    return out


def timed_traces(sweep: Sweep) -> dict[str, bool]:
    """Read each trace once: whether it has arrival times, and that it holds windows x num_requests rows
    (a TraceError naming the file otherwise). Seeds that could vary nothing (every trace timed, arrivals
    its own) are a SweepError."""
    out = {}
    for trace in sweep.values("trace"):
        table = read_table(trace)
        need = sweep.windows * sweep.num_requests
        if len(table.prompt_lens) < need:
            raise TraceError(f"has {len(table.prompt_lens)} requests; {sweep.windows} window(s) of "
                             f"{sweep.num_requests} need {need}", table.path)
        out[trace] = table.arrivals is not None
    if sweep.seeds > 1 and sweep.arrival == "trace" and all(out.values()):
        raise SweepError("--seeds: the traces have their own arrival times, so seeds would vary nothing; use "
                         "--windows K, or synthetic arrivals (--arrival poisson, gamma or constant)")
    return out


def check_configs(sweep: Sweep) -> None:
    """Build every config's scheduler once (no simulation), so a bad combination fails before any work:
    a model that does not fit the GPU, a prefill size not on the GPU's menu, more layers per step than the
    model has. Raises SweepError naming the config."""
    from .kvcache import BlockManager
    from .perfmodel.roofline import RooflineModel
    from .policies import make_scheduler

    varying = sweep.varying()
    for cfg in sweep.configs():
        try:
            model, gpu = resolve_model(cfg.model, cfg.tp), resolve_gpu(cfg.gpu)
            if cfg.layers_per_step is not None and cfg.layers_per_step > model.num_layers:
                raise ConfigError(f"--layers-per-step {cfg.layers_per_step} is more than {model.name}'s "
                                  f"{model.num_layers} layers")
            blocks = CacheConfig().blocks_for(model, gpu)
            make_scheduler(cfg.scheduler(), model, gpu, BlockManager(min(blocks, 64), 16),
                           RooflineModel(model, gpu), slo=cfg.slo_config())
        except ConfigError as e:
            raise SweepError(f"config {cfg.label(varying) or cfg.policy}: {e}") from None
