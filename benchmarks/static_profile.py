"""Static profile of the generated kernels for LLaMA-2-7B shapes, without a GPU.

    python benchmarks/static_profile.py                       # sm_80 and sm_90, 25/35/45/50%, fp16
    python benchmarks/static_profile.py --target sm_90 --sparsity 0.45
    python benchmarks/static_profile.py --issue-matrix        # the decode issue's grid: its static targets
    python benchmarks/static_profile.py --by-triton           # table of the records by Triton version (`make compat`)
    python benchmarks/static_profile.py --unpack              # the unpack kernel of the prefill route "unpacked"
    python benchmarks/static_profile.py --prefill-kernels     # the GEMM and the decode kernel at prefill tiles

For each shape, sparsity (random tile map, as in `patchc bench`) and target, compiles the layer's kernels
with `patchc.codegen.generate` and prints, per variant, what a profiler would show first: registers per
thread, spill bytes, the SASS instruction mix (128-bit loads, cp.async, HMMA / HGMMA) and the weight bytes
the kernel reads against dense (the decode ceiling is dense / packed bytes), and per weight loop the
warp-instructions issued per weight byte (above ~0.28 an H100 cannot be memory bound) and, for decode variants
serving M <= 16, the static targets they miss (`patchc.codegen.sass.LOOP_TARGETS`). Appends one JSON line with
versions and date to benchmarks/results/static_profile.jsonl. Runs on CPU: this is what can be said about
the kernels' speed where no GPU is lent; the timings come from `patchc bench` (`make gpu`) on a GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from patchc.bench.layers import DTYPES, tile_kinds  # noqa: E402
from patchc.bench.options import LLAMA7B_SHAPES as SHAPES  # noqa: E402


def ceiling(s: float) -> float:
    """Decode speedup bound when only weight bytes count: 2:4 tiles cost 1.125 / 2 of dense."""
    return 1.0 / (1.0 - 0.875 * s)


def profile_layer(layer, target: str, work: Path) -> tuple[list[dict], dict]:
    """Generate one layer's kernels for `target`: (per-variant rows with their static profile, layer manifest)."""
    from patchc.codegen import generate
    from patchc.ir import TilePlan

    out = work / target / layer.name
    generate(TilePlan({layer.name: layer}), out, target=target)
    index = json.loads((out / "manifest.json").read_text())
    man = json.loads((out / index["layers"][layer.name]["manifest"]).read_text())
    return [
        {"variant": v["name"], "num_warps": v["num_warps"], "num_stages": v["num_stages"],
         "split_k": v.get("split_k"), "block": man["block"], **(v["profile"] or {}),
         "loops": {lp["loop"]: {k: lp[k] for k in ("warp_instr_per_byte", "warp_instr_per_kflop", "instructions",
                                                    "weight_bytes", "barriers", "shuffles", "ldg128") if k in lp}
                   for lp in v.get("loops") or []},
         **({"target_misses": v["target_misses"]} if "target_misses" in v else {})}
        for v in man["variants"]
    ], man


VARIANT_CLASS = {"decode_m1": "decode, M <= 4", "decode_m4": "decode, M <= 4", "decode": "decode, M 5-16",
                 "prefill": "prefill"}


def by_triton(path: Path) -> str:
    """Markdown: per (Triton, groups per load, target), the range of the 2:4 loops' warp-instructions per weight
    byte and barriers over the newest record of each, per variant class; and the prefill 2:4 loop's per kFLOP
    (bound by compute: what counts there; "-" in records from before it was recorded)."""
    from patchc.codegen.configs import groups_per_load

    newest: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        groups = rec.get("groups_per_load") or groups_per_load(rec["triton"])
        # the generated variants' records, not `--unpack`'s or `--prefill-kernels`' (rows without a variant)
        for target in {r["target"] for r in rec["results"] if "loops" in r and "variant" in r}:
            newest[(rec["triton"], groups, target)] = rec  # later lines win
    classes = list(dict.fromkeys(VARIANT_CLASS.values()))
    lines = ["| Triton | groups per load | target | " + " | ".join(f"{c}: w-instr/B, barriers" for c in classes)
             + " | prefill: w-instr/kFLOP |", "|---|---:|---|" + "---|" * (len(classes) + 1)]
    for (triton, groups, target), rec in sorted(newest.items()):
        cells = []
        for c in classes:
            loops = [r["loops"]["2:4"] for r in rec["results"] if r["target"] == target and "2:4" in r.get("loops", {})
                     and VARIANT_CLASS.get(r["variant"]) == c]
            w = [lp["warp_instr_per_byte"] for lp in loops]
            b = [lp["barriers"] for lp in loops]
            cells.append(f"{min(w):.3f}–{max(w):.3f}, {min(b)}–{max(b)}" if loops else "-")
        kflop = [r["loops"]["2:4"]["warp_instr_per_kflop"] for r in rec["results"] if r["target"] == target
                 and "warp_instr_per_kflop" in r.get("loops", {}).get("2:4", {})]
        cells.append(f"{min(kflop):.2f}–{max(kflop):.2f}" if kflop else "-")
        lines.append(f"| {triton} | {groups} | {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def unpack_rows(args: argparse.Namespace) -> list[dict]:
    """`unpack_kernel.static_cost` per target, dtype, block and with / without dense blocks, printed."""
    from patchc.codegen.configs import normalize_target
    from patchc.codegen.unpack_kernel import static_cost

    blocks = sorted({(side, side) for side in args.tile} | {(128, 64)})
    rows = []
    for target, dtype, block, dense in itertools.product(args.target, args.dtype, blocks, (True, False)):
        cc = int(normalize_target(target).removeprefix("sm_"))
        r = {"target": target, "kernel": "unpack", **static_cost(cc, dtype, block, dense)}
        rows.append(r)
        print(f"{target} unpack {dtype} block {block} {'dense + 2:4' if dense else '2:4 only':<11} "
              f"regs {r.get('registers', '?'):>3} spill {r.get('spill_bytes', '?')} B  LDG.128 {r.get('ldg128', '?')} "
              f"STG.128 {r.get('stg128', '?')}  {r.get('instructions', '?')} instr: "
              f"{r.get('w_instr_per_byte', float('nan')):.3f} w-instr/B of a 2:4 block", flush=True)
    return rows


PREFILL_TILES = ((128, 8), (256, 8))  # (tokens a program, warps) timed at prefill sizes by both kernels


def prefill_kernel_rows(args: argparse.Namespace) -> list[dict]:
    """Both hybrid kernels that can serve prefill (the tiled GEMM and the decode kernel, weights on the product's
    M side) at prefill tiles, per --target x --shape x --sparsity x --dtype x --tile: each weight loop's
    warp-instructions per 1,000 FLOPs against the target's issue budget (`sass.MMA_ISSUE_BUDGET`), printed."""
    from patchc.codegen.compile_pool import CompileJob, compile_all
    from patchc.codegen.configs import KernelConfig, choose_block, normalize_target, resolve_config
    from patchc.codegen.reference import random_layer_plan
    from patchc.codegen.sass import MMA_ISSUE_BUDGET
    from patchc.codegen.skeleton import pack_skeleton
    from patchc.codegen.specialise import signature, specialisation
    from patchc.ir import TilePlan

    shapes = [(4096, 4096)] if args.shape is None else [tuple(int(v) for v in s.lower().split("x")) for s in args.shape]
    jobs: dict[CompileJob, list[str]] = {}
    rows = []
    for target, (n, k), s, dtype, side in itertools.product(args.target, shapes, args.sparsity, args.dtype, args.tile):
        arch, tile = normalize_target(target), (side, side)
        layer = random_layer_plan(n, k, tile=tile, kinds=tile_kinds(n, k, tile, s, torch.Generator().manual_seed(0)),
                                  dtype=DTYPES[dtype], name="w.weight")
        skel = pack_skeleton(TilePlan({layer.name: layer}), layer.name, block=choose_block(tile, arch))
        for kernel, (bm, warps) in itertools.product(("prefill", "decode"), PREFILL_TILES):
            cfg = resolve_config(KernelConfig(kernel, bm, split_k=1, num_warps=warps, num_stages=3), skel, 2048, arch)
            job = CompileJob(kernel, tuple(signature(dtype).items()),
                             tuple(specialisation(skel, cfg, DTYPES[dtype], False).items()), warps, 3,
                             int(arch.removeprefix("sm_")))
            jobs.setdefault(job, [])
            rows.append({"target": target, "N": n, "K": k, "sparsity": s, "dtype": dtype, "tile": side,
                         "kernel": kernel, "block_m": bm, "num_warps": warps, "block": list(skel.block), "job": job})
    compiled = compile_all(jobs, show_progress=False)
    for r in rows:
        kern = compiled[r.pop("job")]
        flops = 2 * r["block_m"] * r["block"][0] * r["block"][1]  # one iteration: tokens x block
        r.update(registers=(kern.profile or {}).get("registers"), spill_bytes=(kern.profile or {}).get("spill_bytes"),
                 budget=round(MMA_ISSUE_BUDGET[normalize_target(r["target"])], 3),
                 loops={lp["loop"]: {"instructions": lp["instructions"], "barriers": lp["barriers"],
                                     "warp_instr_per_kflop": round(lp["instructions"] * r["num_warps"] * 1e3 / flops,
                                                                   3)}
                        for lp in kern.loops or []})
        loops = "  ".join(f"{kind} {lp['warp_instr_per_kflop']:.2f} w-instr/kFLOP ({lp['instructions']} instr, "
                          f"{lp['barriers']} bar)" for kind, lp in r["loops"].items())
        print(f"{r['target']} {r['N']}x{r['K']} s={r['sparsity']:.2f} {r['dtype']} tile {r['tile']} {r['kernel']:<7} "
              f"{r['block_m']} tokens, {r['num_warps']} warps: regs {r['registers']} spill {r['spill_bytes']} B  "
              f"{loops}  (budget {r['budget']})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", nargs="+", default=["sm_80", "sm_90"])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.35, 0.45, 0.50])
    ap.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=["fp16"])
    ap.add_argument("--tile", type=int, nargs="+", default=[128], help="square tile sides")
    ap.add_argument("--shape", nargs="+", default=None, help="N x K shapes (e.g. 4096x11008); default LLaMA-2-7B's")
    ap.add_argument("--issue-matrix", action="store_true",
                    help="the decode issue's grid: 4096x4096 and 4096x11008, mixed 45%% and all-2:4, fp16 and bf16, "
                         "tiles 128 and 64, sm_80 and sm_90; exits 1 when a static target is missed")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "static_profile.jsonl")
    ap.add_argument("--unpack", action="store_true",
                    help="profile the unpack kernel (W*M written dense for cuBLAS) for --target x --dtype x --tile "
                         "blocks (128 x 64 besides), with and without dense blocks")
    ap.add_argument("--prefill-kernels", action="store_true",
                    help="compile both kernels that can serve prefill (the tiled GEMM, the decode kernel) at 128 and "
                         "256 tokens a program and print each loop's warp-instructions per 1,000 FLOPs (default "
                         "shape 4096x4096)")
    ap.add_argument("--by-triton", action="store_true",
                    help="print a markdown table of the 2:4 loops in --out's records, by Triton version and target")
    args = ap.parse_args(argv)
    if args.by_triton:
        print(by_triton(args.out))
        return 0
    if args.issue_matrix:
        args.shape, args.sparsity, args.dtype, args.tile = ["4096x4096", "4096x11008"], [0.45, 0.5], ["fp16", "bf16"], [128, 64]
    shapes = SHAPES if args.shape is None else [tuple(int(v) for v in s.lower().split("x")) for s in args.shape]
    os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the real Triton, not the interpreter
    from patchc.codegen import kernels
    from patchc.codegen.reference import random_layer_plan
    from patchc.utils.env import versions

    rows = unpack_rows(args) if args.unpack else prefill_kernel_rows(args) if args.prefill_kernels else []
    with tempfile.TemporaryDirectory() as tmp:
        for target, (n, k), s, dtype, side in itertools.product(args.target, shapes, args.sparsity, args.dtype,
                                                                 args.tile) if not rows else ():
            tile = (side, side)
            gen = torch.Generator().manual_seed(0)
            name = f"s{round(100 * s)}_{n}x{k}_{dtype}_t{side}.weight"
            layer = random_layer_plan(n, k, tile=tile, kinds=tile_kinds(n, k, tile, s, gen), dtype=DTYPES[dtype],
                                      name=name)
            variants, man = profile_layer(layer, target, Path(tmp))
            bytes_ratio = man["dense_bytes"] / man["weight_bytes"]
            for v in variants:
                row = {"target": target, "N": n, "K": k, "sparsity": s, "dtype": dtype, "tile": side,
                       "bytes_ratio": bytes_ratio, "ceiling": ceiling(s), **v}
                rows.append(row)
                loops = "  ".join(f"{kind} loop {lp['warp_instr_per_byte']:.3f} w-instr/B ({lp['instructions']} instr, "
                                  f"{lp['weight_bytes']} B, {lp['barriers']} bar, {lp['ldg128']} LDG.128)"
                                  + (f" {lp['warp_instr_per_kflop']:.2f} w-instr/kFLOP" if "warp_instr_per_kflop" in lp
                                     else "") for kind, lp in v["loops"].items())
                if v.get("target_misses"):
                    loops += "  MISSES: " + "; ".join(v["target_misses"])
                print(f"{target} {n:>5}x{k:<5} s={s:.2f} {dtype} tile {side:<3} {v['variant']:<17} block {v['block']} "
                      f"warps {v['num_warps']} split_k {v['split_k'] or '-':<2} regs {v.get('registers', '?'):>3} "
                      f"spill {v.get('spill_bytes', '?'):>3} B  LDG.128 {v.get('ldg128', '?'):>3} "
                      f"LDGSTS {v.get('ldgsts', '?'):>3} HMMA {v.get('hmma', '?'):>3} HGMMA {v.get('hgmma', '?'):>2}  "
                      f"dense/packed bytes {bytes_ratio:.3f} (ceiling {ceiling(s):.3f})  {loops}", flush=True)
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": "none (static: cubins compiled on CPU)",
        **versions(),
        "groups_per_load": kernels.GROUPS_PER_LOAD.value,
        "dtype": args.dtype,
        "tile": args.tile,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:  # append-only log: earlier runs are never rewritten
        f.write(json.dumps(record) + "\n")
    print(f"appended {len(rows)} rows to {args.out}")
    missed = [r for r in rows if r.get("target_misses")]
    print(f"static targets: {len(missed)} of {sum('target_misses' in r for r in rows)} decode variants (M <= 16) miss")
    return 1 if args.issue_matrix and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
