"""Held-out quality of low-memory mask training against today's default, on stories260K, 3 seeds.

Run: python benchmarks/quality_lowmem.py [--seeds 0 1 2] [--steps 300]

The job's own pieces and defaults (`PruneOptions()`: 300 steps, batch 8, block 128, tiles 16x16,
sparsity 0.35, SparseGPT prior, KD loss on real + self-generated text): load_data -> calibrate ->
SparseGPT prior -> transform -> train_masks(optim=...) -> harden (exact budget) -> perplexity on the
held-out documents. Only the optimizer's memory mode (and the 4-score 2:4
parametrisation) changes between rows; the seed sets the mask init, the noise and the batch order, so
seed s of each row sees the same batches. Prints mean and std (n-1) of the held-out perplexity per
row and the paired per-seed differences, and appends one JSON line to
benchmarks/results/quality_lowmem.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "quality_lowmem.jsonl"

# row -> (MaskOptimConfig kwargs, PatchConfig changes)
ROWS = {
    "default": ({}, {}),
    "low": ({"memory": "low"}, {}),
    "low-4": ({"memory": "low"}, {"nm_param": "weight"}),
    "default-4": ({}, {"nm_param": "weight"}),
    "low-4v": ({"memory": "low", "v_per_group": True}, {"nm_param": "weight"}),
}


def prepare(opts):
    """Model, text, calibration and the SparseGPT prior: shared by every row and seed."""
    from patchc.job import stages
    from patchc.job.corpus import load_data
    from patchc.job.model import choose_threads
    from patchc.models import load_model

    bundle = load_model(opts.model, device=opts.device)
    choose_threads(opts, bundle.model)
    data = load_data(bundle, opts, cache_dir=ROOT / "runs" / ".cache")
    calib = stages.calibrate(bundle, data, opts)
    prior = stages.oneshot_masks(bundle, opts.prior, calib)
    dense = stages.evaluate(bundle, bundle.model, data, opts)["perplexity"]
    return bundle, data, calib, prior, dense


def train_one(bundle, data, calib, prior, opts, row: str, impl: str | None = None) -> dict:
    """One PATCH run as `patchc prune` trains it, with row's optimizer mode; returns its numbers."""
    import patchc
    from patchc.job import stages
    from patchc.masking.optim import MaskOptimConfig

    optim_kw, cfg_kw = ROWS[row]
    cfg = dataclasses.replace(opts.patch_config(steps=opts.steps), **cfg_kw)
    prog = patchc.transform(bundle.export(bundle.model), cfg, calib=calib, prior_masks=prior)
    if cfg_kw and not all(m.nm_logits.shape[-1] == 4 for m in prog.layers.values()):
        raise RuntimeError(f"row {row}: transform did not build 4-score masks for nm_param='weight'")
    if impl:
        for m in prog.layers.values():
            m.impl = impl
    loss_fn = stages.make_loss(bundle, bundle.model, opts)
    start = time.perf_counter()
    result = patchc.train_masks(prog, stages.make_batches(bundle, data, opts), lambda _p, b: loss_fn(prog, b),
                                steps=opts.steps, lr=opts.lr, tile_lr=opts.tile_lr, optim=MaskOptimConfig(**optim_kw), progress=False)
    seconds = time.perf_counter() - start
    plan = patchc.harden(prog, exact_budget=opts.exact_budget)
    ppl = stages.evaluate(bundle, plan.apply(bundle.reload()), data, opts)["perplexity"]
    return {"row": row, "seed": opts.seed, "perplexity": ppl, "sparsity": plan.sparsity, "train_s": round(seconds, 1),
            "final_task": result.history[-1]["task"]}


def summarise(runs: list[dict], rows: list[str]) -> dict:
    by = {r: {x["seed"]: x["perplexity"] for x in runs if x["row"] == r} for r in rows}
    out = {}
    for r in rows:
        vals = list(by[r].values())
        out[r] = {"mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}
        if r != "default" and "default" in by:
            diffs = [by[r][s] - by["default"][s] for s in by[r] if s in by["default"]]
            out[r]["paired_diff_mean"] = statistics.mean(diffs) if diffs else None
            noise = max(out["default"]["std"], out[r]["std"])
            out[r]["within_seed_noise"] = abs(out[r]["mean"] - out["default"]["mean"]) <= noise
            out[r]["no_worse"] = out[r]["mean"] <= out["default"]["mean"] + noise  # within noise, or better
    return out


def read_runs(paths: list[str]) -> tuple[list[dict], float]:
    """The run lines (JSON) and the dense perplexity line of earlier outputs; duplicates (row, seed) refused."""
    runs, dense, seen = [], float("nan"), set()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.startswith("dense perplexity "):
                dense = float(line.split()[-1])
            elif line.startswith("{"):
                run = json.loads(line)
                if (run["row"], run["seed"]) in seen:
                    raise ValueError(f"{path}: row {run['row']} seed {run['seed']} appears twice")
                seen.add((run["row"], run["seed"]))
                runs.append(run)
    return runs, dense


def main(argv: list[str] | None = None) -> None:
    from patchc.job.model import with_tile
    from patchc.job.options import PruneOptions

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=PruneOptions.steps)
    p.add_argument("--rows", nargs="+", choices=tuple(ROWS), default=None,
                   help="default: default, low, low-4, low-4v")
    p.add_argument("--impl", default=None, help="the masks' sampling implementation (HybridMask.impl); default: its default")
    p.add_argument("--runs-from", nargs="+", default=None, metavar="LOG",
                   help="summarise and record the run lines printed by earlier invocations (e.g. one per seed, "
                        "run side by side) instead of training")
    p.add_argument("--no-record", action="store_true")
    a = p.parse_args(argv)
    rows = a.rows or ["default", "low", "low-4", "low-4v"]
    base = PruneOptions(steps=a.steps, progress=False)
    if a.runs_from:
        runs, dense = read_runs(a.runs_from)
        rows = [r for r in ROWS if any(x["row"] == r for x in runs)]
    else:
        bundle, data, calib, prior, dense = prepare(base)
        base = with_tile(base, bundle)  # the job's tile for the model (16 x 16 for stories260K)
        print(f"dense perplexity {dense:.3f}", flush=True)
        runs = []
        for seed in a.seeds:
            for row in rows:
                runs.append(train_one(bundle, data, calib, prior, dataclasses.replace(base, seed=seed), row, a.impl))
                print(json.dumps(runs[-1]), flush=True)
    summary = summarise(runs, rows)
    for r, s in summary.items():
        extra = (f"   paired diff {s['paired_diff_mean']:+.3f}  within seed noise: {s['within_seed_noise']}"
                 f"  no worse: {s['no_worse']}"
                 if "paired_diff_mean" in s else "")
        print(f"{r:<10} perplexity {s['mean']:.3f} +- {s['std']:.3f} (n={s['n']}){extra}")
    if not a.no_record:
        from patchc.utils.env import device_name, versions
        from patchc.utils.files import write_bytes_atomic

        line = {"bench": "quality_lowmem", "command": "python benchmarks/quality_lowmem.py " + " ".join(sys.argv[1:]),
                "model": base.model, "steps": a.steps, "lr": base.lr, "tile_lr": base.tile_lr,
                "lambda_norm": base.lambda_norm, "impl": a.impl or "default", "dense_perplexity": dense, "runs": runs, "summary": summary,
                "device": device_name("cpu"), "versions": versions(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        old = RESULTS.read_bytes() if RESULTS.exists() else b""
        write_bytes_atomic(RESULTS, old + (json.dumps(line) + "\n").encode())


if __name__ == "__main__":
    main()
