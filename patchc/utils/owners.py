"""Which process owns a temporary folder, and whether it is gone: so that what a killed process left
behind (a half-written export of tens of GB) can be removed without touching a live one's.

A folder's owner is written into its name as "<pid>@<host>" (`owner_tag`). On this host a folder whose
pid is gone is orphaned; the pid cannot be checked on another host (a shared file system), nor for a
folder named before owners were recorded: those count as orphaned once nothing in them has changed for
`STALE_S` (a live writer keeps touching the file it writes).

Example:
    >>> tmp = Path(tempfile.mkdtemp(prefix=f".out.{owner_tag()}.", suffix=".tmp", dir="."))
    >>> orphaned(tmp, owner_tag())      # this process's: never
    False
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

STALE_S = 3600.0


def host_name() -> str:
    """This host's name, as a file name may hold it."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())


def owner_tag() -> str:
    """"<pid>@<host>" of this process, for a temporary folder's name."""
    return f"{os.getpid()}@{host_name()}"


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (anyone's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def orphaned(path: Path, tag: str | None, now: float | None = None) -> bool:
    """Whether the folder `path`, owned by `tag` ("<pid>@<host>", None when unknown), was left by a process
    that is gone: on this host, its pid no longer runs; else nothing in it changed for `STALE_S`."""
    pid, _, host = (tag or "").partition("@")
    if pid.isdigit() and host == host_name():
        return not process_alive(int(pid))
    return (now if now is not None else time.time()) - last_change(path) > STALE_S


def last_change(path: Path) -> float:
    """The latest modification time of `path` or anything in it (0 when it is gone)."""
    latest = 0.0
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            try:
                latest = max(latest, os.lstat(name).st_mtime)
            except OSError:  # removed meanwhile
                pass
    return latest


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path`."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def format_bytes(n: float) -> str:
    """`n` bytes as "12 B", "512.0 KiB", "3.2 GiB"."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"
