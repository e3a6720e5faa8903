"""What `--resume` reuses: the rows a run has scored, kept in its folder as each one is scored.

A run that dies late (out of memory while a baseline is scored, a machine taken back after hours of
training) keeps its plan (`plan.patch`, written as soon as it is hardened; `plan-recovered.patch` as soon as
it is recovered), its mask checkpoints (`masks.ckpt`; `masks-nm.ckpt` for the learned 2:4 baseline) and
every row scored so far (`rows.json`). `patchc prune --resume` then trains no run that finished and scores
no row again whose inputs are unchanged. Each row is kept with the inputs it was scored under: the run's
settings (`run.json`), the scoring options, the device type, the weight dtype and the patchc and torch
versions, and for a trained row --steps, for a recovered one the --recover options too. A row is reused only
where all of them are equal, so resuming with more --steps trains and scores PATCH and learned 2:4 again but
not the dense or the one-shot rows, and resuming with --recover added only recovers.

    runs/<name>/rows.json   {"format": "patchc.rows", "version": 1, "rows": [{"row": {...}, "inputs": {...}}]}

Example:
    >>> kept = KeptRows(out, opts)
    >>> dense = kept.row("dense", lambda: row("dense", "dense", "-", 0.0, evaluate(...)))   # scored, or read back
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from patchc.job.options import PruneOptions
from patchc.job.runs import ROWS, settings_of
from patchc.utils.files import read_record, write_bytes_atomic

log = logging.getLogger(__name__)

FORMAT, VERSION = "patchc.rows", 1
# Options outside run.json that change a row: how every row is scored, what a trained row trained for, and
# how a recovered one was recovered.
SCORING = ("eval_context", "eval_data", "eval_tokens")
TRAINED = ("steps",)
RECOVERED = (*TRAINED, "recover", "recover_loss", "recover_lr", "recover_scope", "recover_splice")
RECOVERY = " + recovery"  # a recovered row's name: the row it recovered, and this


class KeptRows:
    """The rows of the run in `folder` that earlier processes scored, and the file this process adds to.

    Example:
        >>> kept = KeptRows(out, opts)
        >>> kept.row("PATCH joint", score_patch, *TRAINED)
        >>> kept.reused                                   # the names read back instead of scored
    """

    def __init__(self, folder: Path, opts: PruneOptions) -> None:
        from patchc.job.model import weight_dtype
        from patchc.utils.env import versions

        self.path = Path(folder) / ROWS
        self.opts = opts
        scoring = {name: getattr(opts, name) for name in SCORING}
        scoring["eval_data"] = [str(Path(p).resolve()) for p in opts.eval_data]
        built = {k: v for k, v in versions().items() if k in ("patchc", "torch")}  # another build may score otherwise
        self.base = settings_of(opts) | scoring | {"device": opts.device.partition(":")[0],
                                                   "dtype": str(weight_dtype(opts)), "versions": built}
        self.entries = read_rows(self.path) or {}
        self.reused: list[str] = []

    def inputs(self, *options: str) -> dict:
        """The inputs a row depends on: the run's, plus these `PruneOptions` fields (JSON-ready)."""
        extra = {name: getattr(self.opts, name) for name in options if name not in self.base}
        return json.loads(json.dumps(self.base | extra))  # tuples -> lists, as they read back

    def get(self, name: str, *options: str) -> dict | None:
        """The kept row `name` when it was scored under the same inputs, else None."""
        entry = self.entries.get(name)
        return entry["row"] if entry is not None and entry["inputs"] == self.inputs(*options) else None

    def has(self, *names: str, options: tuple[str, ...] = ()) -> bool:
        """Whether every one of `names` is kept under the same inputs."""
        return all(self.get(name, *options) is not None for name in names)

    def drop(self, name: str) -> None:
        """Forget the kept row `name` (its file is gone): it is scored again."""
        self.entries.pop(name, None)

    def put(self, row: dict, *options: str) -> dict:
        """Keep `row` (a `results.row`) with its inputs; the file is rewritten atomically. Returns `row`."""
        self.entries[row["name"]] = {"row": row, "inputs": self.inputs(*options)}
        write_rows(self.path, self.entries)
        return row

    def row(self, name: str, score: Callable[[], dict], *options: str) -> dict:
        """The kept row `name` when its inputs are unchanged, else `score()`, kept."""
        kept = self.get(name, *options)
        if kept is not None:
            self.reused.append(name)
            return kept
        scored = score()
        if scored["name"] != name:
            raise AssertionError(f"row {name!r} was scored as {scored['name']!r}")
        return self.put(scored, *options)


def read_rows(path: Path) -> dict[str, dict] | None:
    """{row name: {"row", "inputs"}} of a rows.json; {} when there is none, None (with a warning) when it
    cannot be read: its rows are scored again, not trusted."""
    if not path.exists():
        return {}
    try:
        record = read_record(path, "rows", "its rows are scored again", needs={"rows": list}, check=_damage)
    except OSError as exc:
        log.warning("%s: not readable (%s); its rows are scored again", path, exc.strerror or exc)
        return None
    except ValueError as exc:
        log.warning("%s", exc)
        return None
    return {entry["row"]["name"]: entry for entry in record["rows"]}


def _damage(record: dict) -> str | None:
    """What makes a rows.json record unusable: another format or version, or an entry `KeptRows` cannot read."""
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        return f"format {record.get('format')!r} version {record.get('version')!r}"
    for i, entry in enumerate(record["rows"]):
        row = entry.get("row") if isinstance(entry, dict) else None
        if not (isinstance(row, dict) and isinstance(row.get("name"), str) and isinstance(entry.get("inputs"), dict)):
            return f"entry {i} is not a row with its name and inputs"
    return None


def write_rows(path: Path, entries: dict[str, dict]) -> None:
    """rows.json, written atomically."""
    record = {"format": FORMAT, "version": VERSION, "rows": list(entries.values())}
    write_bytes_atomic(path, (json.dumps(record, indent=1) + "\n").encode())


def forget_recovered(folder: Path) -> None:
    """Drop PATCH's kept recovery row from `folder`'s rows.json: `patchc recover` has just replaced the plan it
    scored (plan-recovered.patch), so `prune --resume` must recover and score again rather than reuse it."""
    path = Path(folder) / ROWS
    entries = read_rows(path)
    if entries is None:
        path.unlink(missing_ok=True)  # unreadable: nothing in it would be reused anyway
    elif entries:
        write_rows(path, {name: e for name, e in entries.items()
                          if not (name.startswith("PATCH ") and name.endswith(RECOVERY))})


__all__ = ["KeptRows", "RECOVERED", "RECOVERY", "SCORING", "TRAINED", "forget_recovered", "read_rows", "write_rows"]
