"""Splitting an exported weights file into shards, as `save_pretrained(max_shard_size=...)` does.

A folder whose weights exceed `max_shard_size` holds ``model-00001-of-0000N.safetensors``, ... and
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes, ...}, "weight_map": {tensor: file}}``,
transformers' index), instead of one ``model.safetensors``. Shards are filled in the file's tensor order
and a planned layer's buffers always share a shard (each shard's header describes the layers it holds);
a unit larger than the limit gets a shard of its own, as transformers does with a large tensor.

Example:
    >>> parse_size("5GB"), parse_size("2GiB"), parse_size(1000)
    (5000000000, 2147483648, 1000)
    >>> split([3, 3, 3, 9], 6)
    [[0, 1], [2], [3]]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "50GB"  # transformers 5's save_pretrained default (the Hub takes files up to 50 GB)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes of a size given as an int or as "5GB" / "500MB" / "2GiB" (decimal and binary units, as
    transformers reads `max_shard_size`); ValueError saying what is accepted otherwise."""
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise ValueError(f"max_shard_size {size!r}: give bytes as an int or a string such as '5GB' or '2GiB'")
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE.fullmatch(size)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: not a size; write it as '5GB', '500MB' or '2GiB' "
                             f"(units {', '.join(u.upper() for u in _UNITS if u)})")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"max_shard_size {size!r}: must be positive")
    return n


def add_shard_argument(p: argparse.ArgumentParser) -> None:
    """--max-shard-size on a command line (`patchc export`, `patchc import`), checked as it is read: before any
    long stage."""

    def size(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p.add_argument("--max-shard-size", type=size, default=DEFAULT_MAX_SHARD, metavar="SIZE",
                   help="split the weights into shards of at most SIZE (e.g. 5GB, 2GiB; default %(default)s, "
                        "as transformers' save_pretrained) with model.safetensors.index.json")


def split(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive groups of the indices of `sizes`, each summing to at most `limit` (a single item larger
    than `limit` makes a group of its own); never an empty group, always at least one group."""
    groups: list[list[int]] = [[]]
    held = 0
    for i, n in enumerate(sizes):
        if groups[-1] and held + n > limit:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += n
    return groups


def shard_name(i: int, n: int) -> str:
    """transformers' shard file name: shard_name(0, 3) -> "model-00001-of-00003.safetensors"."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_index(folder: Path, weight_map: dict[str, str], total_size: int, metadata: dict) -> None:
    """Write ``model.safetensors.index.json`` (transformers' layout) with `metadata` beside total_size."""
    body = {"metadata": {"total_size": total_size, **metadata}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(body, indent=2) + "\n")


def read_index(path: Path, error: type[Exception]) -> dict[str, list[str]]:
    """{shard file: its tensor names, in the index's order} of a shard index; `error` naming the file when it
    is unreadable, malformed, or names a shard that is missing beside it."""
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{path}: not a readable shard index ({type(e).__name__}: {e})") from None
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise error(f"{path}: a shard index needs a 'weight_map' of tensor name -> file name")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if Path(file).name != file:
            raise error(f"{path}: shard {file!r} (of tensor {name!r}) is not a file name beside the index")
        files.setdefault(file, []).append(name)
    for file in files:
        if not (path.parent / file).is_file():
            raise error(f"{path}: shard {file} is missing (it holds {files[file][0]!r}, ...)")
    return files


__all__ = ["DEFAULT_MAX_SHARD", "INDEX", "add_shard_argument", "parse_size", "read_index", "shard_name", "split",
           "write_index"]
