"""The main job, `patchc prune`: a real model and real text in, a hybrid plan and a quality report out.

    load model -> load text (split by document) -> calibrate -> transform -> train masks
        -> harden -> save plan -> evaluate (dense, PATCH, baselines) -> report.json / report.md / plots

Each stage is a function of `stages.py`; every row is kept as it is scored, so `--resume` after a crash
goes on from the last one (`resume.py`). Runs under `torchrun --nproc_per_node=N -m patchc prune ...` too
(`distributed.py`); the options are `options.py`'s `PruneOptions`.

Example:
    >>> report = run_prune(PruneOptions(steps=50, out="runs/quick"))
    >>> report["plan"]["density"]
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from patchc.config import PatchConfig
from patchc.ir import TilePlan
from patchc.job.corpus import check_text_files, data_record, load_data
from patchc.job.distributed import process_group, say, world
from patchc.job.memory import check_fits
from patchc.job.model import check_device, load_bundle, with_tile
from patchc.job.options import ONESHOT_METHODS, PruneOptions
from patchc.job.results import row, run_report
from patchc.job.resume import RECOVERED, RECOVERY, TRAINED, KeptRows
from patchc.job.runs import (CHECKPOINT, NM_CHECKPOINT, NM_RECOVER_CHECKPOINT, PLAN, RECOVER_CHECKPOINT,
                             RECOVERED_PLAN, check_out, check_settings, claim_run_dir, forget_recovery,
                             release, remove, unfinish)
from patchc.job.stages import (calibrate, dense_reference, evaluate, oneshot_baseline, oneshot_masks, recover_plan,
                               recovers_sharded, resumes_from, score_copy, timed, train)
from patchc.masking.ranks import agree
from patchc.masking.train import TrainResult
from patchc.utils.stopping import exit_on_signals

NM_ROW = "learned 2:4 (nm)"


def run_prune(opts: PruneOptions, command: str | None = None) -> dict:
    """Run the whole job; returns the report dict (also written to `<out>/report.json`).

    Every input is checked before a folder is made; the folder is claimed for this process (`runs.py`)
    and released however the run ends.
    """
    check_device(opts.device)
    if opts.offload:
        raise ValueError("--offload streams a model for scoring and sampling (patchc eval, patchc sample); mask "
                         "training needs its weights on the device: spread them over GPUs with --fsdp instead")
    check_out(opts)  # before the model loads and text is generated
    check_text_files(opts)
    with process_group(opts.device):
        return _prune(opts, command)


def _kernel_block(tile: tuple[int, int]) -> tuple[int, int] | str:
    from patchc.codegen.layout import suggest_block  # only for a given --tile: the kernels' module imports Triton

    return suggest_block(tile)


def _prune(opts: PruneOptions, command: str | None) -> dict:
    """`run_prune` once this process has joined torchrun's group (if launched by it)."""
    timings: dict[str, float] = {}
    if opts.tile and isinstance(block := _kernel_block(opts.tile), str):  # it trains; a GPU refuses it later
        warnings.warn(f"--tile {opts.tile[0]} {opts.tile[1]}: {block.removeprefix('none: ')}; the plan trains and "
                      "applies (plan.apply), but the GPU kernels need tile sides that are multiples of 16: "
                      "patchc.compile and the backend will refuse it", stacklevel=2)
    if opts.fsdp and world()[1] == 1:
        warnings.warn("--fsdp in one process (not launched by torchrun): nothing is sharded, the run trains as "
                      "without it; `torchrun --nproc_per_node=N -m patchc prune --fsdp ...` shards over N GPUs",
                      stacklevel=2)
    with timed(timings, "load"):
        bundle = load_bundle(opts)
        opts = with_tile(opts, bundle)  # --tile, else the model's own (`auto_tile`), before run.json records it
        check_fits(bundle.model, opts.patch_config(), opts, ranks=world()[1],  # before text is generated
                   probe=bundle.kind == "causal")
        data = load_data(bundle, opts, cache_dir=cache_dir(opts))
    out, schedule_steps = claim_folder(bundle, opts)
    failed = True
    try:
        with exit_on_signals():  # SIGTERM, Ctrl-C: training stops after a step with a checkpoint, the claim is released
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
    shared = None
    if world()[0] == 0:
        out = claim_run_dir(opts.out, Path("runs"), bundle.name, opts.resume, opts.overwrite)
        try:
            schedule = check_settings(out, opts, opts.resume, opts.overwrite)
        except BaseException:
            release(out, failed=True)
            raise
        shared = (str(out), schedule)
    folder, schedule = agree(shared)
    return Path(folder), int(schedule)  # T < --steps when a resumed run is extended


def _run(bundle, data: dict, out: Path, cfg: PatchConfig, opts: PruneOptions, command: str | None,
         timings: dict[str, float]) -> dict:
    """The stages after loading: export, dense row, calibrate, train PATCH (+ recovery), baselines, write.

    Rank 0 keeps each row as it is scored and writes the plan as soon as it is hardened (`resume.py`): a run
    resumed after a crash scores no row again whose inputs are unchanged."""
    rank, size = world()
    kept = KeptRows(out, opts) if rank == 0 else None
    results: list[dict] = []
    say(f"patchc prune: {bundle.name} ({bundle.kind}), sparsity {opts.sparsity:.0%}, tile {opts.tile}, "
        f"{opts.steps} steps x batch {opts.batch_size}{f' on {size} processes' if size > 1 else ''}; writing to {out}")
    todo = still_to_do(out, opts, kept)
    # First: a model torch.export cannot trace fails here, not after calibration. Its weights are the model's;
    # both trained runs transform it (transform works on its own copy of the graph).
    exported = None
    if todo.patch or todo.nm:
        with timed(timings, "export"):
            exported = bundle.export(bundle.model, fixed_len=opts.block_len)
    reference = functools.cache(lambda: dense_reference(bundle, data))  # an encoder's, once, if a row is scored
    if rank == 0:
        with timed(timings, "evaluate"):
            results.append(kept.row("dense", lambda: row("dense", "dense", "-", 0.0, evaluate(
                bundle, bundle.model, data, opts, reference()))))

    calib = None  # for the prior of a run that starts from it, and for the one-shot rows not kept yet
    if (cfg.prior in ("wanda", "sparsegpt") and todo.prior) or (rank == 0 and todo.oneshot):
        with timed(timings, "calibrate"):
            calib = calibrate(bundle, data, opts)

    # The prior's 2:4 masks are the one-shot baseline's of the same method, and the learned-2:4 run
    # starts from the same prior: compute them once (SparseGPT's take seconds) when they are used twice.
    prior_masks = None
    if opts.baselines and cfg.prior in ONESHOT_METHODS and (todo.prior or (rank == 0 and cfg.prior in todo.oneshot)):
        with timed(timings, "calibrate"):
            prior_masks = oneshot_masks(bundle, cfg.prior, calib, opts.progress and rank == 0)

    if todo.patch:
        with timed(timings, "train"):
            plan, trained = train(bundle, cfg, data, opts, calib, out / CHECKPOINT, opts.resume, prior_masks,
                                  steps=opts.steps, exported=exported)
    else:  # its row is kept: the plan it scored is read back, not hardened again from the checkpoint
        plan, trained = todo.saved or (None, None)
    if rank == 0:
        unfinish(out)  # the run's outputs change from here: it is finished again once its report is written
        if todo.patch:  # a kept plan is on disk already, as its row was scored
            plan.meta |= {"command": command or "", "model": opts.model,  # `patchc eval` scores on this split,
                          "data": data_record(data, opts),               # never on training text
                          "train": train_record(trained)}               # what `kept_plan` reads back
            forget_recovery(out, plan)  # what was recovered from the plan it replaces, if that differs
            plan.save(out / PLAN)  # on disk before anything else can fail
        with timed(timings, "evaluate"):
            results.append(kept.row(f"PATCH {opts.variant}", lambda: row(
                f"PATCH {opts.variant}", "patch", "hybrid", plan.sparsity,
                score_copy(bundle, lambda: plan.apply(bundle.reload()), data, opts, reference()), trained.seconds),
                *TRAINED))
    if opts.recover:  # rank 0 alone, or every rank with --fsdp
        recover_row(bundle, plan, data, opts, results, timings, kept, reference, out / RECOVER_CHECKPOINT,
                    save_to=out / RECOVERED_PLAN)
    if opts.baselines:
        baselines(bundle, cfg, data, opts, calib, prior_masks, exported, results, timings, kept, reference, out,
                  todo.nm)

    if rank != 0:
        dist.barrier()
        return {}
    report = run_report(bundle, data, cfg, opts, plan, trained, results, out, command, timings)
    report["resumed_rows"] = kept.reused  # read back from rows.json, not scored by this process
    write_run(bundle, opts, plan, out, report, timings)
    if size > 1:
        dist.barrier()
    return report


def baselines(bundle, cfg: PatchConfig, data: dict, opts: PruneOptions, calib, prior_masks, exported,
              results: list[dict], timings: dict[str, float], kept: KeptRows | None, reference: Callable,
              out: Path, train_nm: bool = True) -> None:
    """The baseline rows: the one-shot 2:4 methods (rank 0), then learned 2:4 (`variant="nm"` at 50%, every
    rank trains, checkpointed beside PATCH) from the same prior and steps, recovered as PATCH was when
    --recover is given. `train_nm`: False when learned 2:4's rows are kept (`still_to_do`)."""
    rank = world()[0]
    with timed(timings, "baselines"):
        if rank == 0:
            for method in ONESHOT_METHODS:
                masks = prior_masks if method == cfg.prior else None
                make = functools.partial(oneshot_baseline, bundle, method, calib, opts.progress, masks)
                score = functools.partial(score_copy, bundle, make, data, opts)
                results.append(kept.row(f"{method} 2:4", lambda m=method, s=score: row(
                    f"{m} 2:4", m, "2:4", 0.5, s(reference()))))
        if train_nm:
            nm_cfg = cfg.replace(variant="nm", sparsity=0.5)
            nm_plan, nm_trained = train(bundle, nm_cfg, data, opts, calib, out / NM_CHECKPOINT, opts.resume,
                                        prior_masks, steps=opts.steps, exported=exported)
    if rank == 0:
        results.append(kept.row(NM_ROW, lambda: row(
            NM_ROW, "patch-nm", "2:4", nm_plan.sparsity,
            score_copy(bundle, lambda: nm_plan.apply(bundle.reload()), data, opts, reference()), nm_trained.seconds),
            *TRAINED))
    if opts.recover:  # the baseline gets the same recovery as PATCH
        recover_row(bundle, nm_plan if train_nm else None, data, opts, results, timings, kept, reference,
                    out / NM_RECOVER_CHECKPOINT)


@dataclass(frozen=True)
class ToDo:
    """What a run (resumed or not) still has to do before training, the same on every rank."""

    prior: bool  # PATCH or learned 2:4 starts from the prior (not from a checkpoint)
    patch: bool  # PATCH is trained and hardened (its row and plan are not kept)
    nm: bool  # learned 2:4 is trained (its rows are not kept)
    oneshot: tuple[str, ...]  # one-shot methods whose rows are not kept (rank 0 scores them)
    saved: tuple[TilePlan, TrainResult] | None = None  # rank 0, PATCH not trained: its kept plan (`kept_plan`)


def still_to_do(out: Path, opts: PruneOptions, kept: KeptRows | None) -> ToDo:
    """Rank 0 reads the kept rows and tells every rank; a run resumed from a checkpoint needs no prior for it."""
    rank = world()[0]
    shared, saved = None, None
    if rank == 0:
        nm_rows = kept.has(NM_ROW, options=TRAINED) and (not opts.recover or kept.has(NM_ROW + RECOVERY,
                                                                                      options=RECOVERED))
        saved = kept_plan(out, opts) if kept.has(f"PATCH {opts.variant}", options=TRAINED) else None
        shared = (saved is None, opts.baselines and not nm_rows,
                  tuple(m for m in ONESHOT_METHODS if opts.baselines and kept.get(f"{m} 2:4") is None))
    patch, nm, oneshot = agree(shared)
    patch_prior = patch and not resumes_from(out / CHECKPOINT, opts.resume)
    nm_prior = nm and not resumes_from(out / NM_CHECKPOINT, opts.resume)
    return ToDo(patch_prior or nm_prior, patch, nm, oneshot, saved if rank == 0 else None)


def kept_plan(out: Path, opts: PruneOptions) -> tuple[TilePlan, TrainResult] | None:
    """The plan an earlier process of this run hardened and saved after --steps steps, with what its training
    did (from its meta); None where there is none, or it was trained for other steps or by an older patchc."""
    path = out / PLAN
    if not opts.resume or not path.is_file():
        return None
    try:
        plan = TilePlan.load(path)
    except (OSError, ValueError) as exc:  # damaged since: train and harden it again
        say(f"{path}: not read back ({exc}); hardening PATCH again from its checkpoint")
        return None
    record = plan.meta.get("train")
    if not isinstance(record, dict) or record.get("step") != opts.steps:
        return None
    return plan, TrainResult(history=[record["final"]] if record.get("final") else [], step=int(record["step"]),
                             seconds=float(record.get("seconds", 0.0)))


def train_record(trained: TrainResult) -> dict:
    """What a plan's meta keeps of its training (`kept_plan` reads it back): steps, seconds, last log record."""
    return {"step": trained.step, "seconds": round(trained.seconds, 2),
            "final": trained.history[-1] if trained.history else {}}


def write_run(bundle, opts: PruneOptions, plan, out: Path, report: dict, timings: dict[str, float]) -> None:
    """The pictures, then report.json / report.md naming every file (the plans are written already)."""
    from patchc.job.report import plot_plan, remove_pictures, write_report

    title = f"{bundle.name}: PATCH {opts.variant} at {plan.sparsity:.1%} sparsity"
    with timed(timings, "write"):
        if opts.plots:
            pictures = plot_plan(plan, out, title=title)
        else:
            remove_pictures(out)
            pictures = []
    recovered_file = {"plan_recovered": str(out / RECOVERED_PLAN)} if opts.recover else {}
    report["files"] = {"plan": str(out / PLAN), **recovered_file, **{p.stem: str(p) for p in pictures},
                       "report_json": str(out / "report.json"), "report_md": str(out / "report.md")}
    write_report(report, out)  # last, outside the timings, so the files hold every number the dict does


def recover_row(bundle, plan, data: dict, opts: PruneOptions, results: list[dict], timings: dict[str, float],
                kept: KeptRows | None, reference: Callable, checkpoint: Path, save_to: Path | None = None) -> None:
    """One more row, named after the last one: `plan` with its kept weights fine-tuned (masks fixed, same text
    and loss as mask training), written to `save_to` if given. Kept from an earlier process where its inputs
    are unchanged (and `save_to` exists); `plan` is None only then, and on ranks other than 0. Recovery
    checkpoints to `checkpoint` (a --resume goes on from it) until its row is kept. Every rank calls it: rank 0
    recovers alone, or every rank recovers its shards (--fsdp: `recovers_sharded`); rank 0 scores."""
    rank = world()[0]
    sharded = recovers_sharded(opts)
    if rank != 0 and not sharded:
        return
    name = results[-1]["name"] + RECOVERY if rank == 0 else ""
    if rank == 0 and save_to is not None and not save_to.exists():
        kept.drop(name)  # its plan is gone: recover again
    todo = rank == 0 and kept.get(name, *RECOVERED) is None
    if sharded:
        todo = agree(todo)  # rank 0's kept rows decide
    recovered, seconds = None, 0.0
    if todo:
        with timed(timings, "recover"):
            start = time.perf_counter()
            recovered = recover_plan(bundle, plan, data, opts, checkpoint=checkpoint, resume=opts.resume)
            seconds = time.perf_counter() - start
    if rank != 0:
        return

    def score() -> dict:
        last = results[-1]
        if save_to is not None:
            recovered.save(save_to)
        with timed(timings, "evaluate"):
            metrics = score_copy(bundle, lambda: recovered.apply(bundle.reload()), data, opts, reference())
        return row(name, f"{last['method']}+recover", last["pattern"], recovered.sparsity, metrics, seconds)

    results.append(kept.row(name, score, *RECOVERED))
    remove(checkpoint)  # its row is kept: the next --resume reads that instead


__all__ = ["PruneOptions", "run_prune"]
