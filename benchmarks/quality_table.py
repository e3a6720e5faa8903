"""The paper's quality table on stories260K: dense, one-shot 2:4, learned 2:4, PATCH joint 25/35/45%,
PATCH tile-only 35%, and global vs layer-wise density at 35% (same steps).

    python benchmarks/quality_table.py --steps 600      # appends to benchmarks/results/quality_stories260K.jsonl

Each configuration is trained with the main job's own stages (`patchc.job.prune`), on the training part of
TinyStories, and scored by perplexity on the held-out documents.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from pathlib import Path

import torch

from patchc.utils.env import device_name, versions
from patchc.job.options import PruneOptions
from patchc.job.prune import calibrate, choose_threads, evaluate, load_data, oneshot_baseline, train
from patchc.models import load_model

RESULTS = Path(__file__).parent / "results" / "quality_stories260K.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    opts = PruneOptions(steps=args.steps, batch_size=args.batch_size, seed=args.seed, progress=False)
    bundle = load_model(opts.model)
    choose_threads(opts, bundle.model)
    data = load_data(bundle, opts)
    calib = calibrate(bundle, data, opts)
    rows = [{"name": "dense", "sparsity": 0.0, **evaluate(bundle, bundle.model, data, opts)}]
    for method in ("magnitude", "wanda", "sparsegpt"):
        rows.append({"name": f"{method} 2:4 (one-shot)", "sparsity": 0.5, **evaluate(bundle, oneshot_baseline(bundle, method, calib), data, opts)})
    runs = [
        ("learned 2:4 (nm)", dict(variant="nm", sparsity=0.5)),
        # The paper starts tau at 4 for 45% over 2000 steps; over a few hundred steps that extra
        # exploration does not settle (300 steps: perplexity 15.6 with tau0 = 4, 12.5 with tau0 = 2).
        ("PATCH joint 45%", dict(sparsity=0.45)),
        ("PATCH joint 35%", dict(sparsity=0.35)),
        ("PATCH joint 25%", dict(sparsity=0.25)),
        # The paper's tile-only kappa / lambdas; its lr 1e-4 is for 2000 steps at 7B, too slow for 300 steps.
        ("PATCH tile-only 35%", dict(variant="tile", sparsity=0.35, kappa_tile=(100.0, 500.0), lambda_density=3.0, lambda_norm=0.1)),
        ("PATCH joint 35% layer-wise", dict(sparsity=0.35, scope="block")),
    ]
    for name, changes in runs:
        run_opts = dataclasses.replace(opts, **changes)
        start = time.perf_counter()
        plan, _ = train(bundle, run_opts.patch_config(), data, run_opts, calib, None, False)
        metrics = evaluate(bundle, plan.apply(bundle.reload()), data, run_opts)
        rows.append({"name": name, "sparsity": round(plan.sparsity, 4), **metrics, "seconds": round(time.perf_counter() - start, 1)})
        print(f"{name:<30} sparsity {plan.sparsity:6.1%}  perplexity {metrics['perplexity']:8.3f}", flush=True)
    record = {"date": datetime.date.today().isoformat(), "device": device_name("cpu"), "versions": versions(),
              "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed, "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    for r in rows:
        print(f"| {r['name']} | {r['sparsity']:.0%} | {r['perplexity']:.2f} |")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
