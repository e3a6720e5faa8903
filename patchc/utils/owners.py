"""Which process owns a temporary folder, and whether it is gone: so that what a killed process left
behind (a half-written export of tens of GB) can be removed without touching a live one's.

A folder's owner is written into its name as "<pid>-<pid namespace>@<host>" (`owner_tag`). A folder of this
host and PID namespace whose pid is gone is orphaned. Nothing else is ever judged so: a pid cannot be checked
from another host (a shared file system) nor from another container that shares the host's name (its own
PID namespace), and a folder named before owners were recorded has no pid at all; such folders are only
named (`foreign`), for the user to remove once nothing writes them.

Example:
    >>> orphaned(owner_tag()), foreign("1-4026531836@elsewhere")      # this process's: never orphaned
    (False, True)
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


def host_name() -> str:
    """This host's name, as a file name may hold it."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())


def pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid; 0 where there is none)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag() -> str:
    """"<pid>-<pid namespace>@<host>" of this process, for a temporary folder's name."""
    return f"{os.getpid()}-{pid_namespace()}@{host_name()}"


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (anyone's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def orphaned(tag: str | None) -> bool:
    """Whether the process that `tag` ("<pid>-<pid namespace>@<host>", None when unknown) names is gone: only
    ever for one of this host and namespace; any other owner may still be writing (`foreign`)."""
    return not foreign(tag) and not process_alive(int((tag or "").partition("-")[0]))


def foreign(tag: str | None) -> bool:
    """Whether `tag`'s process cannot be checked from here (another host or container, or no tag)."""
    ids, _, host = (tag or "").partition("@")
    pid, _, ns = ids.partition("-")
    return not (pid.isdigit() and ns.isdigit() and int(ns) == pid_namespace() and host == host_name())


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
