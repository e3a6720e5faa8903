"""Run folders: claimed atomically, marked while in progress, resumed only with the settings they started with.

    runs/<name>/.patchc-run   the claim: {"pid", "host", "started"}; created with O_EXCL, removed at the end.
                              A claim whose process is gone (same host) is stale: the next run takes it over.
    runs/<name>/run.json      the settings that change the result, written before training starts;
                              `--resume` compares every one of them and names each difference.
    runs/<name>/masks.ckpt    mask training's checkpoint (a folder under --fsdp); masks-nm.ckpt: learned 2:4's.
    runs/<name>/plan.patch    the plan, written as soon as it is hardened (plan-recovered.patch once recovered,
                              with recover.json by `patchc recover`; both go when a resumed run writes a new plan).
    runs/<name>/recover.ckpt  weight recovery's checkpoint while it runs (recover-nm.ckpt: learned 2:4's).
    runs/<name>/rows.json     every row scored so far, with its inputs: what --resume reuses (`resume.py`).
    runs/<name>/report.json   written last: its presence means the run finished. A fresh start (--overwrite)
                              removes it first, then the earlier run's plans, records, checkpoints and rows.

Two `patchc prune` runs started together never share a folder: the O_EXCL claim lets exactly one of them
have it (the other takes the next free name, or fails with a clear error for an explicit --out).

Example:
    >>> check_out(opts)                                                         # before any work: read-only
    >>> out = claim_run_dir(None, Path("runs"), "stories260K", resume=False)   # runs/stories260K[-N]
    >>> settings = check_settings(out, opts, resume=False)                      # writes run.json
    >>> release(out)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import socket
from pathlib import Path

from patchc.job.options import PruneOptions
from patchc.utils.files import check_writable, read_record, write_bytes_atomic
from patchc.utils.owners import foreign, orphaned, owner_tag, process_alive

CLAIM = ".patchc-run"
SETTINGS = "run.json"
CHECKPOINT = "masks.ckpt"
NM_CHECKPOINT = "masks-nm.ckpt"
PLAN, RECOVERED_PLAN = "plan.patch", "plan-recovered.patch"
RECOVER_RECORD = "recover.json"  # `patchc recover`'s record of its recovery of the plan
RECOVER_CHECKPOINT, NM_RECOVER_CHECKPOINT = "recover.ckpt", "recover-nm.ckpt"
ROWS = "rows.json"
# A sharded (--fsdp) checkpoint is saved to <path>.next, the one it replaces waits in <path>.prev meanwhile.
STAGING, PREVIOUS = ".next", ".prev"
REPORT = ("report.json", "report.md")
# PruneOptions fields that do not change the plan or its training: free to differ on --resume.
FREE = ("out", "eval_context", "baselines", "device", "threads", "resume", "overwrite", "progress", "plots",
        "steps", "eval_data", "eval_tokens", "recover", "recover_loss", "recover_lr", "recover_scope",
        "recover_splice", "offload")  # mask checkpoint unchanged


# What a run did before these options existed: a run.json without them was trained that way.
OLDER_RUNS = {"train_data": "real", "loss": "lm", "train_extra": []}


class RunError(ValueError):
    """A run folder cannot be used as asked (busy, finished, settings differ); the message says what to do."""


def _changed(name: str, was: object, now: object) -> str:
    """A setting that differs, as the flags read: `--lr 0.01 (now 0.001)`, `--tile 16 16 (now 32 32)`,
    `with --fsdp (now without)`, `without --no-bos (now with)`, `--train-extra none (now more.txt)`."""
    from patchc.job.prune_args import add_prune_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_prune_arguments(parser)
    action = next((a for a in parser._actions if a.dest == name and a.option_strings), None)
    flag = action.option_strings[0] if action else "--" + name.replace("_", "-")
    if action is not None and action.nargs == 0:  # a switch: given or not
        given = ("with", "without") if was == action.const else ("without", "with")
        return f"{given[0]} {flag} (now {given[1]})"

    def typed(value: object) -> str:
        if isinstance(value, list):
            return " ".join(map(str, value)) if value else "none"
        return "the default" if value is None else str(value)

    return f"{flag} {typed(was)} (now {typed(now)})"


def _try_claim(folder: Path) -> str | None:
    """Create the claim file exclusively; None on success, else why the folder is busy."""
    claim = folder / CLAIM
    record = {"pid": os.getpid(), "host": socket.gethostname(), "owner": owner_tag(),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for _ in range(2):  # a second try after removing a stale claim
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            try:
                held = json.loads(claim.read_text())
            except (OSError, ValueError):
                held = {}
            held = held if isinstance(held, dict) else {}  # damaged: busy, by whom unknown
            # its owner's pid is checked only on this host and in this PID namespace (`utils.owners`): a container
            # sharing the host's name has pids of its own; a claim of an older patchc has host and pid alone
            owner, pid = held.get("owner"), held.get("pid")
            if (orphaned(owner) if isinstance(owner, str) else
                    held.get("host") == record["host"] and isinstance(pid, int) and not process_alive(pid)):
                claim.unlink(missing_ok=True)  # stale: the run that held it died without cleaning up
                continue
            other = foreign(owner) if isinstance(owner, str) else held.get("host") != record["host"]
            return (f"another patchc run (pid {held.get('pid', '?')} on {held.get('host', '?')}, started "
                    f"{held.get('started', '?')}) is using it"
                    + (f"; if that machine no longer runs it, delete {claim} and run again" if other else ""))
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        return None
    return "its claim file keeps reappearing"


def _finished(folder: Path) -> bool:
    return (folder / REPORT[0]).exists()


def _foreign(folder: Path) -> list[str]:
    """The names in `folder` when it holds files but no patchc run (no claim, run.json, checkpoint or report),
    else []: a user's folder, whose report.md or plan.patch a run would overwrite."""
    if not folder.is_dir() or any((folder / name).exists() for name in (CLAIM, SETTINGS, CHECKPOINT, REPORT[0])):
        return []
    return sorted(p.name for p in folder.iterdir())


def unfinish(folder: Path) -> None:
    """The run's outputs are about to change (a resumed or overwritten run writes its plan): its old report
    goes, so that the folder reads as finished again only once the new one is written."""
    for name in REPORT:
        (folder / name).unlink(missing_ok=True)


def forget_recovery(folder: Path, plan) -> None:
    """`plan` is about to replace the run's plan: if its tiles or masks differ, the recovered plan made from the
    old one (and `patchc recover`'s record of it) go, or `patchc eval RUN/plan-recovered.patch` would score a
    plan of other tiles unwarned. The same plan hardened again (a resume that rescores) keeps them."""
    import torch  # here: the CLI reads this module before torch is imported

    from patchc.ir import TilePlan

    if not (folder / RECOVERED_PLAN).exists() and not (folder / RECOVER_RECORD).exists():
        return
    try:
        old = TilePlan.load(folder / PLAN)
        same = old.layers.keys() == plan.layers.keys() and all(
            torch.equal(old.layers[f].kinds, layer.kinds) and torch.equal(old.layers[f].mask(), layer.mask())
            for f, layer in plan.layers.items())
    except (OSError, ValueError):  # no readable plan before this one: nothing says the recovery is its
        same = False
    if not same:
        for name in (RECOVERED_PLAN, RECOVER_RECORD):
            (folder / name).unlink(missing_ok=True)


def claim_run_dir(out: str | os.PathLike | None, root: Path, name: str, resume: bool, overwrite: bool = False) -> Path:
    """The run folder, claimed for this process: `out`, or the first free `root/<name>[-N]` (one no run started
    or finished in, and not a user's own non-empty folder)."""
    if out is not None:
        folder = Path(out)
        _make_dir(folder)
        _check_finished(folder, resume, overwrite)
        busy = _try_claim(folder)
        if busy:
            raise RunError(f"--out {folder}: {busy}; wait for it or choose another --out")
        return folder
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    for n in range(1, 10_000):
        folder = root / (safe if n == 1 else f"{safe}-{n}")
        if folder.exists() and (_finished(folder) or (folder / SETTINGS).exists() or _foreign(folder)):
            continue  # finished or started runs keep their folder, and a user's own folder is left alone
        _make_dir(folder)
        if _try_claim(folder) is None:
            return folder
    raise RunError(f"{root}: no free run folder for {safe}; clean up old runs or pass --out")


def check_out(opts: PruneOptions) -> None:
    """Read-only: raise the RunError that claiming `opts.out` and checking its settings would raise, so a
    wrong --out fails before the model loads and training text is generated. Writes nothing (the claim
    checks again: another process may change the folder in between)."""
    if opts.out is None:
        if opts.resume:  # a new folder would be picked, with nothing in it to continue
            raise RunError("--resume needs --out: the folder of the run to continue")
        check_writable("runs", "runs/ (the run folders without --out)", "pass --out")
        return
    folder = Path(opts.out)
    _check_parents(folder)
    check_writable(folder, f"--out {folder}")
    _check_finished(folder, opts.resume, opts.overwrite)
    if folder.is_dir() or opts.resume:
        _settings_schedule(folder, opts, opts.resume, opts.overwrite)


def _check_parents(folder: Path) -> None:
    for parent in [folder, *folder.parents]:
        if parent.exists() and not parent.is_dir():
            raise RunError(f"--out {folder}: {parent} is a file, not a folder")


def _check_finished(folder: Path, resume: bool, overwrite: bool) -> None:
    if _finished(folder) and not (resume or overwrite):
        raise RunError(f"--out {folder} already holds a finished run (report.json); choose another --out, "
                       "or pass --overwrite to replace it")
    others = [] if resume or overwrite else _foreign(folder)  # --resume says it has no checkpoint
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise RunError(f"--out {folder} is not a patchc run folder and holds {shown}; choose a new or empty "
                       "--out, or pass --overwrite to write the run among them, replacing any of a run's names "
                       "(report.md, plan.patch, ...)")


def _make_dir(folder: Path) -> None:
    _check_parents(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"--out {folder}: cannot create the folder ({e.strerror or e})") from None


def release(folder: Path, failed: bool = False) -> None:
    """Drop this process's claim. A run that `failed` before writing a checkpoint leaves no trace: its
    run.json and rows.json go, and the folder too if nothing else is in it."""
    (folder / CLAIM).unlink(missing_ok=True)
    if failed and not (folder / CHECKPOINT).exists() and not _finished(folder):
        (folder / SETTINGS).unlink(missing_ok=True)
        (folder / ROWS).unlink(missing_ok=True)
        try:
            folder.rmdir()  # only if empty: never remove a user's files
        except OSError:
            pass


def remove(path: Path) -> None:
    """Remove a file, or a checkpoint folder (--fsdp) with the `.prev` / `.next` it may have left."""
    for p in (path, path.with_name(path.name + PREVIOUS), path.with_name(path.name + STAGING)):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def find_plan(run_dir: str | os.PathLike) -> Path:
    """`<run>/plan.patch`, or FileNotFoundError in one line saying what a run folder is."""
    run = Path(run_dir)
    if not (run / PLAN).is_file():
        what = "no such folder" if not run.exists() else f"no {PLAN} in it"
        raise FileNotFoundError(f"{run}: {what}; give the folder of a finished `patchc prune` run "
                                f"(its --out), which holds {PLAN}")
    return run / PLAN


def resolve_plan(path: str | os.PathLike) -> Path:
    """A plan file as given, or a run folder's plan.patch (`find_plan`): what every plan command reads."""
    return find_plan(path) if Path(path).is_dir() else Path(path)


def check_plan_path(path: str | os.PathLike, served: bool = False) -> None:
    """Before torch is imported, so that a typo answers at once: `path` exists, and a folder holds a plan
    (`find_plan`) unless `served` (a folder `patchc export` / `import` wrote is read later, by its config)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such plan file or run folder")
    if Path(path).is_dir() and not served:
        find_plan(path)


def check_served_path(path: str | os.PathLike) -> None:
    """`check_plan_path` for commands that also read a folder `patchc export` / `patchc import` wrote."""
    check_plan_path(path, served=True)


def settings_of(opts: PruneOptions) -> dict:
    """The options that change the result, JSON-ready, with paths made absolute."""
    values = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts) if f.name not in FREE}
    if opts.tile is None:  # automatic: compared once the loaded model has chosen it (`job.model.with_tile`)
        del values["tile"]
    values["data"] = [str(Path(p).resolve()) for p in opts.data]
    if Path(opts.model).exists():
        values["model"] = str(Path(opts.model).resolve())
    return json.loads(json.dumps(values))  # tuples -> lists, as they read back


def check_settings(folder: Path, opts: PruneOptions, resume: bool, overwrite: bool = False) -> int:
    """Write (fresh run) or compare (resume) `run.json`; returns the schedule length T to train with.

    A resumed run may ask for more --steps than it started with: it goes on at the schedules' final values.
    """
    schedule = _settings_schedule(folder, opts, resume, overwrite)
    if not resume:  # a fresh start: nothing of an earlier run in this folder is continued, reused or kept
        unfinish(folder)  # first: a start killed from here on leaves an unfinished run, never a finished mix of two
        for name in (PLAN, RECOVERED_PLAN, RECOVER_RECORD, CHECKPOINT, NM_CHECKPOINT, RECOVER_CHECKPOINT,
                     NM_RECOVER_CHECKPOINT, ROWS):
            remove(folder / name)
    _write(folder / SETTINGS, settings_of(opts), opts.steps, schedule)
    return schedule


def _settings_schedule(folder: Path, opts: PruneOptions, resume: bool, overwrite: bool) -> int:
    """Read-only part of `check_settings`: the schedule length, or the RunError that says why not."""
    path, ckpt = folder / SETTINGS, folder / CHECKPOINT
    now = settings_of(opts)
    if not resume:
        if ckpt.exists() and not overwrite:
            raise RunError(f"--out {folder} holds a training checkpoint ({CHECKPOINT}); pass --resume to continue "
                           "it or --overwrite to start again")
        return opts.steps
    if not ckpt.exists():
        raise RunError(f"--resume: {folder} has no checkpoint ({CHECKPOINT}) to continue; drop --resume to start")
    if not path.exists():
        raise RunError(f"--resume: {folder} has no {SETTINGS} (a run from an older patchc); its settings cannot be "
                       "checked, so start a new run")
    saved = read_record(path, "run", "its settings cannot be checked, so start again with --overwrite instead of "
                        "--resume, or in another --out", needs={"settings": dict, "steps": int, "schedule_steps": int})
    was = OLDER_RUNS | saved["settings"]
    diffs = [_changed(k, was.get(k), v) for k, v in now.items() if was.get(k) != v]
    if diffs:
        raise RunError(f"--resume: {folder} was started with other settings: {'; '.join(diffs)}; rerun with the "
                       "original values, or start a new run in another --out")
    if opts.steps < int(saved["steps"]):
        raise RunError(f"--resume: --steps {opts.steps} is fewer than the {saved['steps']} the run was started with; "
                       "a run can be extended, not shortened")
    return int(saved["schedule_steps"])


def _write(path: Path, settings: dict, steps: int, schedule: int) -> None:
    record = {"format": "patchc.run", "version": 1, "settings": settings, "steps": steps, "schedule_steps": schedule}
    write_bytes_atomic(path, (json.dumps(record, indent=1) + "\n").encode())
