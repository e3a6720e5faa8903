"""How long `patchc generate` takes: the real stories260K plan and a 32-block LLaMA-2-7B-shaped plan.

Both plans have random hybrid tile kinds at 35% sparsity (exactly round(0.7 * tiles) 2:4 tiles per layer,
`patchc.bench.layers.tile_kinds`). stories260K: its 35 block linears from the real checkpoint, tiles
16 x 16 as the prune job uses, 2:4 tiles keeping the two largest weights of each group. 7B: per block
q, k, v, o 4096 x 4096, gate / up 11008 x 4096, down 4096 x 11008, tiles 128 x 128; generation never reads
weight values, so its buffers are broadcast zero views (a real 7B plan's 13 GB would not fit this
machine's purpose). Triton's compile cache starts empty (a fresh TRITON_CACHE_DIR) unless --warm.
Prints times and distinct-kernel counts and appends a JSON line to benchmarks/results/generate.jsonl.

    .venv/bin/python benchmarks/bench_generate.py                  # both plans, cold Triton cache
    .venv/bin/python benchmarks/bench_generate.py --plans stories --workers 1 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "generate.jsonl"
STORIES = Path(os.environ.get("PATCHC_SHARED", ROOT.parent / "shared")) / "models" / "stories260K" / "stories260K.bin"
SPARSITY = 0.35
LLAMA7B = {  # (N, K) of each linear of one block
    "self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (4096, 4096), "self_attn.v_proj": (4096, 4096),
    "self_attn.o_proj": (4096, 4096), "mlp.gate_proj": (11008, 4096), "mlp.up_proj": (11008, 4096),
    "mlp.down_proj": (4096, 11008),
}


def stories_plan(seed: int = 0):
    """TilePlan of stories260K's block linears: real weights, random 35% hybrid kinds, 16 x 16 tiles."""
    import torch

    from patchc.bench.layers import tile_kinds
    from patchc.ir import LayerPlan, TilePlan
    from patchc.models import load_model

    model = load_model(STORIES).model
    gen = torch.Generator().manual_seed(seed)
    layers, tile = {}, (16, 16)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            w = mod.weight.detach()
            kinds = tile_kinds(*w.shape, tile, SPARSITY, gen)
            fqn = f"{name}.weight"
            layers[fqn] = LayerPlan.from_mask(fqn, w, kinds, _hybrid_mask(w, kinds, tile), tile=tile)
    return TilePlan(layers=layers, skipped={}, meta={"source": "bench_generate", "sparsity": SPARSITY})


def _hybrid_mask(w, kinds, tile):
    """Dense tiles all kept; elsewhere the two largest |w| of each group of 4 along K."""
    import torch

    n, k = w.shape
    top2 = w.abs().reshape(n, k // 4, 4).topk(2, dim=-1).indices
    keep24 = torch.zeros(n, k // 4, 4, dtype=torch.bool).scatter_(-1, top2, True).reshape(n, k)
    dense = (kinds == 0).repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:n, :k]
    return dense | keep24


def llama7b_plan(blocks: int = 32, seed: int = 0):
    """TilePlan shaped like LLaMA-2-7B's block linears (fp16, 128 x 128 tiles, random 35% hybrid kinds)."""
    import torch

    from patchc.bench.layers import tile_kinds
    from patchc.ir import LayerPlan, TilePlan

    gen = torch.Generator().manual_seed(seed)
    tile, dtype, layers = (128, 128), torch.float16, {}
    pattern01 = torch.tensor(0x44, dtype=torch.uint8)  # every group keeps positions 0 and 1 (nibble 0|1<<2)
    for b in range(blocks):
        for part, (n, k) in LLAMA7B.items():
            fqn = f"model.layers.{b}.{part}.weight"
            kinds = tile_kinds(n, k, tile, SPARSITY, gen)
            nd, ns = int((kinds == 0).sum()), int((kinds == 1).sum())
            layers[fqn] = LayerPlan(
                name=fqn, shape=(n, k), tile=tile, kinds=kinds, dtype=dtype,
                dense=torch.zeros((), dtype=dtype).expand(nd, *tile),
                values=torch.zeros((), dtype=dtype).expand(ns, tile[0], tile[1] // 2),
                meta=pattern01.expand(ns, tile[0], tile[1] // 8),
            )
    return TilePlan(layers=layers, skipped={}, meta={"source": "bench_generate", "sparsity": SPARSITY})


def run_one(name: str, plan, out: Path, target: str, workers: int | None) -> dict:
    from patchc.codegen import generate

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    files = generate(plan, out, target=target, workers=workers)
    seconds = time.perf_counter() - t0
    index = json.loads((out / "manifest.json").read_text())
    row = {"plan": name, "layers": len(plan.layers), "seconds": round(seconds, 1), "files": len(files),
           "bytes": sum(f.stat().st_size for f in files), **{f"kernels_{k}": v for k, v in index["kernels"].items()}}
    print(f"{name:<10} {row['layers']:>4} layers  {row['kernels_variants']:>5} variants  "
          f"{row['kernels_compiled']:>3} distinct compiles  {row['files']:>5} files  {row['bytes'] / 2**20:8.1f} MiB  "
          f"{seconds:7.1f} s", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="+", choices=("stories", "7b"), default=["stories", "7b"])
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--workers", type=int, default=None, help="compile processes (default: the CPU count)")
    ap.add_argument("--blocks", type=int, default=32, help="transformer blocks of the 7B-shaped plan")
    ap.add_argument("--warm", action="store_true", help="keep Triton's compile cache (default: start empty)")
    ap.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="patchc-bench-generate-"))
    if not args.warm:  # before triton is imported; spawned workers inherit it
        os.environ["TRITON_CACHE_DIR"] = str(scratch / "triton-cache")
    os.environ.pop("TRITON_INTERPRET", None)
    rows = []
    try:
        for name in args.plans:
            t0 = time.perf_counter()
            plan = stories_plan() if name == "stories" else llama7b_plan(args.blocks)
            print(f"{name}: plan of {len(plan.layers)} layers built in {time.perf_counter() - t0:.1f} s", flush=True)
            rows.append(run_one(name, plan, scratch / name, args.target, args.workers))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not args.no_record:
        from patchc.bench.record import record_run
        from patchc.codegen.sass import sass_cache_dir

        record_run(RESULTS, {
            "bench": "generate", "target": args.target, "workers": args.workers or os.cpu_count(),
            "triton_cache": "warm" if args.warm else "cold", "blocks_7b": args.blocks, "rows": rows,
            # the SASS patchc keeps beside Triton's cache (`patchc.codegen.sass.disassemble`)
            "sass_cache": "off" if sass_cache_dir() is None else "on"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
