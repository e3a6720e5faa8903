"""Benchmark the hybrid dense / 2:4 kernels against dense cuBLAS (F.linear) in the same run.

    python benchmarks/bench_kernels.py                      # LLaMA-2-7B shapes, fp16
    python benchmarks/bench_kernels.py --dtype bf16 --m 1 16 --sparsity 0.45

For each weight shape (N, K), sparsity s (share of 2:4 tiles = 2s, random tile map) and M, prints the
speedup over F.linear on the dense weight, the achieved GB/s (weights + x + y bytes / time) and the
speedup as a share of the decode bytes ceiling 1 / (1 - 0.875 s). Appends one JSON line (device,
versions, date, all numbers) to benchmarks/results/kernels.jsonl. Exits with a message without CUDA.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def ceiling(s: float) -> float:
    """Decode speedup bound when only weight bytes count: 2:4 tiles cost 1.125 / 2 of dense."""
    return 1.0 / (1.0 - 0.875 * s)


def tile_map(n: int, k: int, tile: tuple[int, int], s: float, gen: torch.Generator) -> torch.Tensor:
    """Random (Tn, Tk) kinds with exactly round((1 - 2s) * tiles) dense tiles (overall sparsity s)."""
    tn, tk = math.ceil(n / tile[0]), math.ceil(k / tile[1])
    n_dense = round((1.0 - 2.0 * s) * tn * tk)
    kinds = torch.ones(tn * tk, dtype=torch.uint8)
    kinds[torch.randperm(tn * tk, generator=gen)[:n_dense]] = 0
    return kinds.view(tn, tk)


def bench_one(n, k, s, ms, dtype, tile, block, gen, do_bench):
    from patchc.codegen import pack, tile_linear
    from patchc.codegen.reference import random_layer_plan

    layer = random_layer_plan(n, k, tile=tile, kinds=tile_map(n, k, tile, s, gen), dtype=dtype, seed=0)
    packed = pack(layer, block=block).to("cuda")
    w = layer.to_dense().to("cuda")  # dense baseline reads the full (N, K) weight
    rows = []
    for m in ms:
        x = (torch.randn(m, k, device="cuda") / k**0.5).to(dtype)
        y = tile_linear(x, packed)
        err = (y.float() - F.linear(x, w).float()).abs().max().item()
        t_dense = do_bench(lambda: F.linear(x, w))
        t_tile = do_bench(lambda: tile_linear(x, packed))
        io = (m * k + m * n) * x.element_size()
        speedup = t_dense / t_tile
        rows.append({
            "N": n, "K": k, "M": m, "sparsity": s, "dense_ms": t_dense, "tile_ms": t_tile,
            "speedup": speedup, "ceiling": ceiling(s), "of_ceiling": speedup / ceiling(s),
            "tile_GBps": (packed.weight_bytes + io) / t_tile / 1e6,
            "dense_GBps": (packed.dense_bytes + io) / t_dense / 1e6,
            "max_abs_err": err,
        })
        r = rows[-1]
        print(f"{n:>6}x{k:<6} s={s:.2f} M={m:<5} dense {t_dense * 1e3:8.1f} us  tile {t_tile * 1e3:8.1f} us  "
              f"speedup {speedup:5.2f}x  ceiling {r['ceiling']:.2f}x ({100 * r['of_ceiling']:5.1f}%)  "
              f"{r['tile_GBps']:7.0f} GB/s (dense {r['dense_GBps']:7.0f})  err {err:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 2048])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.35, 0.45, 0.50])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--tile", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--block", type=int, nargs=2, default=None, help="pack block (default: per-arch table)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels.jsonl")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device (torch.cuda.is_available() is False); nothing to measure.",
              file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.testing import do_bench

    from patchc.codegen.configs import arch_of, choose_block
    from patchc.utils.env import device_name, versions

    tile = tuple(args.tile)
    block = tuple(args.block) if args.block else choose_block(tile, arch_of("cuda"))
    gen = torch.Generator().manual_seed(0)
    results = []
    for n, k in SHAPES:
        for s in args.sparsity:
            results += bench_one(n, k, s, args.m, DTYPES[args.dtype], tile, block, gen, do_bench)
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name("cuda"),
        "capability": list(torch.cuda.get_device_capability()),
        **versions(),
        "dtype": args.dtype,
        "tile": list(tile),
        "block": list(block),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended {len(results)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
