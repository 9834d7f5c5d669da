"""`bullet whatif`: sweep expansion, capacity search against hand-computed knees, early stops that change
no decision, identical results serially / in parallel / on Ray, outputs, and one-line errors."""

from __future__ import annotations

import csv
import os
import statistics
import sys

import pytest
from typer.testing import CliRunner

from bullet.cli import app
from bullet.cli_whatif import load_sweep
from bullet.config import CacheConfig, resolve_gpu, resolve_model
from bullet.metrics import request_columns
from bullet.traces import load_trace
from bullet.whatif import (
    Judge,
    Sweep,
    SweepError,
    Window,
    _Search,
    _Verdict,
    attained,
    csv_text,
    parse_sweep,
    rows_table,
    run_task,
    run_tasks,
    runs_table,
    summarize,
    units,
)
from simulator.capacity import grid_capacity, grid_index, grid_rate
from simulator.run import simulate
from tests.latency import LinearLatency

runner = CliRunner()
MODEL = resolve_model("llama-3.1-8b")
BASE, PER_TOKEN, PROMPT = 2e-3, 1e-5, 1000
SERVICE = BASE + PER_TOKEN * PROMPT  # one 1000-token prompt per step on the whole GPU: 12 ms


def lengths_trace(path, rows: int, prompt: int = PROMPT, output: int = 1):
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + f"{prompt},{output}\n" * rows)
    return str(path)


def constructed(tmp_path, rows=60, **kw) -> Sweep:
    """Prompts of 1000 tokens, one output token, constant arrivals, chunked prefill with a 1000-token budget:
    one prompt per step of exactly SERVICE seconds (LinearLatency, no KV term). Below 1/SERVICE req/s every
    TTFT is SERVICE; above it the queue grows and request i waits i * (SERVICE - 1/rate) more. With the TTFT
    SLO at SERVICE (plus 1e-6 for rounding), attainment falls from 1 to ~0 at the knee 1/SERVICE."""
    trace = lengths_trace(tmp_path / "const.csv", rows)
    return Sweep(axes=(("trace", (trace,)), ("policy", ("chunked",)), ("max_batched_tokens", (PROMPT,)),
                       ("slo_ttft", (1e3 * SERVICE * (1 + 1e-6),)), ("slo_tpot", (None,))),
                 arrival="constant", num_requests=60,
                 latency=LinearLatency(MODEL.num_layers, per_kv=0.0, base=BASE, per_token=PER_TOKEN), **kw)


# ------------------------------------------------------------------------------------- capacity search

@pytest.mark.parametrize("guess", [None, 5.0, 900.0])
def test_capacity_of_constructed_case_is_the_knee(tmp_path, guess):
    knee = 1 / SERVICE  # 83.33 req/s
    sweep = constructed(tmp_path, guess=guess, rel_tol=0.02)
    (res,) = run_tasks(sweep.tasks())
    assert res.error is None
    # bisection's answer is the low end of its last bracket: the knee lies within one step above it
    assert knee / (1 + 0.02) <= res.capacity <= knee
    for run in res.runs:  # every measured verdict is on the right side of the knee
        if run.kind == "search":
            assert (run.attainment >= 0.9) == (run.rate <= knee)


def test_capacity_does_not_depend_on_where_the_search_starts(tmp_path):
    """The grid answer is the same from a cold start (pilot), from below, from above and from the answer
    itself; starting at the answer costs two search runs."""
    caps = {}
    for guess in (None, 5.0, 80.0, 900.0):
        (res,) = run_tasks(constructed(tmp_path, guess=guess).tasks())
        caps[guess] = res.capacity
    assert len(set(caps.values())) == 1
    (res,) = run_tasks(constructed(tmp_path, guess=caps[None]).tasks())
    assert res.capacity == caps[None] and [r.kind for r in res.runs] == ["search", "search"]


def test_grid_search_by_hand():
    """ok(k) holds up to k = 37: every start finds 37; a start at 37 or 38 asks twice; nothing passing
    above the floor gives None."""
    def search(start: int) -> tuple[int | None, list[int]]:
        asked: list[int] = []
        return grid_capacity(lambda k: asked.append(k) or k <= 37, start, -400), asked

    for start in range(-60, 300, 7):
        found, asked = search(start)
        assert found == 37 and len(asked) == len(set(asked))  # never the same point twice
    for start in (37, 38):
        assert sorted(search(start)[1]) == [37, 38]
    assert grid_capacity(lambda k: False, 10, 0) is None
    for rate in (0.37, 1.0, 19.17, 22.0):
        k = grid_index(rate, 0.02)
        assert grid_rate(k, 0.02) <= rate < grid_rate(k + 1, 0.02)


def test_early_stop_decision_by_hand(tmp_path):
    """The constructed case at rates either side of its knee: the early-stopped verdict (and its bound) is
    the full run's decision."""
    (task,) = constructed(tmp_path).tasks()
    knee = 1 / SERVICE
    window = _Search(task).window
    for rate in (0.5 * knee, 0.99 * knee, 1.01 * knee, 1.1 * knee, 3 * knee):
        attained = _Search(task).simulate(("rate", rate), lambda r=rate: window.requests(r))["slo_attainment"]
        with pytest.raises(_Verdict) as verdict:
            _Search(task).simulate(("rate", rate), lambda r=rate: window.requests(r), judged=True)
        assert verdict.value.passed == (attained >= 0.9) == (rate <= knee)


@pytest.mark.parametrize("case", ["constructed", "sharegpt-bullet", "per-token"])
def test_misses_counted_before_they_finish_change_no_decision(tmp_path, case):
    """Judge.watch counts a request as missed once its TTFT target has passed with no first token and no
    launch in flight: the verdict equals the full run's, and comes no later than counting at finishes."""
    if case == "constructed":
        (task,) = constructed(tmp_path).tasks()
        rates = [f / SERVICE for f in (0.5, 0.99, 1.01, 1.1, 3.0)]
    else:
        slo = {"slo_ttft": "300", "slo_tpot": "60"} if case == "sharegpt-bullet" else {"slo_ttft_per_token": "0.5"}
        (task,) = parse_sweep({"trace": "sharegpt", "num_prompts": "150", "policy": "bullet", **slo}).tasks()
        rates = [4.0, 10.0, 14.0, 18.0, 30.0]
    search = _Search(task)
    stopped = 0
    for rate in rates:
        reqs = search.window.requests(rate)
        full = simulate(reqs, search.model, search.gpu, search.sched, CacheConfig(), search.slo, search.latency)
        verdicts = []
        for watched in (False, True):
            judge, seen = Judge(len(reqs), search.slo, 0.9), []

            def hook(r, judge=judge, seen=seen):
                seen.append(r)
                judge(r)

            with pytest.raises(_Verdict) as v:
                simulate(reqs, search.model, search.gpu, search.sched, CacheConfig(), search.slo, search.latency,
                         on_finish=hook, watch=judge.watch if watched else None)
            verdicts.append((v.value.passed, len(seen)))
        (plain, n_plain), (watched, n_watched) = verdicts
        assert plain == watched == (full.summary["slo_attainment"] >= 0.9)
        assert n_watched <= n_plain
        stopped += n_watched < n_plain
    assert stopped  # some failing run stopped earlier


def test_units_share_simulations_and_change_no_answer(monkeypatch):
    """Chunked does not read its SLOs: four SLO sets x two budgets form one unit whose searches share their
    simulations and start from each other's answers; every capacity and every verdict equals that of the
    task searched alone (cold start, nothing shared), in far fewer simulations."""
    import simulator.run

    sweep = parse_sweep({"trace": "sharegpt", "num_prompts": "150", "policy": "chunked",
                         "max_num_batched_tokens": "512,2048", "slo_ttft": "800,3000", "slo_tpot": "40,100",
                         "latency": "roofline"})
    tasks = sweep.tasks()
    count = {"n": 0}
    real = simulator.run.simulate

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(simulator.run, "simulate", counting)
    shared = run_tasks(tasks)
    n_shared, count["n"] = count["n"], 0
    alone = [run_task(t) for t in tasks]
    assert len(units(tasks)) == 1 and count["n"] > 2 * n_shared
    assert sum(r.simulated for r in shared) == n_shared
    for a, b in zip(shared, alone):
        assert a.capacity == b.capacity
        verdicts = {run.rate: (run.attainment, run.bound) for run in b.runs if run.kind == "search"}
        for run in a.runs:  # a rate both searched: the same attainment, or the same bound
            if run.kind == "search" and run.rate in verdicts:
                assert (run.attainment, run.bound) == verdicts[run.rate]


@pytest.mark.parametrize("rows", [60, 300])  # the pilot is the whole window / the window is larger
def test_capacity_is_unbounded_when_a_burst_meets_the_slo(tmp_path, rows):
    """All requests at once: the last TTFT is rows x 12 ms, under a 10 s target: no rate is too high."""
    base = constructed(tmp_path, rows=rows)
    loose = base.axes[:3] + (("slo_ttft", (10_000.0,)),)
    sweep = Sweep(**{**base.__dict__, "num_requests": rows, "axes": loose})
    (res,) = run_tasks(sweep.tasks())
    assert res.capacity == float("inf")
    assert sum(r.kind == "search" for r in res.runs) <= 6  # found out by the pilot or one burst run
    (row,) = summarize(sweep, [res])
    assert row.mean == float("inf") and row.output_tok_s == float("inf") and row.cost_per_m_tokens is None


def test_early_stop_changes_no_decision():
    sweep = Sweep(axes=(("trace", ("sharegpt",)), ("policy", ("chunked",)), ("slo_ttft", (1000.0,)),
                        ("slo_tpot", (60.0,))), num_requests=150, rel_tol=0.05)
    (task,) = sweep.tasks()
    search, judged = _Search(task), _Search(task)  # (two: each keeps what it simulated)
    for rate in (4.0, 8.0, 12.0, 16.0):
        full = search.simulate(("rate", rate), lambda r=rate: search.window.requests(r))["slo_attainment"]
        with pytest.raises(_Verdict) as verdict:
            judged.simulate(("rate", rate), lambda r=rate: judged.window.requests(r), judged=True)
        assert verdict.value.passed == (full >= 0.9)
        assert (verdict.value.bound >= 0.9) == (full >= 0.9)
        assert verdict.value.bound <= full if verdict.value.passed else verdict.value.bound >= full
    early = run_tasks(sweep.tasks())[0]
    full = run_tasks(Sweep(**{**sweep.__dict__, "early_stop": False}).tasks())[0]
    assert early.capacity == full.capacity
    assert [r.rate for r in early.runs] == [r.rate for r in full.runs]


def test_one_request_verdict_matches_metrics():
    model, gpu = MODEL, resolve_gpu("h200")
    reqs = load_trace("sharegpt", num_requests=120, rate=14.0)
    sweep = parse_sweep({"slo_ttft": "800", "slo_tpot": "40"})
    per_token = parse_sweep({"slo_ttft_per_token": "1"}).configs()[0]
    for slo in (sweep.configs()[0].slo_config(), per_token.slo_config()):
        res = simulate(reqs, model, gpu, sweep.configs()[0].scheduler(), CacheConfig(), slo)
        cols = request_columns(res.requests, slo)
        mine = {r.id: attained(r, slo) for r in res.requests}
        assert [mine[i] for i in cols["id"]] == cols["attained"].tolist()
        assert 0 < sum(mine.values()) < len(mine)  # both outcomes occur


def test_fresh_requests_equal_load_trace(tmp_path):
    def rows(reqs):
        return [(r.id, r.arrival, r.prompt_len, r.max_new_tokens, r.hash_ids) for r in reqs]

    timed = Sweep(axes=(("trace", ("azure-code",)),), num_requests=80, windows=3)
    for task in timed.tasks():
        window = Window(task)
        for rate in (0.5, 7.0):
            got = window.requests(rate)
            want = load_trace("azure-code", num_requests=80, start=80 * task.window, rate=rate)
            assert rows(got) == rows(want)
            assert got is not window.requests(rate) and all(r.num_computed == 0 for r in got)
    trace = lengths_trace(tmp_path / "lens.csv", 50, 300, 20)
    synthetic = Sweep(axes=(("trace", (trace,)),), num_requests=50, seeds=3, arrival="gamma", cv=2.0, seed=7)
    tasks = synthetic.tasks(lambda t: False)
    assert [t.seed for t in tasks] == [7, 8, 9]
    for task in tasks:
        want = load_trace(trace, num_requests=50, rate=3.0, arrival_process="gamma", cv=2.0, seed=task.seed)
        assert rows(Window(task).requests(3.0)) == rows(want)


# ------------------------------------------------------------------------------------------- the spec

def test_expansion_drops_knobs_a_policy_ignores():
    sweep = parse_sweep({"policy": "chunked,static-split", "prefill_sms": "76,92",
                         "max_num_batched_tokens": "512,2048", "request_rate": "2:20:2"})
    configs = sweep.configs()
    assert [(c.policy, c.max_batched_tokens, c.prefill_sms) for c in configs] == [
        ("chunked", 512, None), ("chunked", 2048, None), ("static-split", 512, 76), ("static-split", 512, 92),
        ("static-split", 2048, 76), ("static-split", 2048, 92)]
    assert sweep.rates == tuple(float(r) for r in range(2, 21, 2))
    assert sweep.varying() == ["policy", "max_batched_tokens", "prefill_sms"]
    assert parse_sweep({"request_rate": "0.1:0.7:0.1"}).rates == (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
    per_token = parse_sweep({"slo_ttft": "500,1000", "slo_ttft_per_token": "1.5"}).configs()
    assert len(per_token) == 1 and per_token[0].slo_ttft is None  # a per-token TTFT target overrides
    named = parse_sweep({"slo": "paper-sharegpt,tight", "policy": "chunked,bullet"})
    assert [(c.slo, c.slo_ttft, c.slo_ttft_per_token, c.slo_tpot) for c in named.configs()[::2]] == [
        ("paper-sharegpt", None, 3.0, 150.0), ("tight", 500.0, None, 50.0)]
    assert named.varying() == ["slo", "policy"] and named.configs()[0].label(named.varying()) == \
        "paper-sharegpt chunked"
    ahead = parse_sweep({"policy": "chunked,bullet", "async_scheduling": "off,on"})  # single-lane policies only
    assert [(c.policy, c.async_scheduling) for c in ahead.configs()] == [
        ("chunked", False), ("chunked", True), ("bullet", None)]
    assert [c.scheduler().async_scheduling for c in ahead.configs()] == [False, True, False]
    assert ahead.configs()[1].label(ahead.varying()) == "chunked async=on"


def test_flags_and_files_give_the_same_sweep(tmp_path):
    flags = {"policy": "chunked,bullet", "max_num_batched_tokens": "512,2048,8192", "request_rate": "2:20:2",
             "slo_tpot": "100,150", "tensor_parallel_size": "1", "gpu": "h200,h100", "num_prompts": "300",
             "target_attainment": "0.95", "windows": "2", "early_stop": False}
    toml = tmp_path / "sweep.toml"
    toml.write_text('policy = ["chunked", "bullet"]\nmax_num_batched_tokens = [512, 2048, 8192]\n'
                    'request_rate = "2:20:2"\nslo_tpot = [100, 150]\ntensor_parallel_size = 1\n'
                    'gpu = "h200,h100"\nnum_prompts = 300\ntarget_attainment = 0.95\nwindows = 2\n'
                    'early_stop = false\n')
    from_flags, from_file = load_sweep(None, flags), load_sweep(toml, {})
    assert from_flags == from_file
    assert from_flags.configs() == from_file.configs() and len(from_file.configs()) == 24
    # a flag overrides the file's key
    assert load_sweep(toml, {"policy": "chunked"}).values("policy") == ("chunked",)
    try:
        import yaml  # noqa: F401
    except ImportError:
        return
    yml = tmp_path / "sweep.yaml"
    yml.write_text("policy: [chunked, bullet]\nmax_num_batched_tokens: [512, 2048, 8192]\n"
                   "request_rate: '2:20:2'\nslo_tpot: [100, 150]\ntensor_parallel_size: 1\ngpu: h200,h100\n"
                   "num_prompts: 300\n"
                   "target_attainment: 0.95\nwindows: 2\nearly_stop: false\n")
    assert load_sweep(yml, {}) == from_flags


@pytest.mark.parametrize("raw, message", [
    ({"policy": "chunked,fifo"}, "unknown policy 'fifo'"),
    ({"request_rate": "5:2:1"}, "the start (5) is above the stop (2)"),
    ({"request_rate": "1:5:0"}, "the step must be positive"),
    ({"max_tokens": "5"}, "unknown setting 'max_tokens'"),
    ({"prefill_sms": "76"}, "applies to static-split only"),
    ({"slo_tpot": "nan"}, "expected a finite number"),
    ({"max_num_batched_tokens": "512.5"}, "expected an integer"),
    ({"gpu": "b300"}, "unknown GPU 'b300'"),
    ({"target_attainment": "1.5"}, "must be in (0, 1]"),
    ({"slo": "paper-sharegpt", "slo_tpot": "100"}, "give either named SLO sets or"),
    ({"slo": "loose"}, "unknown SLO set 'loose'"),
])
def test_bad_settings_name_the_flag(raw, message):
    with pytest.raises(SweepError, match=None) as e:
        parse_sweep(raw)
    assert message in str(e.value)


# ----------------------------------------------------------------------------------- execution paths

def _tables(sweep, results):
    return csv_text(rows_table(summarize(sweep, results))), csv_text(runs_table(sweep, results))


def _small_sweep() -> Sweep:
    return parse_sweep({"trace": "sharegpt", "num_prompts": "80", "policy": "chunked,static-split",
                        "prefill_sms": "76,92", "request_rate": "6,12", "windows": "2", "rel_tol": "0.1",
                        "slo_ttft": "1000", "slo_tpot": "50"})


def test_parallel_and_serial_give_identical_tables():
    sweep = _small_sweep()
    tasks = sweep.tasks()
    assert len(tasks) == 6
    serial = run_tasks(tasks, jobs=1)
    parallel = run_tasks(tasks, jobs=2)
    assert _tables(sweep, serial) == _tables(sweep, parallel)
    assert all(r.error is None and r.capacity > 0 for r in serial)


def test_ray_gives_the_local_tables():
    pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'bullet[ray]')")
    sweep = _small_sweep()
    tasks = sweep.tasks()
    assert _tables(sweep, run_tasks(tasks, ray_address="local")) == _tables(sweep, run_tasks(tasks, jobs=1))


def test_replicates_give_mean_and_spread(tmp_path):
    sweep = constructed(tmp_path, rows=120, windows=2, gpu_hour_cost=2.0)
    results = run_tasks(sweep.tasks())
    (row,) = summarize(sweep, results)
    caps = [r.capacity for r in results]
    assert row.capacities == tuple(caps) and row.mean == statistics.fmean(caps)
    assert row.sd == statistics.stdev(caps) and row.low == min(caps) and row.high == max(caps)
    # one output token a request: output tokens/s = capacity; cost = price x GPUs / (tokens/s x 3600) x 1e6
    assert row.output_tok_s == pytest.approx(row.mean)
    assert row.cost_per_m_tokens == pytest.approx(2.0 * 1 / (row.mean * 3600) * 1e6)


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_writes_tables_and_plots(tmp_path):
    out = tmp_path / "wi"
    args = ["whatif", "--trace", "sharegpt", "--num-prompts", "60", "--policy", "chunked,prefill-first",
            "--request-rate", "4,8", "--rel-tol", "0.1", "--gpu-hour-cost", "3", "--slo", "tight",
            "--jobs", "1", "--out", str(out)]
    plot = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot = False
    res = runner.invoke(app, args + (["--plot"] if plot else []))
    assert res.exit_code == 0, res.output
    assert "capacity" in res.output and "prefill-first" in res.output
    rows = list(csv.DictReader((out / "capacity.csv").open()))
    assert [r["policy"] for r in rows] == ["chunked", "prefill-first"]
    mean_out = statistics.fmean(r.max_new_tokens for r in load_trace("sharegpt", num_requests=60))
    for r in rows:
        cap = float(r["capacity_req_s"])
        assert 0 < cap < 100
        assert float(r["output_tok_s_at_capacity"]) == pytest.approx(cap * mean_out, rel=1e-5)
        cost = 3 / (cap * mean_out * 3600) * 1e6
        assert float(r["cost_per_m_output_tokens"]) == pytest.approx(cost, rel=1e-5)
    runs = list(csv.DictReader((out / "runs.csv").open()))
    assert {r["kind"] for r in runs} >= {"grid", "search"}
    assert sum(int(r["simulations"]) for r in rows) == len(runs)
    names = sorted(p.name for p in out.iterdir())
    assert not [n for n in names if n.startswith(".")]  # no temporary files left
    if plot:
        assert {"attainment.png", "capacity.png", "cost.png"} <= set(names)
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "capacity.csv").stat().st_mode & 0o777 == 0o666 & ~umask


def _bad(tmp_path, args, message):
    before = sorted(p.name for p in tmp_path.iterdir())
    res = runner.invoke(app, ["whatif", "--num-prompts", "20", "--jobs", "1", *args])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("args, message", [
    (["--policy", "chunked,fifo"], "unknown policy 'fifo'"),
    (["--request-rate", "5:2:1"], "above the stop"),
    (["--max-tokens", "512"], "unknown option '--max-tokens'"),
    (["--prefill-sms", "76"], "applies to static-split only"),
    (["--policy", "static-split", "--prefill-sms", "96"], "not a prefill size"),
    (["--policy", "bullet", "--layers-per-step", "40"], "more than llama-3.1-8b's 32 layers"),
    (["--model", "llama-3.1-70b", "-tp", "1"], "leaves no memory for the KV cache"),
    (["--trace", "no-such-trace"], "no-such-trace"),
    (["--windows", "1000"], "need 20000"),
    (["--seeds", "3"], "seeds would vary nothing"),
    (["--plot"], "--plot needs --out"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, message):
    _bad(tmp_path, args, message)


def test_bad_file_key_names_file_and_line(tmp_path):
    toml = tmp_path / "sweep.toml"
    toml.write_text('policy = "chunked"\nmax_tokens = 512\n')
    _bad(tmp_path, ["--config", str(toml)], f"{toml}:2: key 'max_tokens': unknown setting")
    toml.write_text('max_num_seqs = 64\npolicy = ["chunked", "fifo"]\n')
    _bad(tmp_path, ["--config", str(toml)], f"{toml}:2: key 'policy': unknown policy 'fifo'")
    toml.write_text('policy = "chunked"\nrequest_rate = [\n')
    _bad(tmp_path, ["--config", str(toml)], "not valid TOML")


def test_unwritable_out_is_refused_before_running(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _bad(tmp_path, ["--out", str(blocker)], "exists and is not a folder")
    _bad(tmp_path, ["--out", str(blocker / "sub")], "cannot create it")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        _bad(tmp_path, ["--out", str(locked / "wi")], "cannot create it")


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    _bad(tmp_path, ["--out", str(tmp_path / "wi"), "--plot"], "--plot needs matplotlib")
