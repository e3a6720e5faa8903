"""Atomic file writes: readers see the old file or the new one, never half of one; and reading back the
torch.save files patchc wrote (checkpoints, caches) without torch's advice to unpickle them unsafely, and
the JSON records it wrote (run.json, rows.json, report.json) checked for the keys their readers use.

Example:
    >>> with atomic_path("runs/x/plan.patch") as tmp:
    ...     save_file(tensors, tmp)          # written beside the target, renamed onto it on success
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def size_text(n: float) -> str:
    """`n` bytes in decimal units, as patchc's messages give sizes: "812.0 kB", "3.2 MB", "14.5 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale / 10:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def cache_root() -> Path:
    """patchc's per-user cache folder: ``$PATCHC_CACHE_DIR``, else ``~/.cache/patchc`` (tuning, built libraries)."""
    return Path(os.environ.get("PATCHC_CACHE_DIR") or Path.home() / ".cache" / "patchc")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path in the target's folder; renamed onto `path` if the block succeeds, removed if not.

    The result gets the mode a plain `open(path, "w")` would give (the old file's, or 0666 less the umask),
    not mkstemp's private 0600: shared run folders and caches stay readable to the group."""
    path = Path(path)
    if path.is_dir():  # else os.replace fails naming its hidden temp file, not the path the caller gave
        raise IsADirectoryError(errno.EISDIR, "a folder is there; give a file's path", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mode_for(path: Path) -> int:
    """The existing file's permission bits, else 0666 masked by the process umask."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    umask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(umask)
    return umask


def publish_modes(folder: str | os.PathLike) -> None:
    """Give `folder` and everything in it the modes plain mkdir / open would (0777 / 0666 less the umask),
    not the private 0700 / 0600 of mkdtemp and of safetensors' writer: a folder built in a temporary
    place and renamed into view stays readable to whoever may read its parent's new files."""
    umask = _umask()
    root = Path(folder)
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def check_apart(out: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike]], todo: str,
                flag: str = "--out", error: type[ValueError] = ValueError) -> None:
    """Refuse an output that is one of `inputs` ((what it is, path)) or holds one, symlinks resolved: replacing
    it (--overwrite) would delete what the command reads. `error` in one line naming both paths, then `todo`.
    An output inside an input (`--out runs/a/hf` for run runs/a) is fine: replacing it deletes nothing read."""
    real = Path(os.path.realpath(out))
    for what, given in inputs:
        src = Path(os.path.realpath(given))
        how = "is" if real == src else "holds" if real in src.parents else ""
        if how:
            raise error(f"{flag} {out} {how} {what} {given}; {todo}")


def check_writable(folder: str | os.PathLike, given: str, todo: str = "") -> None:
    """PermissionError, before any work, unless this process may create files in `folder` or, where it does not
    exist yet, in its nearest existing parent (which mkdir would create it in). One line: "`given`: cannot write
    in <that folder> (Permission denied)" and `todo`; else an atomic write fails only after the work, naming its
    hidden temporary file."""
    folder = Path(folder)
    near = next((p for p in [folder, *folder.parents] if os.path.lexists(p)), None)
    if near is None or not near.is_dir() or os.access(near, os.W_OK | os.X_OK):
        return  # a file in the way is named by the checks that follow
    why = "Read-only file system" if os.statvfs(near).f_flag & os.ST_RDONLY else "Permission denied"
    raise PermissionError(f"{given}: cannot write in {near} ({why})" + (f"; {todo}" if todo else ""))


def read_state(path: str | os.PathLike) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU; a file that is not one is ValueError with one short
    reason. torch says "Weights only load failed", then several lines advising `weights_only=False`: advice a
    damaged or foreign file must not get, since that unpickles whatever it holds."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol: it is refused just below anyway
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except pickle.UnpicklingError as exc:
        detail = re.search(r"WeightsUnpickler error:\s*(\S.*)", str(exc))
        raise ValueError("not tensors and plain containers written by torch.save"
                         + (f" ({detail.group(1).strip()})" if detail else "")) from None
    except EOFError:
        raise ValueError("empty, or cut short") from None
    except Exception as exc:  # noqa: BLE001 - zip and storage errors of all kinds: named, in one line
        lines = str(exc).strip().splitlines()
        raise ValueError(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__) from None


class RecordError(ValueError):
    """A JSON record patchc wrote that is not one: the message names the file, why, and what to do."""


JSON_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "true / false", int: "an integer",
              float: "a number", type(None): "null"}


def json_kind(value: Any) -> str:
    """How JSON calls `value`'s type: "a list", "an object", ..."""
    return next((name for kind, name in JSON_KINDS.items() if type(value) is kind), type(value).__name__)


def read_record(path: str | os.PathLike, what: str, todo: str, needs: Mapping[str, type] | None = None,
                may: Mapping[str, type] | None = None, check: Callable[[dict], str | None] | None = None) -> dict:
    """The JSON object in `path`, holding each key of `needs` with a value of its type (and each key of `may`
    of its type where it is there and not null), that `check` finds nothing wrong with (it returns why, or
    None); else RecordError `PATH: not a patchc <what> record (<why>); <todo>`. An unreadable file raises its
    OSError. Its readers then index it freely: a damaged or hand-edited record is one line, not a traceback.

    Example:
        >>> read_record("runs/x/run.json", "run", "start again with --overwrite", needs={"settings": dict})
    """
    data = Path(path).read_bytes()
    try:
        record = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError too
        why = "empty" if not data.strip() else f"not JSON: {exc}"
    else:
        why = _mismatch(record, needs or {}, may or {}) or (check(record) if check else None)
    if why:
        raise RecordError(f"{path}: not a patchc {what} record ({why}); {todo}")
    return record


def _mismatch(record: Any, needs: Mapping[str, type], may: Mapping[str, type]) -> str | None:
    if not isinstance(record, dict):
        return f"{json_kind(record)}, not an object"
    missing = [key for key in needs if key not in record]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    for key, kind in (dict(may) | dict(needs)).items():
        value = record.get(key)
        if (key in needs or value is not None) and not (isinstance(value, kind) and (
                kind is bool or not isinstance(value, bool))):  # JSON's true is no integer
            return f"{key!r} is {json_kind(value)}, not {JSON_KINDS.get(kind, kind.__name__)}"
    return None
