"""The job's stages, one function each: batches, losses, calibration, mask training, scoring, one-shot
baselines, weight recovery. `prune.py` runs them in order; `patchc eval` and `patchc recover` reuse them.

Example:
    >>> calib = calibrate(bundle, data, opts)
    >>> plan, result = train(bundle, opts.patch_config(), data, opts, calib, checkpoint=None, resume=False)
    >>> scores = score_copy(bundle, lambda: plan.apply(bundle.reload()), data, opts)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import patchc
from patchc.config import PatchConfig
from patchc.job.distributed import harden_program, prepare_training, rank_slice, world
from patchc.job.losses import make_lm_loss
from patchc.job.memory import calibration_memory
from patchc.job.model import parked
from patchc.job.options import PruneOptions
from patchc.job.runs import settings_of
from patchc.pruning import apply_masks

@contextmanager
def timed(timings: dict[str, float], stage: str):
    """Add the block's seconds to `timings[stage]`; an error raised in it is marked with the stage (the
    innermost one) for its message (`memory.out_of_memory`)."""
    start = time.perf_counter()
    try:
        yield
    except Exception as exc:
        if getattr(exc, "patchc_stage", None) is None:
            exc.patchc_stage = stage
        raise
    finally:
        timings[stage] = round(timings.get(stage, 0.0) + time.perf_counter() - start, 3)


def make_loss(bundle, dense_model, opts: PruneOptions, recovery: bool = False) -> Callable:
    """Causal LMs: --loss (LM, KD to the dense model, or both), --recover-loss in weight recovery. Encoders
    distil the dense model's last layer in mask training, every layer in recovery (an HF model, not a graph)."""
    if bundle.kind == "encoder":
        from patchc.job.encoder_eval import make_distill_loss

        return make_distill_loss(bundle, dense_model, layers=recovery)
    return make_lm_loss(bundle, dense_model, (opts.for_recovery() if recovery else opts).loss_spec())


def global_batches(bundle, data: dict, opts: PruneOptions, splice: float = 0.0) -> Callable[[int], Any]:
    """step -> the whole batch of that step (every rank computes the same one). `splice`: an encoder's
    sentences are this fraction spliced (`splice_sentences`, seeded by the step), as recovery trains."""
    if bundle.kind == "encoder":  # sentences in a fresh seeded order every epoch, as blocks are below
        from patchc.job.data import batch_indices
        from patchc.job.encoder_eval import encode_batches, splice_sentences

        sentences = data["train"]

        def batch(step: int):
            chosen = [sentences[i] for i in batch_indices(len(sentences), opts.batch_size, step, opts.seed)]
            if splice:
                chosen = splice_sentences(chosen, splice, seed=f"{opts.seed}:{step}", pool=sentences)
            return encode_batches(bundle, chosen, max_len=opts.block_len, batch_size=opts.batch_size)[0]

        return batch
    from patchc.job.data import get_batch

    return lambda step: get_batch(data["train"], opts.batch_size, step, opts.seed)


def recovery_batches(bundle, data: dict, opts: PruneOptions) -> Callable[[int], Any]:
    """step -> the batch weight recovery trains on: an encoder's sentences spliced (--recover-splice) so that
    the distilled weights do not fit the few real ones; a causal LM's blocks as in mask training."""
    return global_batches(bundle, data, opts, splice=opts.recovery_splice(bundle.kind, bundle.name))


def make_batches(bundle, data: dict, opts: PruneOptions) -> Callable[[int], Any]:
    """step -> this rank's share of the global batch (the whole batch outside torchrun)."""
    rank, size = world()
    batch = global_batches(bundle, data, opts)
    return lambda step: rank_slice(batch(step), rank, size)


def calibrate(bundle, data: dict, opts: PruneOptions):
    """Input statistics for the one-shot methods (Wanda norms, SparseGPT Hessians) on training text.

    Not split over torchrun ranks: every rank needs the same statistics for the same prior. On a GPU they
    wait in host memory (`calibration_memory`).
    """
    batches = global_batches(bundle, data, dataclasses.replace(opts, batch_size=1))
    inputs = [batches(i) for i in range(min(opts.calib_blocks, len(data["train"])))]
    if bundle.kind == "causal":
        inputs = [ids[:, :-1] for ids in inputs]  # a block holds block_len inputs + 1 target
    max_bytes, store = calibration_memory(opts)
    return patchc.calibrate(bundle.model, inputs, progress=opts.progress and world()[0] == 0,
                            max_hessian_bytes=max_bytes, store=store)


def train(bundle, cfg: PatchConfig, data: dict, opts: PruneOptions, calib, checkpoint: Path | None, resume: bool,
          prior_masks: dict[str, torch.Tensor] | None = None, steps: int | None = None,
          exported: torch.export.ExportedProgram | None = None):
    """transform -> train_masks -> harden for one configuration; returns (plan, train result), the plan on rank
    0 only (None on the other ranks of a torchrun job).

    `prior_masks`: `oneshot_masks(bundle, cfg.prior, calib)`, when already computed for another run.
    `steps`: optimizer steps when more than the schedules' length `cfg.steps` (an extended run).
    `exported`: `bundle.export(bundle.model, fixed_len=opts.block_len)`, when already made.
    """
    prog, result = train_program(bundle, cfg, data, opts, calib, checkpoint, resume, prior_masks, steps, exported)
    plan = harden_program(prog, exact_budget=opts.exact_budget and cfg.variant != "nm", rank=0)
    return plan, result


def train_program(bundle, cfg: PatchConfig, data: dict, opts: PruneOptions, calib, checkpoint: Path | None,
                  resume: bool, prior_masks: dict[str, torch.Tensor] | None = None, steps: int | None = None,
                  exported: torch.export.ExportedProgram | None = None):
    """`train` up to the trained program, before hardening; returns (program, result).

    With --fsdp under torchrun the program stays sharded (`harden_program` gathers it block by block), the
    distillation teacher is the program with its masks off, and the dense model waits in host memory
    meanwhile (`parked`): no rank holds the whole model on its device while the masks train."""
    if exported is None:
        exported = bundle.export(bundle.model, fixed_len=opts.block_len)
    # a resumed run's logits come from its checkpoint: no prior to compute (`resumes_from`), nor calibration
    prog = patchc.transform(exported, cfg, calib=calib, prior_masks=prior_masks,
                            prior=not resumes_from(checkpoint, resume))
    for mask in prog.layers.values():
        mask.impl = opts.mask_impl
    setup = prepare_training(prog, checkpoint, fsdp=opts.fsdp)  # alone, DDP, or FSDP2 shards
    loss_fn = make_loss(bundle, setup.teacher or bundle.model, opts)
    with parked(bundle.model, when=setup.teacher is not None):
        result = train_loop(prog, setup, loss_fn, bundle, data, cfg, opts, checkpoint, resume, steps)
    return prog, result


def resumes_from(checkpoint: Path | None, resume: bool) -> bool:
    """Whether mask training goes on from `checkpoint` (a file, or a folder under --fsdp) instead of its prior."""
    return resume and checkpoint is not None and Path(checkpoint).exists()


def train_loop(prog, setup, loss_fn: Callable, bundle, data: dict, cfg: PatchConfig, opts: PruneOptions,
               checkpoint: Path | None, resume: bool, steps: int | None):
    """`patchc.train_masks` with the job's batches, schedule, checkpoints and progress."""
    run = "learned 2:4 baseline" if cfg.variant == "nm" and opts.variant != "nm" else f"PATCH {cfg.variant}"
    return patchc.train_masks(
        prog,
        make_batches(bundle, data, opts),
        lambda _prog, batch: loss_fn(setup.forward_module, batch),
        steps=steps or cfg.steps,
        schedule_steps=cfg.steps,
        desc=f"mask training ({run})",
        lr=opts.lr,
        tile_lr=opts.tile_lr,
        checkpoint=setup.checkpoint,
        checkpoint_every=50 if checkpoint else 0,
        checkpoint_io=setup.checkpoint_io,
        optim=opts.mask_optim(),
        resume=resume,
        progress=opts.progress and world()[0] == 0,
    )


def dense_reference(bundle, data: dict) -> dict[str, Any] | None:
    """An encoder's dense embeddings of every scored text (`encoder_eval.dense_embeddings`), computed once
    per job; None for causal LMs, whose perplexity needs no reference."""
    if bundle.kind != "encoder":
        return None
    from patchc.job.encoder_eval import dense_embeddings

    return dense_embeddings(bundle, data)


def evaluate(bundle, model: torch.nn.Module, data: dict, opts: PruneOptions, dense_ref=None) -> dict[str, Any]:
    """Perplexity on held-out text (causal) or agreement with the dense embeddings (encoder; `dense_ref`
    from `dense_reference`), and the same measure on each --eval-data file under "extra" (by file name)."""
    if bundle.kind == "encoder":
        from patchc.job.encoder_eval import score_embeddings

        return score_embeddings(bundle, model, data, dense_ref)
    from patchc.job.evaluate import perplexity

    batch = eval_batch(opts, model)
    score = lambda ids: perplexity(lambda x: bundle.logits(model, x), ids, context=opts.eval_context,  # noqa: E731
                                   batch_size=batch)
    return {"perplexity": score(data["eval"]), "extra": {Path(p).name: score(ids) for p, ids in data["extra"].items()}}


# Windows scored per forward. Under --offload every forward copies every block to the GPU (seconds for a 70B
# model), so it takes as many windows as keep their fp32 logits within OFFLOAD_LOGITS bytes, up to 64.
EVAL_BATCH, OFFLOAD_BATCH, OFFLOAD_LOGITS = 8, 64, 2 * 10**9


def eval_batch(opts: PruneOptions, model: torch.nn.Module) -> int:
    """How many --eval-context windows one forward of causal LM `model` scores: `EVAL_BATCH`, more under
    --offload (61 for a 32,000-token vocabulary at 256 tokens; 8 past 244,000 tokens, such as Gemma's 262,144)."""
    if not opts.offload:
        return EVAL_BATCH
    from patchc.job.activations import vocab_size

    per_window = opts.eval_context * vocab_size(model) * 4
    return max(EVAL_BATCH, min(OFFLOAD_BATCH, OFFLOAD_LOGITS // per_window))


def score_copy(bundle, make: Callable[[], torch.nn.Module], data: dict, opts: PruneOptions, dense_ref=None) -> dict:
    """`evaluate` the pruned copy `make()` builds, while the dense model waits in host memory (`parked`, on a
    GPU): a device that holds the model once need not hold it twice. The copy is dropped before it returns."""
    with parked(bundle.model):
        return evaluate(bundle, make(), data, opts, dense_ref)


def oneshot_masks(bundle, method: str, calib, progress: bool = False) -> dict[str, torch.Tensor]:
    """The dense model's one-shot 2:4 masks, {weight FQN: kept}: a baseline's masks and the prior of the
    PATCH runs alike (the prior's 2:4 part is exactly these masks).

    Example:
        >>> masks = oneshot_masks(bundle, "sparsegpt", calib)
        >>> model = oneshot_baseline(bundle, "sparsegpt", calib, masks=masks)
    """
    masks = patchc.oneshot(bundle.model, method=method, pattern="2:4", calib=calib, progress=progress)
    return {name: mask.cpu() for name, mask in masks.items()}  # kept through training: not on the GPU (1 B/weight)


def oneshot_baseline(bundle, method: str, calib, progress: bool = False,
                     masks: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A fresh dense copy pruned by a one-shot method at 2:4 (masks only, as the baselines of the paper);
    `masks`: that method's `oneshot_masks`, when already computed."""
    model = bundle.reload()
    if masks is None:
        masks = patchc.oneshot(model, method=method, pattern="2:4", calib=calib, progress=progress)
    return apply_masks(model, masks)  # plan-named masks: expert slices and Conv1D transposes too


def recover_plan(bundle, plan, data: dict, opts: PruneOptions, model=None, steps: int | None = None,
                 lr: float | None = None, checkpoint: Path | None = None, resume: bool = False, **knobs):
    """`plan` with its kept weights fine-tuned on the run's training text with --recover-loss (masks fixed).

    `model`: the dense weights to fine-tune (default: a fresh `bundle.reload()`); `steps`, `lr`: default
    --recover and the kind's recovery lr; `checkpoint`: Adam recovery's, gone on from when `resume` and the
    same recovery of the same text wrote it; `knobs`: more of `patchc.recover`'s (scope, method, calib, ...).
    With --fsdp under torchrun every rank calls it and recovers its shards of copies of the loaded model
    (`recovers_sharded`; `model` unused): the plan on rank 0, None on the others.
    """
    splice = opts.recovery_splice(bundle.kind, bundle.name)
    saving = {}
    if checkpoint is not None and knobs.get("method", "adam") == "adam":
        # the text and batches (run.json's settings) and the loss: what recover() cannot see but trains on;
        # not --fsdp: a sharded recovery's checkpoint goes on in one process, and the other way round
        tag = {k: v for k, v in settings_of(opts).items() if k != "fsdp"} | {"recover_loss": opts.recover_loss,
                                                                             "recover_splice": splice}
        saving = {"checkpoint": checkpoint, "resume": resume, "checkpoint_tag": tag}
    steps = opts.recover if steps is None else steps
    lr = opts.recovery_lr(bundle.kind) if lr is None else lr
    knobs = {"scope": opts.recover_scope, "progress": opts.progress, **saving, **knobs}
    if recovers_sharded(opts):
        recovered = recover_sharded_copy(bundle, plan, data, opts, steps, lr, **knobs)
    else:
        loss_fn = make_loss(bundle, bundle.model, opts, recovery=True)
        recovered = patchc.recover(plan, bundle.reload() if model is None else model,
                                   recovery_batches(bundle, data, opts), loss_fn, steps=steps, lr=lr, **knobs)
    if recovered is not None:  # None on the other ranks of a sharded recovery
        recovered.meta["recovery"] |= {"loss": opts.recover_loss, "splice": splice}
    return recovered


def recovers_sharded(opts: PruneOptions) -> bool:
    """Whether weight recovery is spread over the ranks (--fsdp under torchrun); else rank 0 recovers alone."""
    return opts.fsdp and world()[1] > 1


def recover_sharded_copy(bundle, plan, data: dict, opts: PruneOptions, steps: int, lr: float, *, progress: bool,
                         **knobs):
    """`recover_plan` on every rank, FSDP2 sharding a copy of the dense model and of its teacher
    (`fsdp_recover`); the plan on rank 0, None elsewhere. The loaded model waits in host memory meanwhile."""
    import copy

    from patchc.job.fsdp_recover import recover_sharded, shard_teacher
    from patchc.masking.recover import RecoverConfig

    saving = {k: knobs.pop(k) for k in ("checkpoint", "resume", "checkpoint_tag") if k in knobs}
    knobs.pop("calib", None)  # SparseGPT's; recover_sharded refuses any method but Adam
    cfg = RecoverConfig(steps=steps, lr=lr, **knobs)
    rank, size = world()
    batches = recovery_batches(bundle, data, opts)
    with parked(bundle.model):  # copied in host memory; FSDP2 moves a block at a time to the GPU, keeps a shard
        kd = bundle.kind == "encoder" or "kd" in opts.recover_loss
        teacher = shard_teacher(copy.deepcopy(bundle.model)) if kd else None  # before the student: one copy at a time
        student = copy.deepcopy(bundle.model)
        return recover_sharded(plan, student, teacher, lambda step: rank_slice(batches(step), rank, size),
                               make_loss(bundle, teacher, opts, recovery=True), cfg, progress=progress, **saving)


__all__ = ["calibrate", "dense_reference", "evaluate", "global_batches", "make_loss", "oneshot_baseline",
           "oneshot_masks", "recover_plan", "recovers_sharded", "resumes_from", "score_copy", "timed", "train",
           "train_program"]
