"""The only torch / Triton / CUDA code of bullet; imported lazily by ``run`` and ``profile``.

Modules: ``weights`` (load / check / dummy weights), ``kvcache`` (the paged pool), ``attention`` (per-launch
metadata, decode-graph buffers, paged attention), ``model`` (the forward over a layer range and the float32
reference), ``sampling`` (greedy / seeded top-p on the device), ``kernels`` (Triton kernels with torch
fallbacks).
"""
