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
from patchc.utils.files import write_bytes_atomic

log = logging.getLogger(__name__)

FORMAT, VERSION = "patchc.rows", 1
# Options outside run.json that change a row: how every row is scored, what a trained row trained for, and
# how a recovered one was recovered.
SCORING = ("eval_context", "eval_data", "eval_tokens")
TRAINED = ("steps",)
RECOVERED = (*TRAINED, "recover", "recover_loss", "recover_lr", "recover_scope", "recover_splice")


class KeptRows:
    """The rows of the run in `folder` that earlier processes scored, and the file this process adds to.

    Example:
        >>> kept = KeptRows(out, opts)
        >>> kept.row("PATCH joint", score_patch, *TRAINED)
        >>> kept.reused                                   # the names read back instead of scored
    """

    def __init__(self, folder: Path, opts: PruneOptions) -> None:
        import torch

        from patchc import __version__
        from patchc.job.model import weight_dtype

        self.path = Path(folder) / ROWS
        self.opts = opts
        scoring = {name: getattr(opts, name) for name in SCORING}
        scoring["eval_data"] = [str(Path(p).resolve()) for p in opts.eval_data]
        self.base = settings_of(opts) | scoring | {
            "device": opts.device.partition(":")[0], "dtype": str(weight_dtype(opts)),
            "versions": {"patchc": __version__, "torch": torch.__version__},  # another build may score otherwise
        }
        self.entries = self._read()
        self.reused: list[str] = []

    def _read(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        try:
            record = json.loads(self.path.read_text())
            if record.get("format") != FORMAT or record.get("version") != VERSION:
                raise ValueError(f"format {record.get('format')!r} version {record.get('version')!r}")
            return {entry["row"]["name"]: entry for entry in record["rows"]}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # scored again, not trusted
            log.warning("%s: not a readable rows file (%s); its rows are scored again", self.path, exc)
            return {}

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
        record = {"format": FORMAT, "version": VERSION, "rows": list(self.entries.values())}
        write_bytes_atomic(self.path, (json.dumps(record, indent=1) + "\n").encode())
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


def forget_recovered(folder: Path) -> None:
    """Drop PATCH's kept recovery row from `folder`'s rows.json: `patchc recover` has just replaced the plan it
    scored (plan-recovered.patch), so `prune --resume` must recover and score again rather than reuse it."""
    path = Path(folder) / ROWS
    if not path.exists():
        return
    try:
        record = json.loads(path.read_text())
        rows = [e for e in record["rows"] if not (e["row"]["name"].startswith("PATCH ")
                                                  and e["row"]["name"].endswith(" + recovery"))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        path.unlink(missing_ok=True)  # unreadable: nothing in it would be reused anyway
        return
    write_bytes_atomic(path, (json.dumps(record | {"rows": rows}, indent=1) + "\n").encode())


__all__ = ["KeptRows", "RECOVERED", "SCORING", "TRAINED", "forget_recovered"]
