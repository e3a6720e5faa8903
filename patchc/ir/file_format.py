"""The plan file: one safetensors file with a small versioned JSON header. Loading never unpickles.

Tensors are named "<fqn>::kinds|dense|values|meta|bias"; the file's metadata holds {"patchc": JSON}
with the header::

    {"format": "patchc.tileplan", "version": 2,
     "layers": {fqn: {"shape": [N, K], "tile": [b1, b2], "dtype": "float16", "has_bias": false}, ...},
     "skipped": {fqn: reason, ...}, "meta": {...},
     "checksums": {"<fqn>::<part>": sha256 of the tensor's bytes, ...},
     "header_sha256": sha256 of this JSON without "header_sha256" (sorted keys, compact)}

A reader refuses another format or version, a header that does not describe every tensor, a tensor or
header whose checksum does not match (a flipped bit, tiles swapped by hand), and any layer whose buffers
fail `LayerPlan`'s validation, naming the file (and the layer). Version 1 files (no checksums) still
load. Bump `VERSION` when the layout changes, and keep reading the old one.

Example:
    >>> write_plan(plan, "model.patch")
    >>> layers, skipped, meta = read_plan("model.patch")
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from patchc.ir.errors import PlanError
from patchc.ir.layer_plan import LayerPlan
from patchc.ir.verify import PARTS
from patchc.utils.files import atomic_path

if TYPE_CHECKING:
    from patchc.ir.tile_plan import TilePlan

FORMAT = "patchc.tileplan"
VERSION = 2
READS = (1, 2)  # version 1: the same layout without checksums
FLOAT_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """"float16" for torch.float16: the spelling of the header."""
    return str(dtype).removeprefix("torch.")


def layer_header(layers: dict[str, LayerPlan]) -> dict:
    """{fqn: {shape, tile, dtype, has_bias}}: what `read_layer` needs to rebuild each LayerPlan."""
    return {fqn: layer.slot().header() for fqn, layer in layers.items()}


def header(plan: TilePlan) -> dict:
    """The JSON header stored in the file's metadata under "patchc"."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "layers": layer_header(plan.layers),
        "skipped": plan.skipped,
        "meta": plan.meta,
    }


def checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (any dtype: hashed as raw bytes)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.data).hexdigest()


def header_digest(head: dict) -> str:
    """sha256 of the header without its own digest: a flipped byte in the JSON (meta included) is caught."""
    body = {k: v for k, v in head.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_plan(plan: TilePlan, path: str | os.PathLike) -> None:
    """Write `plan` (already verified) atomically: temp file in the same folder, then os.replace."""
    from safetensors.torch import save_file

    tensors = {
        f"{fqn}::{part}": t.detach().cpu().contiguous()
        for fqn, layer in plan.layers.items()
        for part, t in layer.tensors().items()
    }
    head = header(plan) | {"checksums": {key: checksum(t) for key, t in tensors.items()}}
    head["header_sha256"] = header_digest(head)
    with atomic_path(Path(path)) as tmp:
        save_file(tensors, str(tmp), metadata={"patchc": json.dumps(head)})


def read_safetensors(path: Path, error: type[Exception] = PlanError,
                     what: str = "safetensors plan file") -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file; a file that cannot be opened is the OS's OSError (missing,
    permission denied), anything else unreadable is `error` naming the file (plan files and exported
    checkpoints alike)."""
    from safetensors import safe_open

    with open(path, "rb"):  # safetensors calls every failure to open "No such file" (a PermissionError too)
        pass
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError / OSError types
        raise error(f"{path}: not a readable {what} ({type(e).__name__}: {e})") from None


def read_plan(path: str | os.PathLike) -> tuple[dict[str, LayerPlan], dict, dict]:
    """(layers, skipped, meta) of a plan file, every layer validated; `PlanError` naming the file."""
    path = Path(path)
    if path.is_dir():
        inside = f"; its plan is {path / 'plan.patch'}" if (path / "plan.patch").is_file() else ""
        raise IsADirectoryError(f"{path}: is a folder, not a plan file{inside}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such plan file")
    metadata, tensors = read_safetensors(path)
    head = _parse_header(path, metadata)
    _check_sums(path, head, tensors)
    layers = {fqn: read_layer(path, fqn, info, tensors) for fqn, info in head["layers"].items()}
    if tensors:  # read_layer popped every described buffer
        raise PlanError(f"{path}: tensor {sorted(tensors)[0]!r} is not described by the header (corrupt or foreign file)")
    return layers, head["skipped"], head["meta"]


def read_layer(path: Path, fqn: str, info: dict, tensors: dict[str, torch.Tensor],
               key: Callable[[str], str] | None = None, name: str | None = None) -> LayerPlan:
    """Rebuild (and validate) one layer from its header entry, popping its buffers, stored as `key`, out of
    `tensors` (default "<fqn>::<part>"); `PlanError` naming the file and layer. The exported checkpoint
    reuses it with its own tensor names."""
    where = f"{path}: layer {fqn}"
    key = key or (lambda part: f"{fqn}::{part}")
    try:
        shape, tile = tuple(info["shape"]), tuple(info["tile"])
        dtype, has_bias = info["dtype"], bool(info["has_bias"])
    except (KeyError, TypeError):
        raise PlanError(f"{where}: header entry needs shape, tile, dtype and has_bias, got {info!r}") from None
    if dtype not in FLOAT_DTYPES:
        raise PlanError(f"{where}: unsupported dtype {dtype!r} in header (one of {sorted(FLOAT_DTYPES)})")
    parts = {}
    for part in PARTS + (("bias",) if has_bias else ()):
        stored = key(part)
        if stored not in tensors:
            raise PlanError(f"{where}: tensor {stored!r} is missing from the file")
        parts[part] = tensors.pop(stored)
    try:
        return LayerPlan(name=name or fqn, shape=shape, tile=tile, dtype=FLOAT_DTYPES[dtype],
                         bias=parts.pop("bias", None), **parts)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None


def _parse_header(path: Path, metadata: dict[str, str]) -> dict:
    if "patchc" not in metadata:
        raise PlanError(f"{path}: safetensors file without a 'patchc' header; not a patchc plan")
    try:
        head = json.loads(metadata["patchc"])
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: the 'patchc' header is not valid JSON ({e})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        fmt = head.get("format") if isinstance(head, dict) else None
        raise PlanError(f"{path}: header format is {fmt!r}, expected {FORMAT!r}")
    if head.get("version") not in READS:
        raise PlanError(
            f"{path}: plan format version {head.get('version')!r} is not supported "
            f"(this patchc reads versions {', '.join(map(str, READS))})"
        )
    for key, typ in (("layers", dict), ("skipped", dict), ("meta", dict)):
        if not isinstance(head.get(key), typ):
            raise PlanError(f"{path}: header field {key!r} must be a JSON object")
    return head


def _check_sums(path: Path, head: dict, tensors: dict[str, torch.Tensor]) -> None:
    if head["version"] < 2:
        return  # written before checksums existed
    if head.get("header_sha256") != header_digest(head):
        raise PlanError(f"{path}: the header does not match its checksum (the file was corrupted or edited)")
    sums = head.get("checksums")
    if not isinstance(sums, dict) or set(sums) != set(tensors):
        raise PlanError(f"{path}: the header's checksums do not list exactly the file's tensors (corrupt file)")
    for key, t in tensors.items():
        if sums[key] != checksum(t):
            layer, _, part = key.partition("::")
            raise PlanError(f"{path}: layer {layer}: the {part} buffer does not match its checksum "
                            "(the file was corrupted or edited)")
