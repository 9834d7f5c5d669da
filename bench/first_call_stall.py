"""The host time of a product shape's first call on a green partition while the other partition is busy.

The first call of a cuBLAS shape (a row count it picks a new kernel for) or of a kernel never run before in the
process blocks the host until the whole GPU drains: with a decode lane busy for ~250 ms, the prefill lane's
host waits that long before it can enqueue anything. This measures it for the lm_head product (hidden 4096 x
vocab 128,256, Llama-3.1-8B's) at several row counts, three times over: a first round on a prefill partition
with the decode partition busy, the same shapes again (second calls), then on other partitions (a shape set
up once serves every partition). Columns: row count, product ms, the ``.float()`` after it ms.
Also prints the device memory the process holds outside torch's allocator (the CUDA context and loaded modules).
Run on a GPU: ``python3 bench/first_call_stall.py``; ``CUDA_MODULE_LOADING=EAGER python3 ...`` for the A/B
on module loading (it changes the elementwise kernels' first calls, not the product's); ``--busy-matmuls 0``
for the same calls on an idle GPU.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="3,7,19,37,57", help="row counts, comma-separated")
    ap.add_argument("--busy-matmuls", type=int, default=60, help="8192^3 bf16 products the decode side runs")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from rich.console import Console
    from rich.table import Table

    from bullet.gpu.partitions import PartitionMenu

    dev = torch.device("cuda")
    w = torch.randn(128256, 4096, device=dev, dtype=torch.bfloat16) * 0.01
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    rows = [int(x) for x in args.rows.split(",")]
    menu = PartitionMenu.create(0)
    try:
        F.linear(torch.randn(rows[0], 4096, device=dev, dtype=torch.bfloat16), w)  # cuBLAS initialised
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free - torch.cuda.memory_reserved()) / 2**30
        print(f"device memory outside torch's allocator: {outside:.2f} GiB (the menu included)")
        decode = menu.decode[min(menu.decode)]

        def busy() -> float:
            t = time.perf_counter()
            with torch.cuda.stream(decode.stream):
                for _ in range(args.busy_matmuls):
                    a @ a
            return time.perf_counter() - t

        def first(stream, m: int) -> tuple[float, float]:
            x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
            torch.cuda.synchronize()
            busy()
            with torch.cuda.stream(stream):
                t = time.perf_counter()
                y = F.linear(x, w)
                t1 = time.perf_counter()
                y.float()
                t2 = time.perf_counter()
            torch.cuda.synchronize()
            return 1e3 * (t1 - t), 1e3 * (t2 - t1)

        t = time.perf_counter()
        busy()
        torch.cuda.synchronize()
        busy_ms = 1e3 * (time.perf_counter() - t)
        sides = [(f"prefill {n} SMs, first", menu.prefill[n]) for n in sorted(menu.prefill)[-4:-3]]
        sides += [(f"prefill {n} SMs, again", menu.prefill[n]) for n in sorted(menu.prefill)[-4:-3]]
        sides += [("whole GPU", menu.full), (f"prefill {min(menu.prefill)} SMs", menu.prefill[min(menu.prefill)])]
        table = Table(title=f"host ms of F.linear / .float() while {decode.num_sms} decode SMs run {busy_ms:.0f} ms "
                            f"of work (CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', 'default')})")
        table.add_column("partition")
        for m in rows:
            table.add_column(f"{m} rows", justify="right")
        for name, side in sides:
            table.add_row(name, *(f"{p:.1f} / {f:.1f}" for p, f in (first(side.stream, m) for m in rows)))
        Console().print(table)
    finally:
        menu.close()


if __name__ == "__main__":
    main()
