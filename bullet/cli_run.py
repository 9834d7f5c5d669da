"""``bullet run``: serve a model with any policy on the real executor behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from .cli_options import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_LATENCY,
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL,
    DEFAULT_POLICY,
    DEFAULT_PREFILL_SMS,
    DEFAULT_PREFIX_CACHING,
    DEFAULT_SLO,
    DEFAULT_SLO_MARGIN,
    HARDWARE,
    AdmissionControlOpt,
    AsyncSchedulingOpt,
    BlockSizeOpt,
    DecodeSizesOpt,
    GoodputOpt,
    GpuMemoryUtilizationOpt,
    GpuOpt,
    LatencyOpt,
    LayersPerStepOpt,
    MaxBatchedTokensOpt,
    MaxNumSeqsOpt,
    ModelOpt,
    NumBlocksOpt,
    OverloadDeferralOpt,
    PolicyOpt,
    PrefillSmsOpt,
    PrefixCachingOpt,
    SloMarginOpt,
    SloOpt,
    SloTpotOpt,
    SloTtftOpt,
    SloTtftPerTokenOpt,
    check_finite,
    check_policy_flags,
    given_flags,
    parse_goodput,
    slo_config,
)
from .cli_trace import fail, parse_sizes
from .config import CacheConfig, ConfigError, SchedulerConfig, resolve_model


def run(
    ctx: typer.Context,
    model: ModelOpt = DEFAULT_MODEL,
    weights: Annotated[str, typer.Option(help="'auto' (the model folder's *.safetensors if any, else dummy), "
                                              "'dummy' (seeded random weights) or a folder of *.safetensors.",
                                         rich_help_panel=HARDWARE)] = "auto",
    tokenizer: Annotated[str, typer.Option(help="'auto' (the model folder's tokenizer.json, else the byte-level "
                                                "scheme for dummy weights: see the README), 'bytes', or a folder "
                                                "with tokenizer.json.", rich_help_panel=HARDWARE)] = "auto",
    device: Annotated[str, typer.Option(help="'cuda' (or 'cuda:N'), 'cpu' (eager, float32: use --model "
                                             "tiny-llama), or 'sim': no model runs, each launch takes the "
                                             "latency model's time on --gpu and yields placeholder tokens (a "
                                             "server paced like that GPU, without one: for clients and for "
                                             "comparing live serving with bullet simulate).",
                                        rich_help_panel=HARDWARE)] = "cuda",
    gpu: GpuOpt = DEFAULT_GPU,
    latency: LatencyOpt = DEFAULT_LATENCY,
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
    slo: SloOpt = DEFAULT_SLO,
    slo_ttft: SloTtftOpt = None,
    slo_ttft_per_token: SloTtftPerTokenOpt = None,
    slo_tpot: SloTpotOpt = None,
    goodput: GoodputOpt = None,
    block_size: BlockSizeOpt = DEFAULT_BLOCK_SIZE,
    num_blocks: NumBlocksOpt = None,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = DEFAULT_GPU_MEMORY_UTILIZATION,
    prefix_caching: PrefixCachingOpt = DEFAULT_PREFIX_CACHING,
    max_decode_steps: Annotated[int, typer.Option(help="Most decode steps fused into one launch (tokens stream "
                                                       "out per launch).")] = 16,
    fuse_window_ms: Annotated[float, typer.Option(help="How often the engine takes new requests while launches "
                                                       "run; a fused decode launch that a new request could "
                                                       "join ends about this far ahead.")] = 10.0,
    seed: Annotated[int, typer.Option(help="Seed of dummy weights and of unseeded sampling.")] = 0,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.", min=0, max=65535)] = 8000,
    api_key: Annotated[str | None, typer.Option(help="If set, /v1/* needs 'Authorization: Bearer KEY' (401 "
                                                     "otherwise).", envvar="BULLET_API_KEY")] = None,
    max_waiting: Annotated[int, typer.Option(help="Requests that may wait beyond the --max-num-seqs running "
                                                  "ones; over that, 429 with Retry-After.", min=0)] = 512,
    served_model_name: Annotated[str | None, typer.Option(help="The model name the API reports and accepts "
                                                               "(default: --model).")] = None,
    drain_timeout: Annotated[float, typer.Option(help="On SIGINT/SIGTERM: seconds to let in-flight requests "
                                                      "finish before they are aborted.", min=0.0)] = 30.0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    launch_log: Annotated[Path | None, typer.Option(help="On exit, write every launch to this CSV (bullet "
                                                         "validate's launches.csv columns: lane and kind, SMs, "
                                                         "work, the other lane's overlap, measured and predicted "
                                                         "ms), to see where live serving departs from the "
                                                         "latency model. Keeps about 350 bytes a launch in memory.",
                                                    dir_okay=False)] = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (vLLM's routes) with the chosen policy on the real
    executor. Stops on SIGINT/SIGTERM: refuses new requests (503), lets in-flight ones finish within
    --drain-timeout, aborts the rest, exits 0."""
    given = given_flags(ctx)
    check_finite({"--fuse-window-ms": fuse_window_ms, "--slo-margin": slo_margin,
                  "--gpu-memory-utilization": gpu_memory_utilization})
    if fuse_window_ms <= 0:
        raise fail(f"--fuse-window-ms must be a positive number of milliseconds, got {fuse_window_ms:g}")
    if launch_log is not None:
        from .cli import check_out_file

        check_out_file(launch_log, "--launch-log")
    slo_cfg = slo_config(slo.value, given, slo_ttft, slo_ttft_per_token, slo_tpot, parse_goodput(goodput or []))
    try:
        from .server import build_server
        from .server.app import run_http
    except ImportError as e:
        raise fail(f"bullet run needs the server extra ({e}): pip install -e '.[server]' (and '.[gpu]' for a "
                   "model on cuda or cpu)") from None
    try:
        check_policy_flags(policy.value, given, layers_per_step, resolve_model(model))
        sizes = parse_sizes(decode_sizes)
        sched = SchedulerConfig(policy=policy.value, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                                prefill_sms=prefill_sms, layers_per_step=layers_per_step, slo_margin=slo_margin,
                                admission_control=admission_control, overload_deferral=overload_deferral and policy.value == "bullet", decode_sizes=sizes,
                                max_decode_steps=max_decode_steps, async_scheduling=async_scheduling)
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            gpu_memory_utilization=gpu_memory_utilization, prefix_caching=prefix_caching)
        server = build_server(model, device=device, weights=weights,
                              tokenizer=None if tokenizer == "bytes" else tokenizer, gpu=gpu, sched=sched,
                              cache=cache, slo=slo_cfg, latency=latency, seed=seed, served_model_name=served_model_name,
                              api_key=api_key, max_waiting=max_waiting, window_s=fuse_window_ms / 1e3,
                              keep_launches=launch_log is not None)
    except (ConfigError, ValueError, OSError) as e:
        raise fail(str(e)) from None
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    # The engine thread and the HTTP event loop share the GIL: hand it over every 1 ms (Python's default is
    # 5 ms), so a busy event loop delays the engine's next launch by at most about that.
    sys.setswitchinterval(0.001)
    try:
        run_http(server, host=host, port=port, drain_timeout=drain_timeout, log_level=log_level)
    except RuntimeError as e:
        raise fail(str(e)) from None
    finally:
        if server.runner.join(5.0):  # not after a forced exit: the engine thread may still use the executor
            server.engine.executor.close()
            if launch_log is not None:
                n = server.metrics.write_launch_log(launch_log)
                logging.getLogger("bullet").info("wrote %d launches to %s", n, launch_log)


def register(app: typer.Typer, command_class=None) -> None:
    app.command("run", cls=command_class)(run)
