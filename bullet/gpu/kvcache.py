"""The paged KV pool on the device: one pool shared by both lanes, addressed by the block manager's ids."""

from __future__ import annotations

import torch

from ..config import ModelSpec

LAYOUTS = ("hnd", "nhd")


class PagedKvCache:
    """``k`` and ``v``: ``[layers, num_blocks, block_size, kv_heads, head_dim]`` (logical order; every kernel
    takes the strides). Token ``p`` of a request whose block table is ``T`` lives in block
    ``T[p // block_size]`` at offset ``p % block_size``.

    ``layout`` is the order in memory within a block: ``"hnd"`` (default) keeps each KV head's
    ``block_size x head_dim`` tile contiguous (4 KiB for 16 x 128 bf16), which the decode kernel, one program
    per (sequence, KV head), reads whole; ``"nhd"`` keeps each token's heads together, the same program then
    reading 256-byte pieces at a 2 KiB stride. On the H200 the two were within 4 % of each other: "hnd" ~1 %
    ahead on SM partitions, either ahead on the whole GPU (bench/decode_partition.py, bench/RESULTS.md)."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int = 16,
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 layout: str = "hnd") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("PagedKvCache: num_blocks and block_size must be >= 1")
        if layout not in LAYOUTS:
            raise ValueError(f"PagedKvCache: layout {layout!r} is not one of {LAYOUTS}")
        self.layout = layout
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        L, N, B, KVH, D = spec.num_layers, num_blocks, block_size, spec.kv_heads_per_gpu, spec.head_dim
        # zeros, not empty: no path reads unwritten slots, but garbage NaNs would hide such a bug poorly
        if layout == "hnd":
            self.k, self.v = (torch.zeros((L, N, KVH, B, D), device=self.device, dtype=dtype).transpose(2, 3)
                              for _ in range(2))
        else:
            self.k, self.v = (torch.zeros((L, N, B, KVH, D), device=self.device, dtype=dtype) for _ in range(2))

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``(k, v)``: ``[num_blocks, block_size, kv_heads, head_dim]`` each."""
        return self.k[i], self.v[i]

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int) -> int:
        return spec.kv_bytes_per_token * block_size

    @staticmethod
    def blocks_for_memory(spec: ModelSpec, block_size: int, gpu_memory_utilization: float,
                          reserved_bytes: int, device: torch.device | str | None = None) -> int:
        """Blocks that fit in what the device has free now (call after the weights are loaded), keeping the
        whole process under ``gpu_memory_utilization`` of the card and ``reserved_bytes`` for workspace."""
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = total * gpu_memory_utilization - used - reserved_bytes
        blocks = int(budget // PagedKvCache.bytes_per_block(spec, block_size))
        if blocks < 1:
            raise MemoryError(f"no room for a KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB, "
                              f"utilization {gpu_memory_utilization}, {reserved_bytes / 2**30:.1f} GiB reserved")
        return blocks
