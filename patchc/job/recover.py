"""`patchc recover RUN`: fine-tune the weights a finished prune run's plan keeps, on that run's training text.

    run folder -> plan.patch + run.json -> the model and the run's exact training split
        -> score dense / hardened -> `patchc.recover` -> plan-recovered.patch -> score recovered -> recover.json

The training split is rebuilt from what the plan records (`plan.meta["data"]`: files, seed, fraction,
encoding, BOS, and the ids of its training documents, which must match) and the batch settings from the
run's `run.json`; scores are on the run's held-out documents, as `patchc eval` scores the plan. The
recovered plan keeps the dense model's fingerprints, so `patchc eval RUN/plan-recovered.patch` and
`plan.apply(dense)` work on it as on plan.patch, which is never touched.

Example:
    >>> result = run_recover("runs/stories260K", steps=300)
    >>> [(r["name"], round(r["perplexity"], 2)) for r in result["results"]]
    [('dense', 5.26), ('hardened', 7.61), ('recovered', 6.64)]

Measured (`patchc prune --no-baselines --out R && patchc recover R`: stories260K, 35%, seed 0, the
defaults: KD on real + generated text, 300 steps at lr 3e-3): held-out perplexity 7.61 -> 6.64 (1.45x
-> 1.26x dense), WikiText-2 152.5 -> 148.1. With `--loss lm+kd` held-out falls further (6.38) but
WikiText-2 rises (167.6): the LM term fits the run's text past what the dense model does. The one-shot
SparseGPT update made an earlier plan worse (10.22 -> 11.50).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from patchc.job.options import PruneOptions
from patchc.job.resume import forget_recovered
from patchc.job.runs import (OLDER_RUNS, PLAN, RECOVER_CHECKPOINT, RECOVER_RECORD, RECOVERED_PLAN, SETTINGS, find_plan,
                             remove, resolve_plan)
from patchc.utils.env import device_name, versions
from patchc.utils.files import RecordError, check_writable, json_kind, read_record, write_bytes_atomic
from patchc.utils.stopping import exit_on_signals

RESULT = RECOVER_RECORD


def load_any_plan(path: str | os.PathLike) -> Any:
    """The TilePlan of a plan file, a run folder, or a folder `patchc export` / `patchc import` wrote.

    Example:
        >>> load_any_plan("served/").summary()      # kernels for an imported model: patchc generate served/
    """
    from patchc.export.format import CONFIG
    from patchc.export.pretrained import load_plan
    from patchc.ir import TilePlan

    if (Path(path) / CONFIG).is_file():
        return load_plan(path)
    return TilePlan.load(resolve_plan(path))


def recover_options(plan: Any, run: Path, **changes: Any) -> PruneOptions:
    """The run's PruneOptions with `changes` applied: its run.json (every setting that changes the result,
    training text included), else what the plan records (`patchc eval`'s `eval_options`).

    Raises ValueError when the plan records no split: its training text could not be rebuilt.
    """
    from patchc.job.rescore import eval_options, recorded_split

    if not recorded_split(plan).get("files"):
        raise ValueError(f"{run / PLAN}: the plan records no data split (made outside `patchc prune` or by an "
                         "older patchc), so its training text cannot be rebuilt; prune again with this version")
    opts = run_options(run / SETTINGS) if (run / SETTINGS).is_file() else eval_options(plan)
    fixed = {"out": str(run), "resume": False, "overwrite": False, "baselines": False}
    return dataclasses.replace(opts, **fixed, **changes)


def run_options(path: Path) -> PruneOptions:
    """The PruneOptions a run.json records; a setting of the wrong type or out of range is blamed on the file,
    not on a flag the user never typed."""
    todo = f"restore the run's {SETTINGS}, or move it away to recover with the settings its {PLAN} records"
    settings = read_record(path, "run", todo, needs={"settings": dict})["settings"]
    fields = {f.name: f.default for f in dataclasses.fields(PruneOptions)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if k in fields}
    older = {k: v for k, v in OLDER_RUNS.items() if k in fields and k not in settings}
    bad = next((k for k, v in values.items() if not _fits(v, fields[k])), None)
    like = list(fields[bad]) if isinstance(fields.get(bad), tuple) else fields.get(bad)  # as JSON holds it
    why = None if bad is None else f"{bad!r} is {json_kind(settings[bad])}, not {json_kind(like)}"
    if why is None:
        try:
            return PruneOptions(**(older | values))
        except (TypeError, ValueError) as exc:  # PruneOptions' own checks, worded for flags
            why = str(exc)
    raise RecordError(f"{path}: not a patchc run record (settings: {why}); {todo}")


def _fits(value: Any, default: Any) -> bool:
    """`value` has the type of the option's `default` (any, where that is None; an int for a float)."""
    if default is None or default is dataclasses.MISSING:
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default)
    kinds = (int, float) if isinstance(default, float) else type(default)
    return isinstance(value, kinds)


def run_evaluation(run: Path) -> dict[str, int]:
    """{"eval_context", "eval_tokens"}: the perplexity window and the cap per --eval-data file `patchc prune`
    scored the run with (report.json), so that recovery's scores compare with the run's; else the defaults."""
    scored = {"eval_context": PruneOptions.eval_context, "eval_tokens": PruneOptions.eval_tokens}
    try:
        report = json.loads((run / "report.json").read_text())
        evaluation, data = report.get("evaluation") or {}, report.get("data") or {}
        evaluation, data = (x if isinstance(x, dict) else {} for x in (evaluation, data))
    except (OSError, ValueError, AttributeError):  # no report, or not a JSON object
        return scored
    if isinstance(evaluation.get("context"), int):
        scored["eval_context"] = evaluation["context"]
    extra = data.get("eval_extra_tokens") or {}
    if isinstance(evaluation.get("eval_tokens"), int):
        scored["eval_tokens"] = evaluation["eval_tokens"]
    elif extra and all(isinstance(n, int) and n > 0 for n in extra.values()):  # before the cap was recorded:
        scored["eval_tokens"] = max(extra.values())  # the largest file scored held the cap, or none reached it
    return scored


def recovery_recipe(loss: str | None = None, train_data: str | None = None, train_extra: list[str] | None = None,
                    splice: float | None = None) -> dict[str, Any]:
    """`run_recover`'s recipe from `patchc recover`'s flags: the PruneOptions given, None ones left out."""
    given = {"recover_loss": loss, "train_data": train_data, "train_extra": train_extra, "recover_splice": splice}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}


def check_free(run: Path, overwrite: bool, resume: bool = False) -> None:
    """FileExistsError, before any work, if an earlier recovery (or `prune --recover`) left its files in `run`:
    a finished one's plan and record (--overwrite replaces them), or an unfinished one's checkpoint (--resume
    goes on from it, --overwrite starts again)."""
    earlier = [name for name in (RECOVERED_PLAN, RESULT) if (run / name).exists()]
    unfinished = (run / RECOVER_CHECKPOINT).exists()
    if earlier and not overwrite and not (resume and unfinished):  # going on replaces them, as it was to
        also = f" (or --resume to go on from the unfinished one's {RECOVER_CHECKPOINT})" if unfinished else ""
        raise FileExistsError(f"{run}: an earlier recovery wrote {' and '.join(earlier)}; pass --overwrite to "
                              f"replace it{also}, or recover a copy of the run folder to keep both")
    if unfinished and not (resume or overwrite):
        raise FileExistsError(f"{run}: an unfinished recovery left {RECOVER_CHECKPOINT}; pass --resume to go on "
                              "from it (with the same settings) or --overwrite to start again")


def check_split(plan: Any, rebuilt: dict, where: Path, changed: tuple[str, ...] = ()) -> None:
    """The rebuilt training text is the one the plan records (files, seeds, documents...), or ValueError.

    `changed`: record keys a recovery recipe changes on purpose (e.g. "train_data"); the held-out
    documents are still the run's, since files, split seed and fraction are always checked.
    """
    recorded = plan.meta["data"]
    differ = [k for k, v in recorded.items() if k in rebuilt and k not in changed and rebuilt[k] != v]
    if differ:
        raise ValueError(f"{where}: the training text rebuilt for recovery differs from the plan's in "
                         f"{', '.join(differ)} (the text files or run.json changed since the run?)")


@exit_on_signals()  # SIGTERM, Ctrl-C: recovery stops after a step with its checkpoint written (`--resume`)
def run_recover(
    run_dir: str | os.PathLike,
    steps: int = 300,
    lr: float | None = None,
    scope: str = "all",
    *,
    method: str = "adam",
    batch_size: int | None = None,
    schedule: str = "cosine",
    eval_context: int | None = None,
    device: str = "cpu",
    threads: int = 0,
    progress: bool = True,
    command: str | None = None,
    recipe: dict[str, Any] | None = None,
    overwrite: bool = False,
    resume: bool = False,
) -> dict:
    """Recover the run's plan; writes `<run>/plan-recovered.patch` and `<run>/recover.json`, returns the latter.

    Recovery trains on the run's own training text with the run's --recover-loss (and, when `lr` is
    None, its --recover-lr); `recipe` changes those PruneOptions for recovery only (e.g.
    {"recover_loss": "lm+kd", "train_data": "mix", "train_extra": ("more.txt",)}), never the held-out documents
    it is scored on. An earlier recovery's plan and record are kept unless `overwrite` (refused up front).
    Adam recovery checkpoints to `<run>/recover.ckpt` until it ends; `resume` goes on from there when the
    same recovery wrote it (else it warns and starts over).
    `eval_context` None: the perplexity window the run was scored with (its report.json), else 256; each
    --eval-data file is scored up to as many tokens as the run's were.
    Under `torchrun --nproc_per_node=N` every rank recovers its shards (`fsdp_recover`) and rank 0 scores and
    writes; the others return {}.

    Example:
        >>> run_recover("runs/x", steps=100, scope="values")["results"][-1]["perplexity"]
    """
    from patchc.ir import TilePlan
    from patchc.job import stages as job
    from patchc.job.corpus import check_text_files, data_record, load_data
    import torch.distributed as dist

    from patchc.job.distributed import launched_size, process_group, say, world
    from patchc.job.prune import cache_dir
    from patchc.job.memory import check_hessian, check_recovery, free_bytes
    from patchc.job.model import load_bundle
    from patchc.pruning.observe import plain_layers

    run = Path(run_dir)
    plan = TilePlan.load(find_plan(run))
    check_free(run, overwrite, resume)
    check_writable(run, str(run), "recovery writes its checkpoints and plan-recovered.patch there; recover a copy "
                   "of the run folder")
    if method != "adam" and launched_size() > 1:
        raise ValueError(f"recover --method {method} updates each layer once, in one process: run it without torchrun")
    recipe = dict(recipe or {})
    if {"data", "split_seed", "eval_fraction", "encoding", "text_field"} & set(recipe):
        raise ValueError("recover: the recipe may change the training text and loss, not the held-out split "
                         f"(got {sorted(recipe)}); recovery is scored on the run's own held-out documents")
    with process_group(device):  # under torchrun: every rank recovers its shards, rank 0 scores and writes
        rank, size = world()
        if resume and method == "adam" and not (run / RECOVER_CHECKPOINT).exists():
            say(f"{run}: no {RECOVER_CHECKPOINT} to go on from; recovering from the first step")
        scored = run_evaluation(run) | ({} if eval_context is None else {"eval_context": eval_context})
        changes = {"device": device, **scored, "threads": threads,
                   "progress": progress and rank == 0, "fsdp": size > 1, **recipe}
        opts = recover_options(plan, run, **changes, **({"batch_size": batch_size} if batch_size else {}))
        started = time.perf_counter()
        check_text_files(opts)  # before the model loads
        bundle = load_bundle(opts)
        if method == "adam" and (free := free_bytes(opts.device)) is not None:  # before text is generated
            check_recovery(bundle.model, sum(layer.numel for layer in plan.layers.values()), free, opts.device,
                           share=size, hint="Pass --device with more memory, run it on more GPUs (torchrun "
                           "--nproc_per_node=N -m patchc recover ...), or --method sparsegpt (no training state)")
        if method == "sparsegpt":
            check_hessian(plain_layers(bundle.model, opts.patch_config().exclude), opts.device, "--method sparsegpt",
                          "use --method adam")
        data = load_data(bundle, opts, cache_dir=cache_dir(opts))  # generated text: the run's cache
        other_text = (("self_tokens",) * ("train_data" in recipe)  # another --train-data may generate another amount
                      + ("train_extra_documents",) * ("train_extra" in recipe))
        check_split(plan, data_record(data, opts), run / PLAN, changed=tuple(recipe) + other_text)
        scores, dense_ref = {}, None
        if rank == 0:
            dense_ref = job.dense_reference(bundle, data)
            scores = {"dense": job.evaluate(bundle, bundle.model, data, opts, dense_ref)}
            scores["hardened"] = job.score_copy(bundle, lambda: plan.apply(bundle.reload()), data, opts, dense_ref)
        model = bundle.reload() if size == 1 else None  # the dense model stays the teacher of a KD loss
        calib = job.calibrate(bundle, data, opts) if method == "sparsegpt" else None
        recovered = job.recover_plan(bundle, plan if rank == 0 else None, data, opts, model=model, steps=steps, lr=lr,
                                     scope=scope, method=method, calib=calib, schedule=schedule, progress=opts.progress,
                                     checkpoint=run / RECOVER_CHECKPOINT, resume=resume)
        if rank != 0:
            dist.barrier()  # leave with rank 0: a rank that exits first can abort the others' process group
            return {}
        recovered.meta["command"] = command or ""
        recovered.meta["recovery"] |= {"from": str(run / PLAN), "recipe": recipe}
        # the teacher waits in host memory while the recovered copy is scored
        copy = model if model is not None else bundle.reload()  # sharded: the ranks' copies are gone
        scores["recovered"] = job.score_copy(bundle, lambda: recovered.apply(copy), data, opts, dense_ref)
        result = report(bundle, plan, recovered, scores, data, opts, run, command, time.perf_counter() - started)
        # plan and record back to back, the old record gone first: a kill between them leaves a plan without a
        # record and the checkpoint (--resume finishes it, --overwrite redoes it), never a record of another plan
        remove(run / RESULT)
        recovered.save(run / RECOVERED_PLAN)
        write_bytes_atomic(run / RESULT, (json.dumps(result, indent=1) + "\n").encode())
        remove(run / RECOVER_CHECKPOINT)  # finished: its plan and record are written
        note_replaced(run, result)
        if size > 1:
            dist.barrier()
        return result


def note_replaced(run: Path, result: dict) -> None:
    """A `prune --recover` run's report.json / report.md list the recovered plan this recovery just replaced:
    say so there (when, by which command, where the new scores are) instead of leaving them to mislead."""
    from patchc.job.report import write_report

    forget_recovered(run)  # `prune --resume` must not reuse rows scored on the plan replaced here
    path = run / "report.json"
    try:
        report = json.loads(path.read_text()) if path.is_file() else {}
        if "plan_recovered" in (report.get("files") or {}):
            report["recovery_replaced"] = {"command": result["command"], "date": result["date"],
                                           "record": str(run / RESULT)}
            write_report(report, run)
    except (OSError, ValueError, AttributeError) as exc:  # the recovery itself is saved: only the note is lost
        warnings.warn(f"{path}: not updated to say its recovered plan was replaced: {exc}", stacklevel=2)


def report(bundle, plan, recovered, scores: dict, data: dict, opts: PruneOptions, run: Path, command: str | None,
           seconds: float) -> dict:
    """The recover.json record: dense / hardened / recovered scores and what recovery did."""
    from patchc.job.corpus import text_size
    from patchc.job.results import protocol, row

    metric = "perplexity" if bundle.kind == "causal" else "cosine"
    results = [row(name, name, "-" if name == "dense" else "hybrid", 0.0 if name == "dense" else plan.sparsity,
                   scores[name]) for name in ("dense", "hardened", "recovered")]
    out = {
        "command": command or "", "run": str(run), "model": bundle.name, "metric": metric,
        "plan": str(run / PLAN), "recovered_plan": str(run / RECOVERED_PLAN),
        "results": results,
        "recovery": {k: v for k, v in recovered.meta["recovery"].items() if k != "history"},
        "train_documents": data["docs_train"], "eval_documents": data["docs_eval"],
        "train_tokens": text_size(bundle.kind, data["train"]),
        "eval_tokens": text_size(bundle.kind, data["eval"]),
        "protocol": protocol(bundle, opts), "seconds": round(seconds, 2),
        "versions": versions(), "device": device_name(opts.device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if metric == "perplexity":
        dense = results[0]["perplexity"]
        out["vs_dense"] = {r["name"]: round(r["perplexity"] / dense, 4) for r in results[1:]}
    return out


def format_recover(result: dict) -> str:
    """A few lines for the terminal: each score and its ratio to dense, then each --eval-data file's."""
    metric = result["metric"]
    unit = "tokens" if metric == "perplexity" else "sentences"  # an encoder is scored per sentence
    lines = [f"{result['model']}: {metric} on held-out text ({result['eval_tokens']} {unit})"]
    for r in result["results"]:
        ratio = result.get("vs_dense", {}).get(r["name"])
        lines.append(f"  {r['name']:<10} {metric} {r[metric]:9.3f}" + (f"   ({ratio:.2f}x dense)" if ratio else ""))
    for name in result["results"][0].get(f"{metric}_extra") or {}:  # text beyond the run's domain, scored unsplit
        scores = "  ".join(f"{r['name']} {r[f'{metric}_extra'][name]:.3f}" for r in result["results"])
        lines.append(f"  {name}: {scores}")
    lines.append(f"wrote {result['recovered_plan']} and {Path(result['run']) / RESULT}")
    return "\n".join(lines)


__all__ = ["run_recover", "recover_options", "recovery_recipe", "format_recover", "load_any_plan", "RESULT"]
