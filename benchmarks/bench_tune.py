"""What tuning one 7B-shaped layer costs on this GPU, and what it buys over the default configs.

Builds a LLaMA-2-7B-shaped layer (45% sparse, 128 x 128 tiles, fp16) and runs `tune_plan` on it with no
tune cache, counting the configs timed and the wall time (Triton's in-process kernel cache starts empty;
set TRITON_CACHE_DIR to an empty folder for a cold disk cache too). Then times the tuned and the default
`TileLinear` at decode M with `do_bench`, against cuBLAS on the dense W*M in the same run. Appends a
record to benchmarks/results/tune.jsonl.

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/bench_tune.py                     # threads: the CPUs, <= 16
    TRITON_CACHE_DIR=$(mktemp -d) PATCHC_COMPILE_THREADS=1 python benchmarks/bench_tune.py   # one compile at a time
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096x4096", help="N x K of the layer")
    p.add_argument("--sparsity", type=float, default=0.45)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16])
    p.add_argument("--device", default="cuda", help="cpu: the same steps on the reference kernels (a check of this "
                   "script; TRITON_INTERPRET=1, timings mean nothing)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tune.jsonl")
    args = p.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench_tune: needs a CUDA GPU (--device cpu checks the script on CPU)", file=sys.stderr)
        return 2
    from patchc.bench.layers import make_input, make_layer
    from patchc.bench.options import LayerCase
    from patchc.bench.record import source_digest
    from patchc.ir import TilePlan
    from patchc.runtime import TileLinear, tune_plan
    from patchc.bench.layers import cpu_timer
    from patchc.runtime.timing import compile_threads, do_bench

    bench = do_bench if dev == "cuda" else cpu_timer(reps=1, warmup=0)
    from patchc.utils.env import device_name, versions

    n, k = (int(v) for v in args.shape.lower().split("x"))
    layer = make_layer(LayerCase((n, k), args.sparsity, (128, 128), "fp16", ()), seed=0)
    plan = TilePlan(layers={layer.name: layer}, skipped={}, meta={})
    timed = [0]

    def counting(fn):
        timed[0] += 1
        if timed[0] % 10 == 0:  # a run cut short still says how far it got
            print(f"  {timed[0]} configs timed, {time.perf_counter() - t0:.1f} s", flush=True)
        return bench(fn)

    t0 = time.perf_counter()
    tuning = tune_plan(plan, 16, 128, torch.float16, dev, cache=False, progress=False, time_fn=counting)[layer.name]
    tune_s = time.perf_counter() - t0
    w = layer.to_dense().to(dev, torch.float16)
    tuned = TileLinear.from_plan(layer, tuning, dtype=torch.float16, device=dev)
    default = TileLinear.from_plan(layer, dtype=torch.float16, device=dev)
    rows = []
    for m in args.ms:
        x = make_input(m, k, torch.float16, dev, m)
        ms = {name: bench(fn)
              for name, fn in (("dense", lambda: F.linear(x, w)), ("tuned", lambda: tuned(x)),
                               ("default", lambda: default(x)))}
        rows.append({"M": m, **{f"{k_}_ms": v for k_, v in ms.items()},
                     "tuned_speedup": ms["dense"] / ms["tuned"], "default_speedup": ms["dense"] / ms["default"]})
        print(f"M={m}: dense {1e3 * ms['dense']:.1f} us, tuned {1e3 * ms['tuned']:.1f} us "
              f"({rows[-1]['tuned_speedup']:.2f}x), default {1e3 * ms['default']:.1f} us ({rows[-1]['default_speedup']:.2f}x)")
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_name(dev), **versions(), "source_digest": source_digest(), "shape": [n, k], "sparsity": args.sparsity,
              "compile_threads": compile_threads() if dev == "cuda" else 0, "tune_s": tune_s, "configs_timed": timed[0],
              "decode": str(tuning.decode), "prefill": str(tuning.prefill), "threshold": tuning.threshold, "rows": rows,
              "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR")}
    print(f"tuned in {tune_s:.1f} s ({timed[0]} configs timed, {record['compile_threads']} compile threads): "
          f"decode {tuning.decode}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
