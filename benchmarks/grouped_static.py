"""Static cost of the grouped MoE kernels against the single-layer ones they share their loops with, no GPU.

Compiles `decode` / `prefill` and `grouped_decode` / `grouped_prefill` for one mixed layer shape (blocks per
row varying, as in real plans) and prints each weight loop's warp-instructions per weight byte side by side,
with registers and spills. Under another Triton: `PYTHONPATH=.venv/triton-3.6.0:. python benchmarks/grouped_static.py`
(the wheels `make compat` installs).

    .venv/bin/python benchmarks/grouped_static.py                      # 4096 x 4096, fp16 and bf16, sm_80 and sm_90
    .venv/bin/python benchmarks/grouped_static.py --experts 256 --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels only


def signature(dtype: str, grouped: bool) -> tuple[tuple[str, str], ...]:
    """The single-layer kernels' arguments (`specialise.signature`); the grouped ones take offs_ptr before M."""
    from patchc.codegen.specialise import signature as kernel_signature

    sig = [(a, t) for a, t in kernel_signature(dtype).items() if a != "M"]
    return tuple(sig + ([("offs_ptr", "*i32")] if grouped else []) + [("M", "i32")])


def profile(kernel: str, dtype: str, cc: int, shape: tuple[int, int], experts: int) -> dict:
    from patchc.codegen.compile_pool import CompileJob, compile_job

    decode = kernel.endswith("decode")
    consts = dict(N=shape[0], K=shape[1], BLOCK_M=16 if decode else 128, BLOCK_N=128, BLOCK_K=64,
                  SPLIT_K=2 if decode else 1, FIXUP=decode, HAS_DENSE=True, HAS_SPARSE=True, DENSE_PER_ROW=-1,
                  SPARSE_PER_ROW=-1, HAS_BIAS=False, EVEN_K=shape[1] % 64 == 0, DOT_PRECISION="tf32")
    if not decode:
        consts["GROUP_M"] = 8
    if kernel.startswith("grouped"):
        consts.update(NUM_EXPERTS=experts, EXPERTS_P2=1 << (experts - 1).bit_length())
    job = CompileJob(kernel, signature(dtype, kernel.startswith("grouped")), tuple(consts.items()),
                     4 if decode else 8, 1 if decode else 3, cc)
    done = compile_job(job)
    return {"registers": done.profile["registers"], "spills": done.profile["spill_bytes"],
            **{lp["loop"]: lp["warp_instr_per_byte"] for lp in done.loops or []}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096", help="N x K of one expert slice")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dtype", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"])
    ap.add_argument("--target", nargs="+", type=int, default=[80, 90], help="compute capabilities")
    args = ap.parse_args(argv)
    import triton

    shape = tuple(int(v) for v in args.shape.lower().split("x"))
    print(f"Triton {triton.__version__}, slice {shape[0]} x {shape[1]}, {args.experts} experts: warp-instructions "
          "per weight byte (single-layer -> grouped)\n")
    print("| target | dtype | kernel | dense loop | 2:4 loop | registers | spills |\n|---|---|---|---:|---:|---:|---:|")
    for cc in args.target:
        for dtype in args.dtype:
            for kind in ("decode", "prefill"):
                a, b = (profile(k, dtype, cc, shape, args.experts) for k in (kind, f"grouped_{kind}"))
                print(f"| sm_{cc} | {dtype} | {kind} | {a.get('dense')} -> {b.get('dense')} | {a.get('2:4')} -> "
                      f"{b.get('2:4')} | {a['registers']} -> {b['registers']} | {a['spills']} -> {b['spills']} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
