"""Command line: `patchc prune | eval | recover | sample | export | import | report | generate | tune | bench`.

    patchc prune                                   # the embedded default: stories260K, TinyStories, 35%
    patchc prune --model M --data a.txt --sparsity 0.45 --tile 32 32 --out runs/x
    patchc eval runs/x                             # dense vs pruned on the plan's own held-out text
    patchc sample --tokens 65536 --out gen.txt     # the dense model's own text, for another run's --train-extra
    patchc export runs/x --out pruned/             # HF-style folder, planned weights compressed
    patchc import sparse-2of4/ --out served/       # a model already 2:4 (zeros, or sparse-24-bitmask) as one
    patchc report runs/x/plan.patch                # redraw the plots (and report.md) from a plan
    patchc generate runs/x/plan.patch --target sm_90 --out kernels/
    patchc tune runs/x/plan.patch --batch-size 16 --prefill-len 128
    patchc bench                                   # GPU proof: correctness + speed + end to end (make gpu)
    patchc bench --dry-run --out runs/bench        # the same harness on CPU (Triton interpreter, tiny shapes)

A user error (bad flag value, missing file, a run folder in use, ...) prints one line,
`patchc <command>: error: ...`, and exits with status 2; `--debug` shows the traceback instead.
Warnings always show; `-v` adds what patchc decided on the way (INFO: tuning, exports, --offload's
prefetch), `-vv` its DEBUG lines too (each config the tuner could not compile, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path

from patchc.bench.options import add_bench_arguments
from patchc.export.shards import add_shard_argument
from patchc.job.console import USER_ERRORS, HelpFormatter, add_output_flags, one_line
from patchc.job.options import DEFAULT_DATA, DEFAULT_MODEL, LOSSES, PruneOptions
from patchc.job.prune_args import add_prune_arguments, positive_int, prune_options
from patchc.job.runs import check_plan_path, check_served_path, find_plan, resolve_plan
from patchc.utils.files import check_writable
from patchc.utils.progress import logs_shown, warnings_as_lines

# Each command imports what it runs (torch, Triton): --help, flag errors, missing paths answer at once (test_cli.py).

OFFLOAD_HELP = "a model larger than the GPU: its blocks wait in host memory, each copied to --device for its forward"


def cmd_prune(args: argparse.Namespace) -> int:
    opts = prune_options(args)  # every flag checked before torch is imported
    from patchc.job.prune import run_prune
    from patchc.job.report import format_results, scored_files

    report = run_prune(opts, command=args.command_line)
    if not report:  # a torchrun rank other than 0
        return 0
    unit = "tokens" if report["kind"] == "causal" else "sentences"
    print(f"\n{report['model']}: {report['metric']} on held-out text ({report['data']['eval_tokens']} {unit})"
          + scored_files(report["data"].get("eval_extra_tokens") or {}, report["kind"], args.eval_tokens))
    print(format_results(report))
    out = Path(report["files"]["plan"]).parent.resolve()
    print(f"\nplan density {report['plan']['density']:.4f} (target {1 - args.sparsity:.4f}); files in {out}:")
    for name, path in report["files"].items():
        print(f"  {name:<24} {path}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from patchc.job.rescore import format_rescore, rescore

    r = rescore(resolve_plan(args.plan), allow_overlap=args.allow_overlap, force=args.force, model=args.model,
                data=args.data, seed=args.split_seed, eval_fraction=args.eval_fraction, eval_context=args.eval_context,
                device=args.device, encoding=args.encoding, text_field=args.text_field, texts=args.text,
                eval_tokens=args.eval_tokens, offload=args.offload)
    print(format_rescore(r, args.plan))
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    from patchc.job.recover import format_recover, recovery_recipe, run_recover

    recipe = recovery_recipe(args.loss, args.train_data, args.train_extra, args.splice)
    result = run_recover(args.run, steps=args.steps, lr=args.lr, scope=args.scope, method=args.method,
                         batch_size=args.batch_size, eval_context=args.eval_context, device=args.device,
                         threads=args.threads, progress=args.progress, recipe=recipe, overwrite=args.overwrite,
                         resume=args.resume, command=args.command_line)
    if result:  # rank 0's, under torchrun
        print(format_recover(result))
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from patchc.job.sample import write_samples

    opts = PruneOptions(model=args.model, data=tuple(args.data), split_seed=args.split_seed,
                        eval_fraction=args.eval_fraction, train_data="self", self_tokens=args.tokens,
                        self_temperature=args.temperature, self_top_p=args.top_p, block_len=args.block_len,
                        encoding=args.encoding, text_field=args.text_field, bos=args.bos, device=args.device,
                        threads=args.threads, progress=args.progress, offload=args.offload)
    info = write_samples(opts, args.out, overwrite=args.overwrite)
    print(f"wrote {info['documents']} samples ({info['tokens']:,} tokens, {info['characters']:,} characters) of "
          f"{args.model} to {Path(info['out']).resolve()} in {info['seconds']:.0f} s")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from patchc.export import export_run

    out = export_run(args.run, args.out, model=args.model, overwrite=args.overwrite, max_shard_size=args.max_shard_size)
    print(f"wrote {Path(out).resolve()}; load it with patchc.from_pretrained({str(out)!r})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    import torch

    from patchc.export.importing import import_sparse

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    summary = import_sparse(args.model, args.out, tile=args.tile and tuple(args.tile), dtype=dtype,
                            overwrite=args.overwrite, max_shard_size=args.max_shard_size)
    print(summary.format())
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from patchc.job.report import redraw

    plans = Path(args.plan) if Path(args.plan).is_dir() else Path(args.plan).parent  # where the PNGs go by default
    check_writable(args.out or plans, f"--out {args.out}" if args.out else f"{plans} (the plan's folder)",
                   "" if args.out else "pass --out")
    for path in redraw(args.plan, args.out):  # redraw reads a run folder too
        print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from patchc.codegen.generate import generate, serving_dtype, summary
    from patchc.job.recover import load_any_plan

    check_writable(args.out, f"--out {args.out}")  # before the plan loads and the kernels compile
    plan = load_any_plan(args.plan)
    files = generate(plan, args.out, target=args.target, workers=args.workers, show_progress=args.progress,
                     fp_fusion=args.fp_fusion, dtype=serving_dtype(plan, args.dtype))
    count = len(files) if hasattr(files, "__len__") else 0
    print(f"wrote {count} files for {args.target} to {Path(args.out).resolve()}")
    print(summary(args.out))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    import json

    import torch

    from patchc.job.recover import load_any_plan
    from patchc.runtime import tune_plan

    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    plan = load_any_plan(args.plan)
    tunings = tune_plan(plan, batch_size=args.batch_size, prefill_len=args.prefill_len, dtype=dtype,
                        time_limit=args.time_limit)
    dense = {fqn for fqn in tunings if not plan.layers[fqn].n_sparse}
    for fqn, tuning in tunings.items():
        print(f"{fqn}: " + (json.dumps(tuning.to_dict()) if tuning is not None else
                            "all dense: F.linear" if fqn in dense else "default configs (time limit)"))
    cut = sum(t is not None and t.source == "partial" for t in tunings.values())
    left = sum(t is None and fqn not in dense for fqn, t in tunings.items())
    note = f" (time limit: {cut} cut short, {left} on the default configs; run again to go on)" if cut or left else ""
    print(f"tuned {len(tunings)} layers; the choices are cached for the next run{note}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import os

    if args.dry_run:  # before anything imports triton: it decides interpreted vs compiled per @jit at import
        late = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
        os.environ["TRITON_INTERPRET"] = "1"
        if late and args.from_command_line:  # `import patchc` has imported it: start again, interpreted
            sys.stdout.flush()
            os.execv(sys.executable, [sys.executable, "-m", "patchc", *sys.argv[1:]])
    from patchc.bench import BenchOptions, exit_status, run

    out = args.out or ("runs/bench-dry-run" if args.dry_run else "benchmarks/results")
    opts = BenchOptions(parts=tuple(args.parts), dry_run=args.dry_run, budget_s=args.budget, out_dir=Path(out),
                        tune=args.tune, e2e_layers=args.layers, e2e_tokens=args.tokens, seed=args.seed,
                        cases=tuple(args.cases))
    return exit_status(run(opts, progress=args.progress))


def build_parser() -> argparse.ArgumentParser:
    from patchc import __version__

    parser = argparse.ArgumentParser(prog="patchc", description="Learnable tile-level hybrid dense/2:4 sparsity (PATCH).",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"patchc {__version__}")
    add_output_flags(parser, debug=False, verbose=0)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, **kw) -> argparse.ArgumentParser:  # noqa: A002 (argparse's name)
        p = sub.add_parser(name, help=help, description=kw.pop("description", help), formatter_class=HelpFormatter)
        # also after the command (`patchc eval RUN -v`); unset there, the value given before it stands
        add_output_flags(p, debug=argparse.SUPPRESS, verbose=argparse.SUPPRESS, after=True)
        return p

    p = command("prune", "learn a hybrid mask for a model on text, evaluate it, write a report")
    add_prune_arguments(p)
    p.set_defaults(handler=cmd_prune)

    p = command("eval", "score a saved plan against the dense model on its own held-out text",
                description="Score a saved plan against the dense model. By default on the plan's own split "
                            "(model, files, seed and fraction recorded by `patchc prune`); refuses documents "
                            "the plan was trained on unless --allow-overlap.")
    p.add_argument("plan", help="plan file, or a run folder (its plan.patch)")
    p.add_argument("--model", default=None, help="model spec (default: the one the plan records, else stories260K)")
    p.add_argument("--data", nargs="+", default=None, help="text files (default: the plan's)")
    p.add_argument("--split-seed", "--seed", dest="split_seed", type=int, default=None,
                   help="which documents are held out (default: the plan's)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="more text files, each scored unsplit from its start, up to --eval-tokens tokens (refused "
                        "if it holds training documents)")
    p.add_argument("--eval-tokens", type=int, default=PruneOptions.eval_tokens,
                   help="tokens scored per --text file (a causal LM's)")
    p.add_argument("--eval-fraction", type=float, default=None, help="share of documents held out (default: the plan's)")
    p.add_argument("--eval-context", type=int, default=256, help="perplexity window")
    p.add_argument("--encoding", default=None, help="text encoding of the --data files (default: the plan's)")
    p.add_argument("--text-field", default=None, metavar="FIELD",
                   help="records files (JSON Lines, Parquet): the text field (default: the plan's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--offload", action="store_true", help=OFFLOAD_HELP)
    p.add_argument("--allow-overlap", action="store_true", help="score even on documents the plan was trained on")
    p.add_argument("--force", action="store_true", help="apply the plan even if the model's weights are not its source")
    p.set_defaults(handler=cmd_eval, paths={"plan": check_plan_path})

    p = command("recover", "fine-tune the weights a run's plan keeps (masks fixed); writes RUN/plan-recovered.patch "
                           "and RUN/recover.json")
    p.add_argument("run", help="run folder of a finished `patchc prune` (holds plan.patch and run.json)")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps")
    p.add_argument("--lr", type=float, default=None, help="Adam learning rate of the weights (default: "
                                                           "the run's --recover-lr)")
    p.add_argument("--scope", choices=("all", "values"), default="all",
                   help="train every kept weight, or only the 2:4 tiles' values (dense tiles frozen)")
    p.add_argument("--method", choices=("adam", "sparsegpt"), default="adam",
                   help="Adam fine-tuning, or one SparseGPT OBS update per layer")
    p.add_argument("--batch-size", type=positive_int, default=None, help="default: the run's")
    p.add_argument("--loss", choices=LOSSES, default=None, help="default: the run's --recover-loss")
    p.add_argument("--train-data", choices=("real", "self", "mix"), default=None, help="default: the run's")
    p.add_argument("--train-extra", nargs="*", default=None, metavar="FILE",
                   help="more text files to train on, whole (default: the run's; the flag alone: none)")
    p.add_argument("--splice", type=float, default=None, metavar="FRACTION",
                   help="encoders: the fraction of each batch's sentences spliced from two training sentences "
                        "(default: the run's --recover-splice, else 1)")
    p.add_argument("--eval-context", type=int, default=None, help="perplexity window (default: the run's, else 256)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: automatic)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier recovery's plan-recovered.patch "
                   "and recover.json, or start again over an unfinished one's recover.ckpt (refused without it)")
    p.add_argument("--resume", action="store_true", help="go on from recover.ckpt, left by a recovery that died")
    p.set_defaults(handler=cmd_recover, paths={"run": find_plan})

    d = PruneOptions()
    p = command("sample", "write the dense model's own text (what --train-data self trains on) to a file",
                description="Sample text from a causal LM, prompted by the first tokens of the training documents "
                            "of --data (never its held-out ones, split as `patchc prune` splits them), and write "
                            "it to --out, one sample per paragraph: training text for another run's --train-extra, "
                            "e.g. an encoder's, which cannot write its own.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="causal LM (default: stories260K)")
    p.add_argument("--data", nargs="+", default=list(DEFAULT_DATA), help="text files: their training documents prompt")
    p.add_argument("--out", required=True, help="text file to write")
    p.add_argument("--tokens", "--self-tokens", dest="tokens", type=positive_int, default=d.self_tokens,
                   help="tokens to generate (whole samples of --block-len + 1)")
    p.add_argument("--block-len", type=int, default=d.block_len, help="tokens per sample, less one")
    p.add_argument("--temperature", "--self-temperature", dest="temperature", type=float, default=d.self_temperature,
                   help="sampling temperature")
    p.add_argument("--top-p", "--self-top-p", dest="top_p", type=float, default=d.self_top_p, help="nucleus cut-off")
    p.add_argument("--split-seed", "--seed", dest="split_seed", type=int, default=d.split_seed,
                   help="held-out documents and sampling noise (a `patchc prune --split-seed` run's)")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction, help="share of documents held out")
    p.add_argument("--encoding", default=d.encoding, help="text encoding of the --data files")
    p.add_argument("--text-field", default=None, metavar="FIELD",
                   help="records files (JSON Lines, Parquet): the text field (default: 'text', else a chat)")
    p.add_argument("--no-bos", dest="bos", action="store_false", help="prompts without BOS (tokenizers without one)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--offload", action="store_true", help=OFFLOAD_HELP)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: automatic)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.set_defaults(handler=cmd_sample)

    p = command("export", "write a run's pruned model as an HF-style folder (planned weights compressed)")
    p.add_argument("run", help="run folder of `patchc prune` (its plan.patch), or a plan file such as its "
                               "plan-recovered.patch")
    p.add_argument("--out", required=True, help="folder to write; must not exist or be empty")
    p.add_argument("--model", default=None, help="model spec (default: the one the run used)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    add_shard_argument(p)
    p.set_defaults(handler=cmd_export, paths={"run": check_plan_path})

    p = command("import", "serve a model that is already 2:4: write it as a patchc folder (patchc.from_pretrained)",
                description="Read a model whose weights are already 2:4 or hybrid (zeros in a dense checkpoint; "
                            "compressed-tensors' sparse-24-bitmask / sparse-bitmask layouts with float, FP8 or int8 "
                            "values; its int4 / int8 marlin-24 layout), infer the tiles of each linear layer "
                            "(nn.Linear, Conv1D, every MoE expert) from its zeros and write the folder "
                            "patchc.from_pretrained serves with the hybrid kernels.")
    p.add_argument("model", help="a transformers folder, or a name in the local Hugging Face cache, whose linear "
                                 "weights are 2:4")
    p.add_argument("--out", required=True, help="folder to write; must not exist or be empty")
    p.add_argument("--tile", type=int, nargs=2, default=None, metavar=("B1", "B2"),
                   help="tile rows x columns; a tile whose every group of 4 holds at most 2 nonzeros is 2:4 "
                        "(default: the widest square of 128 / 64 / 32 / 16 that keeps 99%% of the weights 16 x 16 "
                        "tiles find 2:4 and pads them by at most 5%%: 128 x 128 for a large model 2:4 throughout)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="served weights' dtype (auto: the checkpoint's, fp16 for marlin-24; quantized values are "
                        "dequantized to it)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    add_shard_argument(p)
    p.set_defaults(handler=cmd_import)

    p = command("report", "redraw a plan's plots (and report.md if report.json is beside it)")
    p.add_argument("plan", help="plan file, or a run folder (its plan.patch)")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: the plan's folder)")
    p.set_defaults(handler=cmd_report, paths={"plan": check_plan_path})

    p = command("generate", "compile per-layer Triton kernels for a GPU target, offline")
    p.add_argument("plan", help="plan file, run folder, or a folder `patchc export` / `import` wrote")
    p.add_argument("--target", default="sm_90", choices=("sm_80", "sm_90"), help="GPU architecture (A100: sm_80, H100: sm_90)")
    p.add_argument("--out", required=True, help="folder for the kernels and manifests")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="compile processes (default: the CPUs this process may use)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="weights' dtype the kernels serve (auto: the plan's, bfloat16 for an fp32 plan from a CPU)")
    p.add_argument("--no-fp-fusion", dest="fp_fusion", action="store_false",
                   help="compile without fusing multiply-adds (Triton's enable_fp_fusion=False)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.set_defaults(handler=cmd_generate, paths={"plan": check_served_path})

    p = command("tune", "autotune decode and prefill kernel configs on this GPU; fills the cache")
    p.add_argument("plan", help="plan file, run folder, or a folder `patchc export` / `import` wrote")
    p.add_argument("--batch-size", type=positive_int, default=16, help="decode batch: the largest M tuned as decode")
    p.add_argument("--prefill-len", type=int, default=128, help="prompt length: M = batch x prefill tuned as prefill")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "fp16", "bf16"), help="activation dtype")
    p.add_argument("--time-limit", type=float, metavar="SECONDS", help="stop compiling and timing after this "
                   "long; what was searched in full stays cached, so the next run goes on from there")
    p.set_defaults(handler=cmd_tune, paths={"plan": check_served_path})

    p = command("bench", "GPU proof: kernels and runtime vs cuBLAS / fp64, layer speed, end-to-end decode",
                       description="Correctness of every kernel variant and the runtime (vs fp64 and cuBLAS), layer "
                                   "speed (vs cuBLAS dense and cuSPARSELt), end-to-end decode of a LLaMA-shaped "
                                   "model and fused MoE experts (vs torch's grouped mm), on this CUDA GPU; appends to "
                                   "<out>/<device>.jsonl and writes <device>.md. Exit status 1 when a correctness "
                                   "check fails.")
    add_bench_arguments(p)
    p.set_defaults(handler=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose += getattr(args, "verbose_after", 0)  # -v before the command and after it add up
    # recorded in report.json / recover.json: the words given, not the host program's (e.g. pytest's)
    args.command_line = " ".join(["patchc", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    args.from_command_line = argv is None  # the process is this command: it may restart itself (bench)
    # a caller's (a notebook's) thread count comes back after the job picks its own; no torch yet: none to keep
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    try:
        for dest, check in getattr(args, "paths", {}).items():  # torch-free: a mistyped path answers at once
            check(getattr(args, dest))
        # run from a shell, patchc's warnings read as its errors do (a test's or a notebook's recording stays theirs)
        lines = warnings_as_lines(f"patchc {args.command}") if args.from_command_line else contextlib.nullcontext()
        with logs_shown(args.verbose), lines:
            return args.handler(args)
    except KeyboardInterrupt:
        print(f"patchc {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"patchc {args.command}: error: {one_line(exc, args.command)}", file=sys.stderr)
        return 2
    finally:
        if threads is not None:
            torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
