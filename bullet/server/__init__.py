"""OpenAI-compatible live serving (``bullet run``): the real executor and a policy behind vLLM's HTTP API.

:func:`build_server` makes the pieces (executor, block manager, scheduler, engine, tokenizer, metrics) and
returns a :class:`~bullet.server.app.BulletServer`; :func:`~bullet.server.app.run_http` serves it with uvicorn.
Needs the ``server`` extra (fastapi, uvicorn, prometheus-client, jinja2), and torch for a model on ``cuda`` or
``cpu``; ``device="sim"`` runs no model (:class:`simulator.paced.PacedExecutor`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ..config import CacheConfig, ConfigError, SchedulerConfig, SloConfig, resolve_gpu, resolve_model

log = logging.getLogger("bullet.server")

CPU_NUM_BLOCKS = 1024  # the KV pool on device "cpu" when none is given (16k tokens of 16-token blocks)


def build_server(model: str, *, device: str = "cpu", weights: str = "auto", tokenizer: str | None = "auto",
                 gpu: str = "h200", sched: SchedulerConfig | None = None, cache: CacheConfig | None = None,
                 slo: SloConfig | None = None, latency: str = "auto", seed: int = 0,
                 served_model_name: str | None = None, api_key: str | None = None, max_waiting: int = 512,
                 window_s: float = 0.01, use_graphs: bool = True, keep_launches: bool = False):
    """``model``: a preset or a model folder (config.json; tokenizer.json and *.safetensors where present).
    ``weights``: "auto" (the folder's safetensors if it has any, else seeded dummy weights), "dummy", or a
    folder. ``tokenizer``: "auto" (the model folder's tokenizer.json, else the byte-level scheme), None (the
    byte-level scheme) or a folder. ``keep_launches``: the metrics keep every launch for
    ``server.metrics.write_launch_log`` (``bullet run --launch-log``). ConfigError naming the flag for bad
    values."""
    from simulator.run import latency_model

    from ..engine import Engine
    from ..kvcache import BlockManager
    from ..perfmodel.base import CachedLatency
    from ..policies import make_scheduler
    from .app import BulletServer
    from .metrics import ServerMetrics
    from .tokenizer import load_tokenizer

    sched, cache = sched or SchedulerConfig(), cache or CacheConfig()
    spec = resolve_model(model)
    gpu_spec = resolve_gpu(gpu)
    folder = Path(model) if Path(model).is_dir() else None
    if weights == "auto":
        weights = str(folder) if folder is not None and any(folder.glob("*.safetensors")) else "dummy"
    if tokenizer == "auto":
        tokenizer = str(folder) if folder is not None else None
    elif tokenizer is not None and not (Path(tokenizer) / "tokenizer.json").exists():
        raise ConfigError(f"--tokenizer {tokenizer}: no tokenizer.json there")
    tok = load_tokenizer(tokenizer, spec.vocab_size)
    base = latency_model(latency, spec, gpu_spec)
    latency_cache = CachedLatency(base)
    if device == "sim":  # no model runs: launches take the latency model's time (simulator/paced.py)
        from simulator.executor import SimExecutor
        from simulator.paced import PacedExecutor

        ex = PacedExecutor(SimExecutor(latency_cache, spec.num_layers, gpu_spec))
        num_blocks, thread_init = cache.blocks_for(spec, gpu_spec), None
    else:
        ex, thread_init = _model_executor(spec, gpu_spec, gpu, device, weights, cache, sched, seed, use_graphs)
        num_blocks = ex.kv.num_blocks
    try:
        kv = BlockManager(num_blocks, cache.block_size, cache.prefix_caching)
        scheduler = make_scheduler(sched, spec, gpu_spec, kv, latency_cache, eos_token_id=tok.eos_token_id, slo=slo)
    except BaseException:
        ex.close()
        raise
    name = served_model_name or model
    metrics = ServerMetrics(name, base, spec.num_layers, keep_launches=keep_launches)
    engine = Engine(scheduler, ex, stream=True, on_launch=metrics.on_launch, on_step=metrics.on_step)
    return BulletServer(engine, tok, metrics, model_name=name, max_waiting=max_waiting, api_key=api_key,
                        window_s=window_s, thread_init=thread_init)


def _model_executor(spec, gpu_spec, gpu: str, device: str, weights: str, cache: CacheConfig, sched: SchedulerConfig,
                    seed: int, use_graphs: bool):
    """The GpuExecutor on ``device`` (CUDA or the CPU), and the engine thread's initialiser: its CUDA device,
    the executor's warm-up and the policy's decode graphs."""
    import torch

    from ..gpu.executor import GpuExecutor, prepare_graphs

    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: not 'cuda', 'cuda:N', 'cpu' or 'sim'")
    cpu = kind == "cpu"
    if not cpu and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device here (use --device cpu --model tiny-llama, or "
                          "--device sim)")
    num_blocks = cache.num_blocks or (CPU_NUM_BLOCKS if cpu else None)
    ex = GpuExecutor(spec, weights, device, block_size=cache.block_size, num_blocks=num_blocks,
                     gpu_memory_utilization=cache.gpu_memory_utilization, seed=seed, use_graphs=use_graphs)
    if ex.menu is not None and ex.menu.num_sms != gpu_spec.num_sms:
        ex.close()
        raise ConfigError(f"--gpu {gpu}: {gpu_spec.num_sms} SMs, but the device has {ex.menu.num_sms}")

    def thread_init() -> None:
        # on the engine thread, which is the one that serves: torch keeps cuDNN's attention plans per
        # thread, so plans built on another thread are built again at each new prompt length while serving
        # (+15-70 ms on a first prefill slice on the H200, bench/RESULTS.md, thirteenth session)
        if not cpu:
            torch.cuda.set_device(ex.device)
        t = time.perf_counter()
        n = ex.warmup()
        if not cpu:
            log.info("warm-up: attention plans for %d prompt lengths and the eager kernels in %.1f s", n,
                     time.perf_counter() - t)
        if not cpu and use_graphs:  # decode graphs of the policy's partitions, before the first request
            t, before = time.perf_counter(), torch.cuda.mem_get_info(ex.device)[0]
            counts = prepare_graphs(ex, sched, gpu_spec)
            after = torch.cuda.mem_get_info(ex.device)[0]
            log.info("CUDA graphs: %d decode, %d prefill/mixed in %.1f s, %.2f GiB (%.1f GiB of the device left "
                     "free)", counts["decode"], counts["prefill"], time.perf_counter() - t, (before - after) / 2**30,
                     after / 2**30)

    return ex, thread_init


__all__ = ["CPU_NUM_BLOCKS", "build_server"]
