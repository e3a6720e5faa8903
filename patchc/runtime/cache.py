"""On-disk JSON cache of tuning results.

One file, ``$PATCHC_CACHE_DIR/tune.json`` (default ``~/.cache/patchc/tune.json``)::

    {"format": "patchc-tune-cache", "version": 1, "entries": {KEY: RECORD, ...}}

KEY (see `cache_key`) joins the device name, torch and triton versions, the kernels' 2:4 load
(`configs.GROUPS_PER_LOAD`), the layer shape, the plan hash (tile kinds + tile + block), dtype, regime
and M, so a result is reused only on the same setup. A file
that cannot be read or is not valid JSON is ignored with a warning and rewritten (atomically: temp
file + os.replace) on the next write; a file of another cache version is ignored and left as it is
(results stay in memory: another patchc's cache is not wiped). Write errors only warn. The cache never
raises. `drop` removes an entry from the file too, so a stale record does not come back.

Example:
    >>> cache = TuneCache("/tmp/patchc-doc/tune.json")
    >>> cache.put("k", {"ms": 1.0}); cache.get("k")
    {'ms': 1.0}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from patchc.codegen.configs import groups_in_use
from patchc.utils.env import versions
from patchc.utils.files import cache_root, write_bytes_atomic

FORMAT = "patchc-tune-cache"
VERSION = 1


def default_cache_path() -> Path:
    """``$PATCHC_CACHE_DIR/tune.json``, else ``~/.cache/patchc/tune.json``.

    Example:
        >>> default_cache_path().name
        'tune.json'
    """
    return cache_root() / "tune.json"


def plan_hash(kinds: torch.Tensor, tile: tuple[int, int], block: tuple[int, int] | str) -> str:
    """Short hash of what fixes the packed layout: tile kinds, tile and block ("*" = not chosen yet).

    Example:
        >>> plan_hash(torch.ones(2, 2, dtype=torch.uint8), (16, 16), (16, 16))[:4]  # doctest: +SKIP
    """
    h = hashlib.sha256()
    h.update(kinds.to(torch.uint8).cpu().contiguous().numpy().tobytes())
    h.update(json.dumps([list(kinds.shape), list(tile), block if isinstance(block, str) else list(block)]).encode())
    return h.hexdigest()[:20]


def cache_key(
    device_name: str,
    shape: tuple[int, int],
    phash: str,
    dtype: torch.dtype,
    regime: str,
    m: int,
    extra: str = "",
) -> str:
    """The cache key of one (layer, regime) tuning result.

    Example:
        >>> cache_key("NVIDIA H100", (4096, 4096), "abc", torch.float16, "decode", 16).split("|")[-3:]
        ['decode', 'M=16', '']
    """
    v = versions()
    groups = groups_in_use(v["triton"])  # the kernels' 2:4 load: timed separately
    return "|".join([device_name, f"torch={v['torch']}", f"triton={v['triton']}", f"groups={groups}",
                     f"{shape[0]}x{shape[1]}", f"plan={phash}", str(dtype).replace("torch.", ""), regime, f"M={m}", extra])


class TuneCache:
    """A JSON file of {key: record}; loaded lazily, every `put` rewrites the file atomically.

    Example:
        >>> cache = TuneCache()            # default path
        >>> cache.get("missing") is None
        True
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()
        self._entries: dict[str, Any] | None = None
        self._foreign: str | None = None  # why the file on disk is not ours to rewrite (another version)

    def _load(self) -> dict[str, Any]:
        if self._entries is None:
            self._entries = self._read(warn=True)
        return self._entries

    def _read(self, warn: bool) -> dict[str, Any]:
        """Entries on disk; {} (with a warning) when missing-but-present, corrupt or of another version."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            if data.get("version") != VERSION:
                self._foreign = f"cache version {data.get('version')!r}, this patchc writes {VERSION}"
                raise ValueError(self._foreign + "; leaving the file as it is")
            entries = data.get("entries")
            if not isinstance(entries, dict):
                raise ValueError("'entries' is not an object")
            return entries
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
            if warn:
                then = "results stay in memory" if self._foreign else "it will be rewritten"
                warnings.warn(f"patchc tuning cache {self.path}: ignoring it ({type(e).__name__}: {e}); {then}",
                              RuntimeWarning, stacklevel=3)
            return {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The record under `key`, or None."""
        rec = self._load().get(key)
        return rec if isinstance(rec, dict) else None

    def put(self, key: str, record: dict[str, Any]) -> None:
        """Store `record` and rewrite the file, merging entries other processes wrote meanwhile (under a
        file lock, so two tuning processes never drop each other's entries)."""
        entries = self._load()
        entries[key] = record
        with self._locked():
            merged = {**self._read(warn=False), **entries}
            self._entries = merged
            self._write(merged)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on `<path>.lock` for a read-merge-write; unlocked where locking is unavailable
        (no fcntl, a read-only folder): the write is atomic either way, at worst an entry is tuned twice."""
        try:
            import fcntl

            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path.with_name(self.path.name + ".lock"), "a")
        except (ImportError, OSError):
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def drop(self, key: str) -> None:
        """Forget one entry (a stale record), in memory and in the file, so a later merge cannot bring it back."""
        self._load().pop(key, None)
        with self._locked():
            on_disk = self._read(warn=False)
            if key in on_disk:
                del on_disk[key]
                self._write(on_disk)

    def __len__(self) -> int:
        return len(self._load())

    def _write(self, entries: dict[str, Any]) -> None:
        if self._foreign:
            return  # another version's file: never overwritten (the warning came with the read)
        text = json.dumps({"format": FORMAT, "version": VERSION, "entries": entries}, indent=1, sort_keys=True)
        try:
            write_bytes_atomic(self.path, text.encode())
        except OSError as e:  # a read-only home must not stop a model from running
            warnings.warn(f"patchc tuning cache {self.path}: cannot write ({e}); results kept in memory only",
                          RuntimeWarning, stacklevel=3)


def resolve_cache(cache: TuneCache | str | os.PathLike | bool | None) -> TuneCache | None:
    """What `tune_plan(cache=...)` means: False -> no cache, None -> the default file, a path -> that file."""
    if cache is False:
        return None
    if cache is None:
        return TuneCache()
    return cache if isinstance(cache, TuneCache) else TuneCache(cache)


def drop_stale(cache: TuneCache | None, key: str, name: str, err: Exception) -> None:
    """Warn that layer `name`'s cached record under `key` no longer fits (`err`), and forget it."""
    warnings.warn(f"patchc tuning cache: stale entry for layer {name!r} ({type(err).__name__}: {err}); retuning",
                  RuntimeWarning, stacklevel=3)
    if cache is not None:
        cache.drop(key)
