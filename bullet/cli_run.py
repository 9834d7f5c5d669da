"""``bullet run``: serve a model with any policy on the real executor behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import logging
import sys
from enum import Enum
from typing import Annotated

import typer

from .cli_trace import fail, parse_sizes
from .config import POLICIES, CacheConfig, ConfigError, SchedulerConfig, SloConfig

Policy = Enum("Policy", {p.replace("-", "_"): p for p in POLICIES}, type=str)


def _ms(value: float | None) -> float | None:
    return None if value is None else value / 1e3


def run(
    model: Annotated[str, typer.Option(help="Model preset (llama-3.1-8b, qwen2.5-7b, qwen3-8b, tiny-llama, ...) or "
                                            "a Hugging Face model folder (config.json; tokenizer.json, "
                                            "tokenizer_config.json and *.safetensors where present).")]
    = "llama-3.1-8b",
    weights: Annotated[str, typer.Option(help="'auto' (the model folder's *.safetensors if any, else dummy), "
                                              "'dummy' (seeded random weights) or a folder of *.safetensors.")]
    = "auto",
    tokenizer: Annotated[str, typer.Option(help="'auto' (the model folder's tokenizer.json, else the byte-level "
                                                "scheme for dummy weights: see the README), 'bytes', or a folder "
                                                "with tokenizer.json.")] = "auto",
    device: Annotated[str, typer.Option(help="'cuda' (or 'cuda:N'), or 'cpu' (eager, float32: use --model "
                                             "tiny-llama).")] = "cuda",
    gpu: Annotated[str, typer.Option(help="GPU preset whose partition menu the policy plans with (h200, h100, "
                                          "a100).")] = "h200",
    policy: Annotated[Policy, typer.Option(help="Scheduling policy.")] = Policy.chunked,
    max_num_seqs: Annotated[int, typer.Option(help="Most requests running at once.")] = 256,
    max_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens", "--max-batched-tokens",
                                                    help="Token budget of one step (see bullet simulate "
                                                         "--help).")] = 8192,
    prefill_sms: Annotated[int, typer.Option(help="static-split: SMs of the prefill partition.")] = 92,
    layers_per_step: Annotated[int | None, typer.Option(help="Split policies: prefill layers per launch.")] = None,
    slo_ttft: Annotated[float, typer.Option(help="TTFT SLO in ms (bullet plans with it).")] = 3000.0,
    slo_tpot: Annotated[float, typer.Option(help="TPOT SLO in ms.")] = 150.0,
    slo_ttft_per_token: Annotated[float | None, typer.Option(help="TTFT SLO in ms per prompt token; overrides "
                                                                  "--slo-ttft.")] = None,
    slo_margin: Annotated[float, typer.Option(help="bullet: fraction of the TPOT budget kept spare.",
                                              min=0.0, max=0.99)] = 0.1,
    admission_control: Annotated[bool, typer.Option(help="bullet: refuse (503) requests predicted to miss "
                                                         "their TTFT.")] = False,
    decode_sizes: Annotated[str | None, typer.Option(help="bullet: comma-separated decode partition sizes.")]
    = None,
    max_decode_steps: Annotated[int, typer.Option(help="Most decode steps fused into one launch (tokens stream "
                                                       "out per launch).")] = 16,
    fuse_window_ms: Annotated[float, typer.Option(help="How often the engine takes new requests while launches "
                                                       "run; a fused decode launch that a new request could "
                                                       "join ends about this far ahead.")] = 10.0,
    block_size: Annotated[int, typer.Option(help="KV cache block size in tokens.")] = 16,
    num_blocks: Annotated[int | None, typer.Option("--num-gpu-blocks-override", "--num-blocks",
                                                   help="KV cache blocks (default: from GPU memory; 1024 on the "
                                                        "CPU).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="Fraction of GPU memory for weights, activations "
                                                               "and the KV cache.")] = 0.9,
    prefix_caching: Annotated[bool, typer.Option(help="Reuse the KV of full prompt blocks.")] = True,
    latency: Annotated[str, typer.Option(help="Latency model the policy plans with: auto, roofline, fitted, or a "
                                              "model JSON path.")] = "auto",
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
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (vLLM's routes) with the chosen policy on the real
    executor. Stops on SIGINT/SIGTERM: refuses new requests (503), lets in-flight ones finish within
    --drain-timeout, aborts the rest, exits 0."""
    for flag, value in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot),
                        ("--slo-ttft-per-token", slo_ttft_per_token), ("--fuse-window-ms", fuse_window_ms)):
        if value is not None and value <= 0:
            raise fail(f"{flag} must be a positive number of milliseconds, got {value:g}")
    try:
        from .server import build_server
        from .server.app import run_http
    except ImportError as e:
        raise fail(f"bullet run needs the server extra and torch ({e}): pip install -e '.[server,gpu]'") from None
    try:
        sizes = parse_sizes(decode_sizes)
        sched = SchedulerConfig(policy=policy.value, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                                prefill_sms=prefill_sms, layers_per_step=layers_per_step, slo_margin=slo_margin,
                                admission_control=admission_control, decode_sizes=sizes,
                                max_decode_steps=max_decode_steps)
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            gpu_memory_utilization=gpu_memory_utilization, prefix_caching=prefix_caching)
        slo = SloConfig(ttft=_ms(slo_ttft), tpot=_ms(slo_tpot), ttft_per_token=_ms(slo_ttft_per_token))
        server = build_server(model, device=device, weights=weights,
                              tokenizer=None if tokenizer == "bytes" else tokenizer, gpu=gpu, sched=sched,
                              cache=cache, slo=slo, latency=latency, seed=seed, served_model_name=served_model_name,
                              api_key=api_key, max_waiting=max_waiting, window_s=fuse_window_ms / 1e3)
    except (ConfigError, ValueError, OSError) as e:
        raise fail(str(e)) from None
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    # The engine thread and the HTTP event loop share the GIL: hand it over every 1 ms (Python's default is
    # 5 ms), so a busy event loop delays the engine's next launch by at most about that.
    sys.setswitchinterval(0.001)
    try:
        run_http(server, host=host, port=port, drain_timeout=drain_timeout, log_level=log_level)
    finally:
        if server.runner.join(5.0):  # not after a forced exit: the engine thread may still use the executor
            server.engine.executor.close()


def register(app: typer.Typer, command_class=None) -> None:
    app.command("run", cls=command_class)(run)
