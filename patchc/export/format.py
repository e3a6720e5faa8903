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

A reader refuses another format or version, a header layer whose buffers are missing, and a
``.patchc.`` tensor the header does not describe, naming the file and the layer.

Example:
    >>> write_weights(path, plain, {f: lp.slot() for f, lp in plan.layers.items()}, plan.layers.items())
    >>> plain, layers = read_weights(path)      # {name: tensor}, {fqn: LayerPlan}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from patchc.ir import LayerPlan, PlanError
from patchc.ir.file_format import read_layer, read_safetensors
from patchc.ir.layer_slot import LayerSlot
from patchc.utils.safetensors_stream import StreamError, write_streamed

FORMAT = "patchc.pretrained"
VERSION = 1
SEP = ".patchc."  # "<weight fqn>.patchc.<part>": never a real parameter name
WEIGHTS = "model.safetensors"
CONFIG = "patchc_config.json"


class ExportError(ValueError):
    """An exported checkpoint that cannot be written or read; the message names the folder or file."""


def part_name(fqn: str, part: str) -> str:
    """The tensor name of one buffer of a planned weight: part_name("fc.weight", "kinds") -> "fc.weight.patchc.kinds"."""
    return f"{fqn}{SEP}{part}"


def write_weights(path: Path, plain: dict[str, torch.Tensor], slots: Mapping[str, LayerSlot],
                  layers: Iterable[tuple[str, LayerPlan]]) -> int:
    """Write `plain` tensors, then the buffers of each layer as `layers` yields it ((stored fqn, LayerPlan), in
    `slots`' order, each matching its slot) to one safetensors file; returns its size in bytes.

    The file is laid out from the slots first and each layer is written as it comes, so a generator that packs
    layers one by one keeps one packed layer in memory, never the plan. Written in place: the caller's folder
    is a temporary one, renamed into place when complete."""
    layout = {name: (t.dtype, tuple(t.shape)) for name, t in plain.items()}
    for fqn, slot in slots.items():
        for part, spec in slot.parts().items():
            name = part_name(fqn, part)
            if name in layout:
                raise ExportError(f"{path}: tensor name {name!r} is both a model tensor and a plan buffer")
            layout[name] = spec

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield from plain.items()
        for fqn, layer in layers:
            parts = layer.tensors()
            del layer  # the written layer is freed before the next one is packed
            while parts:
                part = next(iter(parts))
                yield part_name(fqn, part), parts.pop(part)

    head = {"format": FORMAT, "version": VERSION, "layers": {fqn: slot.header() for fqn, slot in slots.items()}}
    try:
        return write_streamed(path, layout, tensors(), {"format": "pt", "patchc": json.dumps(head)})
    except StreamError as e:
        raise ExportError(f"{e} (a planned layer does not match the layout laid out for it)") from None


def read_weights(path: Path, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, LayerPlan]]:
    """(plain tensors by stored name, LayerPlans by `prefix` + stored fqn) of a file written by `write_weights`."""
    if not path.is_file():
        raise ExportError(f"{path}: weights file missing (an exported folder holds {WEIGHTS})")
    metadata, tensors = read_safetensors(path, ExportError, "safetensors file")
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
    if head.get("version") != VERSION:
        raise ExportError(f"{path}: {what} has format version {head.get('version')!r}; this patchc reads "
                          f"version {VERSION} (export the model again with this patchc, or upgrade patchc)")
    if not isinstance(head.get("layers"), dict):
        raise ExportError(f"{path}: {what} needs a 'layers' object")
    return head


def _layer(path: Path, fqn: str, prefix: str, info: dict, tensors: dict[str, torch.Tensor]) -> LayerPlan:
    """Pop one layer's buffers out of `tensors` and rebuild (and validate) its LayerPlan."""
    try:
        return read_layer(path, fqn, info, tensors, key=lambda part: part_name(fqn, part), name=prefix + fqn)
    except PlanError as e:
        raise ExportError(str(e)) from None
