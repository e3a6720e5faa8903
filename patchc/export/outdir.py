"""Where an export or import is written: `--out` checked before any work (`prepare_out`), the folder built
in a hidden sibling and renamed into place (`atomic_dir`), and what a killed run left beside it cleaned up
(`sweep_leftovers`). The hidden folders, each named with its owner (`patchc.utils.owners.owner_tag`):

    .<out>.<owner>.<random>.tmp     the folder being written; renamed onto <out> once complete
    .<out>.<owner>.<random>.old     an existing <out>, moved aside as .old/x just before that rename, deleted
                                    just after
    .patchc-import.<owner>.<random>    `patchc import`'s decoded checkpoint (`importing.decoded`)

<owner> is "<pid>-<pid namespace>@<host>".

A process killed in between (SIGKILL, out of memory, power loss) leaves them, as large as the model: the next
export or import to the same --out removes those whose owner is gone (`owners.orphaned`: a process of this
host and PID namespace that no longer runs), first putting a moved-aside <out> back where <out> is missing,
and says so in one warning line. Those it cannot judge (another host's or container's, or named before
owners were recorded) it only names there: one of them may still be writing.

Example:
    >>> with atomic_dir(Path("out/pruned"), overwrite=False) as tmp:
    ...     (tmp / "config.json").write_text("{}")          # out/pruned appears whole, or not at all
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from patchc.export.format import ExportError
from patchc.utils.files import check_writable, publish_modes, size_text
from patchc.utils.owners import foreign, orphaned, owner_tag, tree_bytes

_TAG = r"(?:(?P<tag>\d+(?:-\d+)?@[A-Za-z0-9._-]+)\.)?"  # absent in names written before owners were recorded
_RANDOM = r"[a-z0-9_]{8}"  # tempfile.mkdtemp's
DECODED = ".patchc-import."


def prepare_out(out: Path, overwrite: bool, decoded: bool = False) -> None:
    """Before any work: clean up after killed runs (`sweep_leftovers`), then refuse an `out` in the way or in
    a folder this process cannot write in."""
    sweep_leftovers(out, decoded)
    check_out(out, overwrite)
    check_writable(out.parent, f"--out {out}")  # the hidden sibling is built there
    if out.is_dir() and not out.is_symlink():  # a folder moved into .old/ and emptied must be writable itself
        check_writable(out, f"--out {out}")


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an `out` that is a file, or a non-empty folder unless `overwrite`: ExportError naming it."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out}: folder exists and is not empty; pass overwrite=True (CLI: --overwrite) or "
                          "choose another folder")


@contextlib.contextmanager
def atomic_dir(out: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling folder, renamed onto `out` if the block succeeds, removed if not.

    Files inside are written plainly: nobody reads the temporary folder, and the rename makes the whole
    folder appear at once. An existing `out` is moved aside first and deleted only after the rename."""
    prepare_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.{owner_tag()}."
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        publish_modes(tmp)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=prefix, suffix=".old", dir=out.parent))
            os.replace(out, old / "x")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def leftovers(out: Path, decoded: bool = False) -> tuple[list[tuple[Path, str]], list[Path]]:
    """([(folder, "tmp" | "old" | "decoded")] of the hidden folders beside `out` that killed runs left, their
    owners gone, .old ones first; [folders whose owner cannot be checked from here]). `decoded`: `patchc
    import`'s decoded checkpoints too."""
    kinds = [(re.compile(re.escape(f".{out.name}.") + _TAG + _RANDOM + r"\.(?P<kind>tmp|old)"), "")]
    if decoded:
        kinds.append((re.compile(re.escape(DECODED) + _TAG + _RANDOM), "decoded"))
    try:
        names = sorted(os.listdir(out.parent))
    except OSError:  # no parent yet, or unreadable (refused later, naming it): nothing of ours there
        return [], []
    found, unknown = [], []
    for name in names:
        for pattern, kind in kinds:
            m = pattern.fullmatch(name)
            path = out.parent / name
            if not m or not path.is_dir() or path.is_symlink():
                continue
            if orphaned(m.group("tag")):
                found.append((path, kind or m.group("kind")))
            elif foreign(m.group("tag")):
                unknown.append(path)
    return sorted(found, key=lambda f: f[1] != "old"), unknown


def sweep_leftovers(out: Path, decoded: bool = False) -> None:
    """Remove what killed runs left beside `out` (`leftovers`), first moving a set-aside <out> back into place
    where <out> is missing (a kill between atomic_dir's two renames); one warning line says what was done, and
    names the hidden folders it cannot judge."""
    removed, kept, restored, size = [], [], None, 0
    gone, unknown = leftovers(out, decoded)
    for path, kind in gone:
        if kind == "old" and restored is None and (path / "x").is_dir() and not os.path.lexists(out):
            os.replace(path / "x", out)
            restored = path
        held = tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            kept.append(path.name)
        else:
            removed.append(path.name)
            size += held
    if not (removed or kept or unknown):
        return
    said = [f"removed {len(removed)} temporary folder(s) left by an export or import killed before it finished "
            f"({size_text(size)}: {', '.join(removed)})"] if removed else []
    if restored is not None:
        said.append(f"put back {out}, which it had moved aside into {restored.name}")
    if kept:
        said.append(f"could not remove {', '.join(kept)}; delete them by hand")
    if unknown:
        said.append(f"left {', '.join(p.name for p in unknown)} ({size_text(sum(map(tree_bytes, unknown)))}): "
                    "another host's or container's export or import, or an older patchc's; delete them by hand "
                    "once nothing writes them")
    warnings.warn(f"--out {out}: " + "; ".join(said), stacklevel=2)
