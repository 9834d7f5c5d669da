"""``/metrics``: Prometheus metrics under vLLM's names (so its dashboards work), plus bullet's own: the SMs
each lane launched on last and every launch's predicted (the scheduler's latency model, next to the co-runner
in flight at launch) and measured time. One registry per server: nothing global."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..batch import Batch, StepResult
from ..engine import Engine
from ..perfmodel import LatencyModel, Work, work_of
from ..perfmodel.base import step_times
from ..validate import Launch, launch_errors, launch_of, write_launch_rows

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
DELAY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LAUNCH_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
GAP_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)


class ServerMetrics:
    def __init__(self, model_name: str, latency: LatencyModel, num_layers: int, keep_launches: bool = False) -> None:
        """``keep_launches``: keep every launch (its lane, SMs, work and times: about 350 bytes) for
        :meth:`write_launch_log` (``bullet run --launch-log``)."""
        self.launches: list[Launch] | None = [] if keep_launches else None
        self.registry = reg = CollectorRegistry()
        m = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests holding KV (admitted).", m, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for admission.", m, registry=reg)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).", m,
                              registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", m,
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", m,
                             buckets=E2E_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens generated.", m, registry=reg)
        self.success = Counter("vllm:request_success", "Finished requests by reason.", m + ["finished_reason"],
                               registry=reg)
        self.refused = Counter("bullet:requests_refused", "Requests answered with an error status, by status.",
                               m + ["status"], registry=reg)
        self.lane_sms = Gauge("bullet:lane_sms", "SMs of the last launch on each lane.", m + ["lane"], registry=reg)
        self.predicted = Histogram("bullet:launch_predicted_seconds", "Launch time the latency model predicted.",
                                   m + ["lane"], buckets=LAUNCH_BUCKETS, registry=reg)
        self.measured = Histogram("bullet:launch_measured_seconds", "Launch time measured (executor clock).",
                                  m + ["lane"], buckets=LAUNCH_BUCKETS, registry=reg)
        self.intake = Histogram("bullet:request_intake_seconds", "Request received (parsed, TTFT's start) to "
                                "taken by the engine thread.", m, buckets=DELAY_BUCKETS, registry=reg)
        self.delivery = Histogram("bullet:first_token_delivery_seconds", "First token sampled (TTFT's end) to "
                                  "handed to the event loop: a launch's tokens come out when it ends.", m,
                                  buckets=DELAY_BUCKETS, registry=reg)
        self.gap = Histogram("bullet:launch_gap_seconds", "A lane's idle time from a launch's end to the start of "
                             "its next launch when that one goes on with some of the same requests: the host's "
                             "time between back-to-back launches (results, planning, input preparation), which "
                             "a simulation does not have.", m + ["lane"], buckets=GAP_BUCKETS, registry=reg)
        self.policy_events = Gauge("bullet:policy_events", "Decisions the policy counts since start, by event "
                                   "(bullet: jobs_set_aside, requests_deferred under overload).",
                                   m + ["event"], registry=reg)
        self.latency, self.num_layers = latency, num_layers
        self._flight: dict[str, tuple[Batch, float, Work]] = {}  # lane -> (batch, predicted seconds, work)
        self._last: dict[str, tuple[float, set[int]]] = {}  # lane -> (end of its last launch, its requests)

    # ---- engine thread ------------------------------------------------------------------------------
    def on_launch(self, batch: Batch) -> None:
        lane, sms = batch.lane, batch.partition.num_sms
        co = next((b for ln, (b, _, _) in self._flight.items() if ln != lane), None)
        work = work_of(batch, self.num_layers)
        co_work, co_sms = (work_of(co, self.num_layers), co.partition.num_sms) if co is not None else (None, 0)
        if batch.steps > 1:
            t = float(step_times(self.latency, work, batch.steps, sms, co_work, co_sms).sum())
        else:
            t = float(self.latency.predict(work, sms, co_work, co_sms))
        self._flight[lane] = (batch, t, work)
        self.lane_sms.labels(self.model_name, lane).set(sms)

    def on_step(self, res: StepResult) -> None:
        lane = res.batch.lane
        _, predicted, work = self._flight.pop(lane, (None, None, None))
        if self.launches is not None:
            self.launches.append(launch_of(res, self.num_layers, work))
        if predicted is not None:
            self.predicted.labels(self.model_name, lane).observe(predicted)
        self.measured.labels(self.model_name, lane).observe(res.end - res.start)
        ids = {c.req_id for c in res.batch.chunks}
        last = self._last.get(lane)
        if last is not None and not last[1].isdisjoint(ids):
            self.gap.labels(self.model_name, lane).observe(max(0.0, res.start - last[0]))
        self._last[lane] = (res.end, ids)

    def taken(self, _request, delay: float) -> None:
        self.intake.labels(self.model_name).observe(delay)

    def after_step(self, engine: Engine) -> None:
        sched = engine.scheduler
        self.running.labels(self.model_name).set(len(sched.running))
        self.waiting.labels(self.model_name).set(len(sched.waiting))
        kv = sched.kv
        self.kv_usage.labels(self.model_name).set(1.0 - kv.num_free / kv.num_blocks)
        for event, n in sched.counters().items():
            self.policy_events.labels(self.model_name, event).set(n)

    # ---- event loop ---------------------------------------------------------------------------------
    def first_token(self, ttft: float, delivery: float) -> None:
        """``delivery``: from the first token's sampling to now (on the event loop)."""
        self.ttft.labels(self.model_name).observe(ttft)
        self.delivery.labels(self.model_name).observe(delivery)

    def tokens(self, times: tuple[float, ...], last: float | None) -> None:
        """Output tokens sampled at ``times``; ``last``: when the token before them was (None: none)."""
        h = self.itl.labels(self.model_name)
        for t in times:
            if last is not None:
                h.observe(t - last)
            last = t
        self.generation_tokens.labels(self.model_name).inc(len(times))

    def finished(self, reason: str, prompt_tokens: int, e2e: float | None) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        if e2e is not None:
            self.e2e.labels(self.model_name).observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def write_launch_log(self, path) -> int:
        """Every launch kept so far as a CSV row, in ``bullet validate``'s launches.csv columns (its work, the
        fraction the other lane overlapped, measured and predicted ms); returns how many."""
        rows: list[dict] = []
        launch_errors(sorted(self.launches or (), key=lambda r: r.start), self.latency, self.num_layers, rows)
        write_launch_rows(rows, path)
        return len(rows)
