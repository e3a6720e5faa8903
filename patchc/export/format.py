"""The exported checkpoint's weights file: plain tensors as-is, planned weights as the plan's buffers.

`model.safetensors` holds two kinds of tensors:

  * every tensor of the model's state dict that is not planned, under its own name (with the wrapper
    prefix removed, see `patchc.export.arch`) and in its own dtype, exactly as `save_pretrained` stores it;
  * for every planned weight `<fqn>` (e.g. ``model.layers.0.mlp.up_proj.weight``) its tile-plan buffers
    instead of the dense (N, K) tensor: ``<fqn>.patchc.kinds`` uint8 (Tn, Tk), ``<fqn>.patchc.dense``
    (n_dense, b1, b2), ``<fqn>.patchc.values`` (n_sparse, b1, b2/2), ``<fqn>.patchc.meta`` uint8
    (n_sparse, b1, ceil(b2/8)) and, if the plan has one, ``<fqn>.patchc.bias`` (N,). The layout of each
    buffer is the IR's (the `patchc.ir` docstring); the dense weight itself is absent. The bias is
    stored twice (``<module>.bias`` and ``.patchc.bias``, N values) so that the plan stays self-contained.

The file's metadata is ``{"format": "pt", "patchc": JSON}``, the JSON being::

    {"format": "patchc.pretrained", "version": 1,
     "layers": {fqn: {"shape": [N, K], "tile": [b1, b2], "dtype": "float16", "has_bias": false}, ...}}

Weights above the export's `max_shard_size` go to shards instead (`patchc.export.shards`): each shard is such
a file whose header describes the layers it holds (``"version": 2``, as in patchc_config.json, so that
readers of version 1 alone refuse the folder by its version), and a layer's buffers never straddle two.

A reader refuses another format or version, a header layer whose buffers are missing, and a
``.patchc.`` tensor the header does not describe, naming the file and the layer.

Example:
    >>> write_weights(folder, plain, {f: lp.slot() for f, lp in plan.layers.items()}, plan.layers.items())
    'model.safetensors'
    >>> plain, layers = read_weights(folder / "model.safetensors")      # {name: tensor}, {fqn: LayerPlan}
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from patchc.export import shards
from patchc.ir import LayerPlan, PlanError
from patchc.ir.file_format import read_layer, read_safetensors
from patchc.ir.layer_slot import LayerSlot
from patchc.utils.safetensors_stream import StreamError, write_streamed

FORMAT = "patchc.pretrained"
VERSION = 1
SHARDED_VERSION = 2  # a folder of shards (older readers, knowing only version 1, refuse it by its version)
SEP = ".patchc."  # "<weight fqn>.patchc.<part>": never a real parameter name
WEIGHTS = "model.safetensors"
CONFIG = "patchc_config.json"


class ExportError(ValueError):
    """An exported checkpoint that cannot be written or read; the message names the folder or file."""


def part_name(fqn: str, part: str) -> str:
    """The tensor name of one buffer of a planned weight: part_name("fc.weight", "kinds") -> "fc.weight.patchc.kinds"."""
    return f"{fqn}{SEP}{part}"


def write_weights(folder: Path, plain: dict[str, torch.Tensor], slots: Mapping[str, LayerSlot],
                  layers: Iterable[tuple[str, LayerPlan]], max_shard_bytes: int | None = None) -> str:
    """Write `plain` tensors, then the buffers of each layer as `layers` yields it ((stored fqn, LayerPlan), in
    `slots`' order, each matching its slot) into `folder`: one ``model.safetensors``, or shards of at most
    `max_shard_bytes` with their index (`patchc.export.shards`). Returns the name patchc_config.json's
    "weights" gives: the file, or the index.

    The files are laid out from the slots first and each layer is written as it comes, so a generator that
    packs layers one by one keeps one packed layer in memory, never the plan. Written in place: the caller's
    folder is a temporary one, renamed into place when complete."""
    units: list[dict] = [{name: (t.dtype, tuple(t.shape))} for name, t in plain.items()]
    owners: list[str | None] = [None] * len(units)  # the layer whose buffers each unit holds
    taken = set(plain)
    for fqn, slot in slots.items():
        unit = {part_name(fqn, part): spec for part, spec in slot.parts().items()}
        clash = sorted(taken & set(unit))
        if clash:
            raise ExportError(f"{folder}: tensor name {clash[0]!r} is both a model tensor and a plan buffer")
        taken |= set(unit)
        units.append(unit)
        owners.append(fqn)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield from plain.items()
        for fqn, layer in layers:
            parts = layer.tensors()
            del layer  # the written layer is freed before the next one is packed
            while parts:
                part = next(iter(parts))
                yield part_name(fqn, part), parts.pop(part)

    sizes = [t.nbytes for t in plain.values()] + [slot.nbytes() for slot in slots.values()]  # per unit
    groups = shards.split(sizes, max_shard_bytes) if max_shard_bytes else [list(range(len(units)))]
    stream = tensors()
    sharded = len(groups) > 1
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        name = shards.shard_name(i, len(groups)) if sharded else WEIGHTS
        layout = {k: v for u in group for k, v in units[u].items()}
        head = {"format": FORMAT, "version": SHARDED_VERSION if sharded else VERSION,
                "layers": {owners[u]: slots[owners[u]].header() for u in group if owners[u] is not None}}
        try:
            write_streamed(folder / name, layout, itertools.islice(stream, len(layout)),
                           {"format": "pt", "patchc": json.dumps(head)})
        except StreamError as e:
            raise ExportError(f"{e} (a planned layer does not match the layout laid out for it)") from None
        weight_map.update(dict.fromkeys(layout, name))
    extra = next(stream, None)
    if extra is not None:
        raise ExportError(f"{folder}: tensor {extra[0]!r} came after the last one laid out (more layers than slots)")
    if not sharded:
        return WEIGHTS
    shards.write_index(folder, weight_map, sum(sizes), {"format": FORMAT, "version": SHARDED_VERSION})
    return shards.INDEX


def read_weights(path: Path, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, LayerPlan]]:
    """(plain tensors by stored name, LayerPlans by `prefix` + stored fqn) of what `write_weights` wrote:
    `path` is ``model.safetensors`` or the shard index (each shard read in turn and checked against it)."""
    if not path.is_file():
        raise ExportError(f"{path}: weights file missing (an exported folder holds {WEIGHTS} or {shards.INDEX})")
    if path.name != shards.INDEX:
        return read_file(path, prefix)
    plain: dict[str, torch.Tensor] = {}
    layers: dict[str, LayerPlan] = {}
    # the index maps each name to one file, so shards that hold what it says never hold a name twice
    for file, names in shards.read_index(path, ExportError).items():
        part_plain, part_layers = read_file(path.parent / file, prefix, (path, set(names)))
        plain.update(part_plain)
        layers.update(part_layers)
    return plain, layers


def read_file(path: Path, prefix: str = "", index: tuple[Path, set[str]] | None = None) -> tuple[
        dict[str, torch.Tensor], dict[str, LayerPlan]]:
    """(plain tensors, LayerPlans) of one safetensors file written by `write_weights`: the whole weights, or a
    shard whose tensors must be the ones `index` (the index file, the names it gives this shard) says."""
    metadata, tensors = read_safetensors(path, ExportError, "safetensors file")
    if index is not None and set(tensors) != index[1]:
        odd = sorted(set(tensors) ^ index[1])[0]
        raise ExportError(f"{index[0]}: tensor {odd!r} is in one of the index / {path.name} but not the other")
    head = check_header(path, metadata.get("patchc"), "the file's 'patchc' metadata")
    layers = {prefix + fqn: _layer(path, fqn, prefix, info, tensors) for fqn, info in head["layers"].items()}
    stray = sorted(k for k in tensors if SEP in k)
    if stray:
        raise ExportError(f"{path}: tensor {stray[0]!r} is not described by the 'patchc' header (corrupt file?)")
    return tensors, layers


def check_header(path: Path, raw: str | dict | None, what: str) -> dict:
    """The parsed header (a JSON string or dict) after checking its format and version; `ExportError` if wrong."""
    if raw is None:
        raise ExportError(f"{path}: {what} is missing; not a checkpoint written by patchc.export")
    try:
        head = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        fmt = head.get("format") if isinstance(head, dict) else None
        raise ExportError(f"{path}: {what} has format {fmt!r}, expected {FORMAT!r}")
    if head.get("version") not in (VERSION, SHARDED_VERSION):
        raise ExportError(f"{path}: {what} has format version {head.get('version')!r}; this patchc reads "
                          f"versions {VERSION} and {SHARDED_VERSION} (export the model again with this patchc, "
                          "or upgrade patchc)")
    if not isinstance(head.get("layers"), dict):
        raise ExportError(f"{path}: {what} needs a 'layers' object")
    return head


def _layer(path: Path, fqn: str, prefix: str, info: dict, tensors: dict[str, torch.Tensor]) -> LayerPlan:
    """Pop one layer's buffers out of `tensors` and rebuild (and validate) its LayerPlan."""
    try:
        return read_layer(path, fqn, info, tensors, key=lambda part: part_name(fqn, part), name=prefix + fqn)
    except PlanError as e:
        raise ExportError(str(e)) from None
