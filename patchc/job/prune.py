"""The main job, `patchc prune`: a real model and real text in, a hybrid plan and a quality report out.

    load model -> load text (split by document) -> calibrate -> transform -> train masks
        -> harden -> save plan -> evaluate (dense, PATCH, baselines) -> report.json / report.md / plots

Runs under `torchrun --nproc_per_node=N -m patchc prune ...` too (`distributed.py`); the options are
`options.py`'s `PruneOptions`.

Example:
    >>> report = run_prune(PruneOptions(steps=50, out="runs/quick"))
    >>> report["plan"]["density"]
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import patchc
from patchc.config import PatchConfig
from patchc.job.corpus import data_record, load_data
from patchc.job.distributed import harden_program, init_distributed, prepare_training, rank_slice, say, world
from patchc.job.losses import make_lm_loss
from patchc.job.memory import calibration_memory, check_fits
from patchc.job.model import check_device, load_bundle, parked, with_tile
from patchc.job.options import ONESHOT_METHODS, PruneOptions
from patchc.job.results import row, run_report
from patchc.job.runs import CHECKPOINT, check_out, check_settings, claim_run_dir, release
from patchc.pruning import apply_masks


# -- stages -----------------------------------------------------------------------------------
@contextmanager
def timed(timings: dict[str, float], stage: str):
    start = time.perf_counter()
    try:
        yield
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
    prog = patchc.transform(exported, cfg, calib=calib, prior_masks=prior_masks)
    for mask in prog.layers.values():
        mask.impl = opts.mask_impl
    setup = prepare_training(prog, checkpoint, fsdp=opts.fsdp)  # alone, DDP, or FSDP2 shards
    loss_fn = make_loss(bundle, setup.teacher or bundle.model, opts)
    with parked(bundle.model, when=setup.teacher is not None):
        result = train_loop(prog, setup, loss_fn, bundle, data, cfg, opts, checkpoint, resume, steps)
    return prog, result


def train_loop(prog, setup, loss_fn: Callable, bundle, data: dict, cfg: PatchConfig, opts: PruneOptions,
               checkpoint: Path | None, resume: bool, steps: int | None):
    """`patchc.train_masks` with the job's batches, schedule, checkpoints and progress."""
    return patchc.train_masks(
        prog,
        make_batches(bundle, data, opts),
        lambda _prog, batch: loss_fn(setup.forward_module, batch),
        steps=steps or cfg.steps,
        schedule_steps=cfg.steps,
        desc=f"mask training ({'learned 2:4 baseline' if cfg.variant == 'nm' and opts.variant != 'nm' else 'PATCH ' + cfg.variant})",
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

    score = lambda ids: perplexity(lambda x: bundle.logits(model, x), ids, context=opts.eval_context)  # noqa: E731
    return {"perplexity": score(data["eval"]), "extra": {Path(p).name: score(ids) for p, ids in data["extra"].items()}}


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


def run_prune(opts: PruneOptions, command: str | None = None) -> dict:
    """Run the whole job; returns the report dict (also written to `<out>/report.json`).

    Every input is checked before a folder is made; the folder is claimed for this process (`runs.py`)
    and released however the run ends.
    """
    check_device(opts.device)
    check_out(opts)  # before the model loads and text is generated
    init_distributed(opts.device)
    timings: dict[str, float] = {}
    with timed(timings, "load"):
        bundle = load_bundle(opts)
        opts = with_tile(opts, bundle)  # --tile, else the model's own (`auto_tile`), before run.json records it
        check_fits(bundle.model, opts.patch_config(), opts, ranks=world()[1])  # before text is generated
        data = load_data(bundle, opts, cache_dir=cache_dir(opts))
    out, schedule_steps = claim_folder(bundle, opts)
    failed = True
    try:
        report = _run(bundle, data, out, opts.patch_config(steps=schedule_steps), opts, command, timings)
        failed = False
        return report
    finally:
        if world()[0] == 0:
            release(out, failed)


def cache_dir(opts: PruneOptions) -> Path:
    """Where generated training text is cached: `.cache/` beside the run folders."""
    return (Path(opts.out).parent if opts.out else Path("runs")) / ".cache"


def claim_folder(bundle, opts: PruneOptions) -> tuple[Path, int]:
    """Rank 0 claims the run folder and checks the settings; every rank learns (folder, schedule length T)."""
    rank, size = world()
    if rank == 0:
        out = claim_run_dir(opts.out, Path("runs"), bundle.name, opts.resume, opts.overwrite)
        try:
            schedule = check_settings(out, opts, opts.resume, opts.overwrite)
        except BaseException:
            release(out, failed=True)
            raise
        shared = [str(out), schedule]
    else:
        shared = [None, None]
    if size > 1:
        dist.broadcast_object_list(shared, src=0)
    return Path(shared[0]), int(shared[1])  # T < --steps when a resumed run is extended


def _run(bundle, data: dict, out: Path, cfg: PatchConfig, opts: PruneOptions, command: str | None,
         timings: dict[str, float]) -> dict:
    """The stages after loading: export, dense row, calibrate, train PATCH (+ recovery), baselines, write."""
    rank, size = world()
    results: list[dict] = []
    say(f"patchc prune: {bundle.name} ({bundle.kind}), sparsity {opts.sparsity:.0%}, tile {opts.tile}, "
        f"{opts.steps} steps x batch {opts.batch_size}{f' on {size} processes' if size > 1 else ''}; writing to {out}")
    # First: a model torch.export cannot trace fails here, not after calibration. Its weights are the model's;
    # both trained runs transform it (transform works on its own copy of the graph).
    with timed(timings, "export"):
        exported = bundle.export(bundle.model, fixed_len=opts.block_len)
    dense_ref = None
    if rank == 0:
        with timed(timings, "evaluate"):
            dense_ref = dense_reference(bundle, data)
            results.append(row("dense", "dense", "-", 0.0, evaluate(bundle, bundle.model, data, opts, dense_ref)))

    calib = None
    if cfg.prior in ("wanda", "sparsegpt") or (opts.baselines and rank == 0):
        with timed(timings, "calibrate"):
            calib = calibrate(bundle, data, opts)

    # The prior's 2:4 masks are the one-shot baseline's of the same method, and the learned-2:4 run
    # starts from the same prior: compute them once (SparseGPT's take seconds) when they are used twice.
    prior_masks = None
    if opts.baselines and cfg.prior in ONESHOT_METHODS:
        with timed(timings, "calibrate"):
            prior_masks = oneshot_masks(bundle, cfg.prior, calib, opts.progress and rank == 0)

    with timed(timings, "train"):
        plan, trained = train(bundle, cfg, data, opts, calib, out / CHECKPOINT, opts.resume, prior_masks,
                              steps=opts.steps, exported=exported)
    recovered = None
    if rank == 0:
        plan.meta |= {"command": command or "", "model": opts.model,
                      "data": data_record(data, opts)}  # `patchc eval` scores on this split, never on training text
        with timed(timings, "evaluate"):
            scores = score_copy(bundle, lambda: plan.apply(bundle.reload()), data, opts, dense_ref)
            results.append(row(f"PATCH {opts.variant}", "patch", "hybrid", plan.sparsity, scores, trained.seconds))
        if opts.recover:
            recovered = recover_row(bundle, plan, data, opts, results, timings, dense_ref)
    if opts.baselines:
        baselines(bundle, cfg, data, opts, calib, prior_masks, exported, results, timings, dense_ref)

    if rank != 0:
        dist.barrier()
        return {}
    report = run_report(bundle, data, cfg, opts, plan, trained, results, out, command, timings)
    write_run(bundle, opts, plan, recovered, out, report, timings)
    if size > 1:
        dist.barrier()
    return report


def baselines(bundle, cfg: PatchConfig, data: dict, opts: PruneOptions, calib, prior_masks, exported,
              results: list[dict], timings: dict[str, float], dense_ref=None) -> None:
    """The baseline rows: the one-shot 2:4 methods (rank 0), then learned 2:4 (`variant="nm"` at 50%, every
    rank trains) from the same prior and steps, recovered as PATCH was when --recover is given."""
    rank = world()[0]
    with timed(timings, "baselines"):
        if rank == 0:
            for method in ONESHOT_METHODS:
                masks = prior_masks if method == cfg.prior else None
                make = functools.partial(oneshot_baseline, bundle, method, calib, opts.progress, masks)
                scores = score_copy(bundle, make, data, opts, dense_ref)
                results.append(row(f"{method} 2:4", method, "2:4", 0.5, scores))
        nm_cfg = cfg.replace(variant="nm", sparsity=0.5)
        nm_plan, nm_trained = train(bundle, nm_cfg, data, opts, calib, None, False, prior_masks, steps=opts.steps,
                                    exported=exported)
    if rank == 0:
        scores = score_copy(bundle, lambda: nm_plan.apply(bundle.reload()), data, opts, dense_ref)
        results.append(row("learned 2:4 (nm)", "patch-nm", "2:4", nm_plan.sparsity, scores, nm_trained.seconds))
        if opts.recover:  # the baseline gets the same recovery as PATCH
            recover_row(bundle, nm_plan, data, opts, results, timings, dense_ref)


def write_run(bundle, opts: PruneOptions, plan, recovered, out: Path, report: dict, timings: dict[str, float]) -> None:
    """plan.patch (and plan-recovered.patch), the pictures, then report.json / report.md naming every file."""
    from patchc.job.report import plot_plan, write_report

    with timed(timings, "write"):
        plan.save(out / "plan.patch")
        if recovered is not None:
            recovered.save(out / "plan-recovered.patch")
        pictures = plot_plan(plan, out, title=f"{bundle.name}: PATCH {opts.variant} at {plan.sparsity:.1%} sparsity")
    recovered_file = {"plan_recovered": str(out / "plan-recovered.patch")} if recovered is not None else {}
    report["files"] = {"plan": str(out / "plan.patch"), **recovered_file, **{p.stem: str(p) for p in pictures},
                       "report_json": str(out / "report.json"), "report_md": str(out / "report.md")}
    write_report(report, out)  # last, outside the timings, so the files hold every number the dict does


def recover_plan(bundle, plan, data: dict, opts: PruneOptions, model=None, steps: int | None = None,
                 lr: float | None = None, **knobs):
    """`plan` with its kept weights fine-tuned on the run's training text with --recover-loss (masks fixed).

    `model`: the dense weights to fine-tune (default: a fresh `bundle.reload()`); `steps`, `lr`: default
    --recover and the kind's recovery lr; `knobs`: more of `patchc.recover`'s (scope, method, calib, ...).
    """
    loss_fn = make_loss(bundle, bundle.model, opts, recovery=True)
    recovered = patchc.recover(plan, bundle.reload() if model is None else model, recovery_batches(bundle, data, opts),
                               loss_fn, steps=opts.recover if steps is None else steps,
                               lr=opts.recovery_lr(bundle.kind) if lr is None else lr,
                               **{"scope": opts.recover_scope, "progress": opts.progress, **knobs})
    recovered.meta["recovery"] |= {"loss": opts.recover_loss, "splice": opts.recovery_splice(bundle.kind, bundle.name)}
    return recovered


def recover_row(bundle, plan, data: dict, opts: PruneOptions, results: list[dict], timings: dict[str, float],
                dense_ref=None):
    """Fine-tune the kept weights of `plan` (masks fixed, same text and loss as mask training), score the
    result as one more row named after the last one; returns the recovered plan."""
    with timed(timings, "recover"):
        start = time.perf_counter()
        recovered = recover_plan(bundle, plan, data, opts)
        seconds = time.perf_counter() - start
    last = results[-1]
    with timed(timings, "evaluate"):
        metrics = score_copy(bundle, lambda: recovered.apply(bundle.reload()), data, opts, dense_ref)
    results.append(row(f"{last['name']} + recovery", f"{last['method']}+recover", last["pattern"], recovered.sparsity,
                       metrics, seconds))
    return recovered


__all__ = ["PruneOptions", "dense_reference", "evaluate", "run_prune"]
