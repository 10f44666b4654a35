#!/usr/bin/env python3
"""PyTorch baseline for the GPU benchmark: the scatters a user would write with tensor
indexing, on the same layouts and mappings as `examples/gpu_bench.rs`.

* indexer K scatter (FP8): pages of 64 tokens, values plane [64 x 128 B] then scales
  plane [64 x 4 B]; token i goes to page perm[i // 64], position i % 64.
* MLA BF16 scatter: 1152-byte rows at token slots page * 64 + position.

Prints one JSON document (median of CUDA-event timings, like gpu_bench).

    python3 benches/torch_scatter.py [--reps N] [--max-tokens N]
"""
import argparse
import json

import torch


def median_us(fn, reps):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps + 2):
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--max-tokens", type=int, default=4 << 20)
    a = ap.parse_args()
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    sizes = [n for n in [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20] if n <= a.max_tokens]
    rows = []
    for n in sizes:
        pages = (n + 63) // 64
        perm = torch.randperm(pages, device=dev)
        i = torch.arange(n, device=dev)
        page = perm[i // 64]
        pos = i % 64

        # Indexer K, FP8: values and scale words into the values-then-scales page.
        cache = torch.zeros(pages, 64 * 132, dtype=torch.uint8, device=dev)
        values = torch.randint(0, 256, (n, 128), dtype=torch.uint8, device=dev)
        scales = torch.randint(0, 256, (n, 4), dtype=torch.uint8, device=dev)
        vplane = cache[:, : 64 * 128].view(pages, 64, 128)
        splane = cache[:, 64 * 128 :].view(pages, 64, 4)

        def indexer():
            vplane[page, pos] = values
            splane[page, pos] = scales

        us = median_us(indexer, a.reps)
        rows.append({"kernel": "torch_indexer_k_scatter_fp8", "tokens": n, "median_us": round(us, 2)})
        del cache, values, scales, vplane, splane

        # MLA BF16 rows at token slots.
        pool = torch.zeros(pages * 64, 576, dtype=torch.bfloat16, device=dev)
        src = torch.randn(n, 576, dtype=torch.bfloat16, device=dev)
        slots = page * 64 + pos

        def mla():
            pool[slots] = src

        us = median_us(mla, a.reps)
        rows.append({"kernel": "torch_mla_scatter_bf16", "tokens": n, "median_us": round(us, 2)})
        del pool, src
        torch.cuda.empty_cache()
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
