"""Reading compressed-tensors' legacy ``sparse-24-bitmask`` (and ``sparse-bitmask``) checkpoints.

compressed-tensors (neuralmagic / vLLM) stored a 2:4-sparse weight ``<module>.weight`` of shape (N, K)
as three tensors, named after the module (the ``.weight`` suffix dropped):

    <module>.compressed   (N, K/2)              the kept values of each row, in increasing column order
    <module>.bitmask      uint8 (N, ceil(K/8))  the (N, K) keep mask, each row packed with
                                                numpy.packbits(bitorder="little"): column c is bit c % 8
                                                (value 1 << (c % 8)) of byte c // 8
    <module>.shape        int (2, 1)            [N, K]

Its compressor kept the 2 largest magnitudes of every group of 4 consecutive columns, so each group
has exactly 2 bits set (a kept value may be 0). The unstructured ``sparse-bitmask`` layout, which 2:4
checkpoints were saved in too, holds only the nonzeros, 1-D, with the same bitmask, a 1-D shape, and
``<module>.row_offsets`` (each row's first index into the values); any count may be kept per group. The checkpoint's config.json names the layout in
``quantization_config.sparsity_config.format`` (older ones: ``compression_config``). The library
dropped its sparse compressors in 2026; this reader keeps such checkpoints usable.

Quantized releases ("2of4-FP8-dynamic", W8A8) store FP8 / int8 values with ``<module>.weight_scale``
(per tensor, per output channel, per group or per block; symmetric). They are dequantized to the scale's
dtype: patchc plans hold float weights, and activations are not quantized. The int4 / int8 ``marlin-24``
layout (Sparse-Marlin's, ``weight_packed`` + ``meta`` + ``scale_packed``) is read by `marlin24.py`; other
packed int4 (``weight_packed`` without ``meta``: dense int4) is refused.

    plan_from_compressed_tensors   the planned layers alone (an all-2:4 TilePlan)
    decoded_tensors                every tensor of the checkpoint as a dense model holds it, one at a time

Example:
    >>> plan = plan_from_compressed_tensors("llama-2-7b-2of4/", tile=(128, 128))
    >>> plan.layers["model.layers.0.mlp.up_proj.weight"].n_dense
    0
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from patchc.export import marlin24
from patchc.ir import TILE_SPARSE24, LayerPlan, PlanError, TilePlan
from patchc.ir.tiles import tile_grid, tile_pair
from patchc.utils.progress import progress

LAYOUT = "sparse-24-bitmask"
# the unstructured layout, which 2:4 checkpoints were saved in too
UNSTRUCTURED = "sparse-bitmask"
MARLIN = "marlin-24"  # int4 / int8 values in Sparse-Marlin's layout
LAYOUTS = (LAYOUT, UNSTRUCTURED, MARLIN)
SUFFIXES = {LAYOUT: (".compressed", ".bitmask", ".shape"),
            UNSTRUCTURED: (".compressed", ".bitmask", ".shape", ".row_offsets"), MARLIN: marlin24.SUFFIXES}
# the tensor naming a layer of each layout: the one that is there whatever else is missing
MARKER = {LAYOUT: "bitmask", UNSTRUCTURED: "bitmask", MARLIN: "meta"}
# the tensor a layer's decoded weight is written beside (the shard holding its values)
VALUES = {LAYOUT: "compressed", UNSTRUCTURED: "compressed", MARLIN: "weight_packed"}
QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
# activation quantization parameters: the plan serves the model's float activations, so they go unused
ACTIVATION_PARAMS = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point", ".k_scale",
                     ".v_scale", ".input_global_scale")


def plan_from_compressed_tensors(path_or_dir: str | os.PathLike, tile: tuple[int, int] | int = (128, 128), *,
                                 show_progress: bool = False) -> TilePlan:
    """An all-2:4 TilePlan from a compressed-tensors ``sparse-24-bitmask`` file or checkpoint folder.

    Planned weights are named ``<module>.weight``; a ``<module>.bias`` in the files is carried.
    Raises `PlanError` naming the file and layer for another layout, a missing part, a bad shape, or a
    group that does not keep exactly 2 of 4.

    Example:
        >>> plan = plan_from_compressed_tensors("ckpt/model.safetensors", tile=(64, 64))
        >>> plan.apply(model)       # the decompressed 2:4 weights, written into a dense model
    """
    tile = tile_pair(tile, "plan_from_compressed_tensors")
    where = _index(Path(path_or_dir), LAYOUT)
    layers = {}
    for module in progress(_modules(where, path_or_dir, LAYOUT), desc="sparse-24-bitmask layers", disable=not show_progress):
        weight, mask = read_layer(where, module)
        bias = _tensor(where[module + ".bias"], module + ".bias") if module + ".bias" in where else None
        name = f"{module}.weight"
        kinds = torch.full(tile_grid(tuple(weight.shape), tile), TILE_SPARSE24, dtype=torch.uint8)
        layers[name] = LayerPlan.from_mask(name, weight, kinds, mask, bias=bias, tile=tile)
    meta = {"source": f"compressed-tensors {LAYOUT}", "path": str(path_or_dir), "tile": list(tile)}
    return TilePlan(layers=layers, meta=meta)


def decoded_tensors(path_or_dir: str | os.PathLike,
                    layout: str = LAYOUT) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a `layout` checkpoint (one of `LAYOUTS`) as the dense model holds it,
    one at a time (a consumer that writes each away holds one decoded tensor, never a shard): each layer's
    compressed tensors become ``<module>.weight`` (W * M, quantized values dequantized), its quantization
    parameters are consumed and activation ones dropped.

    Example:
        >>> for name, tensor in decoded_tensors("Sparse-Llama-3.1-8B-2of4-FP8-dynamic/"):
        ...     print(name, tuple(tensor.shape))
    """
    if layout not in LAYOUTS:
        raise PlanError(f"{path_or_dir}: layout {layout!r}; one of {LAYOUTS} is read")
    where = _index(Path(path_or_dir), layout)
    modules = set(_modules(where, path_or_dir, layout))
    for f in sorted(set(where.values())):
        for key in (k for k, v in where.items() if v == f):
            module, _, part = key.rpartition(".")
            if module in modules:
                if part == VALUES[layout]:  # the layer goes with the shard holding its values
                    yield f"{module}.weight", read_layer(where, module, layout)[0]
            elif key.endswith(ACTIVATION_PARAMS) or part in ("weight_scale", "weight_zero_point"):
                continue  # read with their weight
            elif part == "weight":
                yield key, _dense_weight(where, module)
            elif part in ("weight_packed", "weight_shape", "weight_global_scale"):
                raise PlanError(f"{f}: layer {module}.weight is packed int4 / fp4 ({part}); only float, FP8 and int8 "
                                "values can be dequantized")
            else:
                yield key, _tensor(f, key)


def read_layer(where: dict[str, Path], module: str, layout: str = LAYOUT) -> tuple[torch.Tensor, torch.Tensor]:
    """(W * M, keep mask M) of one module of a `layout` checkpoint; `where`: tensor name -> file."""
    parts = {}
    for suffix in SUFFIXES[layout]:
        if module + suffix not in where:
            marker = f"{module}.{MARKER[layout]}"
            raise PlanError(f"{where[marker]}: layer {module}.weight: tensor {module + suffix!r} missing")
        parts[suffix[1:]] = _tensor(where[module + suffix], module + suffix)
    name = f"{module}.weight"
    if layout == MARLIN:
        return marlin24.decode_marlin24(parts["weight_packed"], parts["scale_packed"], parts["meta"], name)
    scale, zero = _scales(where, module)
    if layout == LAYOUT:
        return decode_24_bitmask(parts["compressed"], parts["bitmask"], parts["shape"], name, scale=scale,
                                 zero_point=zero)
    return decode_bitmask(parts["compressed"], parts["bitmask"], parts["shape"], parts["row_offsets"], name,
                          scale=scale, zero_point=zero)


def _dense_weight(where: dict[str, Path], module: str) -> torch.Tensor:
    """A weight stored whole (a layer the sparsity config ignored), dequantized if it is FP8 / int8."""
    key = module + ".weight"
    w = _tensor(where[key], key)
    if w.dtype not in QUANT_DTYPES:
        return w
    return dequantize(w.float(), *_scales(where, module), key)


def _scales(where: dict[str, Path], module: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight_scale, weight_zero_point) of a module, each None when the checkpoint holds none."""
    return tuple(_tensor(where[k], k) if k in where else None
                 for k in (module + ".weight_scale", module + ".weight_zero_point"))


def dequantize(values: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None,
               name: str) -> torch.Tensor:
    """values (N, K) in fp32 times `scale` broadcast to them (per tensor, channel, group or block), in the
    scale's dtype; `PlanError` naming `name` for a missing or ill-shaped scale or an asymmetric zero point."""
    if scale is None:
        raise PlanError(f"layer {name}: quantized values without a weight_scale tensor; cannot dequantize")
    if zero_point is not None and bool((zero_point != 0).any()):
        raise PlanError(f"layer {name}: asymmetric quantization (nonzero weight_zero_point) is not supported")
    n, k = values.shape
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(1, 1)
    elif s.dim() == 1 and s.numel() == n:
        s = s.reshape(n, 1)
    elif s.dim() == 2 and n % s.shape[0] == 0 and k % s.shape[1] == 0:
        s = s.repeat_interleave(n // s.shape[0], 0).repeat_interleave(k // s.shape[1], 1)
    else:
        raise PlanError(f"layer {name}: weight_scale of shape {tuple(scale.shape)} does not tile a weight of "
                        f"shape {(n, k)}")
    return (values * s).to(scale.dtype)


def decode_24_bitmask(compressed: torch.Tensor, bitmask: torch.Tensor, shape: torch.Tensor | list[int],
                      name: str = "weight", *, scale: torch.Tensor | None = None,
                      zero_point: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(W * M of shape (N, K), keep mask M) from one layer's three tensors; `PlanError` naming `name` if bad.

    FP8 / int8 values need `scale` (``<module>.weight_scale``) and come back in its dtype.

    Example:
        >>> w, m = decode_24_bitmask(values, bits, torch.tensor([[8], [16]]))
        >>> w.shape, int(m.sum())
        (torch.Size([8, 16]), 64)
    """
    n, k = _dims(shape, compressed, name)
    if k % 4:
        raise PlanError(f"layer {name}: K={k} is not a multiple of 4 (no 2:4 groups)")
    if tuple(compressed.shape) != (n, k // 2) and compressed.numel() != n * k // 2:
        raise PlanError(f"layer {name}: compressed has shape {tuple(compressed.shape)}, expected {(n, k // 2)}")
    mask = _unpack(bitmask, n, k, name)
    per_group = mask.reshape(n, k // 4, 4).sum(-1)
    if (per_group != 2).any():
        r, g = (int(i) for i in (per_group != 2).nonzero()[0])
        raise PlanError(f"layer {name}: row {r}, columns {4 * g}..{4 * g + 3} keep {int(per_group[r, g])} of 4 "
                        "in the bitmask; a 2:4 layout keeps exactly 2")
    return _scatter(compressed, mask, name, scale, zero_point), mask


def decode_bitmask(compressed: torch.Tensor, bitmask: torch.Tensor, shape: torch.Tensor | list[int],
                   row_offsets: torch.Tensor, name: str = "weight", *, scale: torch.Tensor | None = None,
                   zero_point: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(W * M, M) of one layer of the unstructured ``sparse-bitmask`` layout: the nonzeros of each row in
    column order (1-D), the (N, ceil(K/8)) bitmask packed as sparse-24-bitmask's, and each row's first
    index into the values (``row_offsets``, checked against the bitmask). Any number may be kept per group.

    Example:
        >>> w, m = decode_bitmask(values, bits, torch.tensor([8, 16]), offsets, "fc.weight")
    """
    n, k = _dims(shape, compressed, name)
    mask = _unpack(bitmask, n, k, name)
    counts = mask.sum(1)
    if compressed.numel() != int(counts.sum()):
        raise PlanError(f"layer {name}: {compressed.numel()} compressed values for {int(counts.sum())} bits set")
    if not torch.equal(row_offsets.flatten().to(torch.int64), torch.cumsum(counts, 0) - counts):
        raise PlanError(f"layer {name}: row_offsets do not match the bitmask's rows")
    return _scatter(compressed, mask, name, scale, zero_point), mask


def _dims(shape: torch.Tensor | list[int], compressed: torch.Tensor, name: str) -> tuple[int, int]:
    """(N, K) from a layer's shape tensor, its values' dtype checked first (packed int4 is named as such)."""
    if compressed.dtype not in QUANT_DTYPES and (not compressed.is_floating_point() or compressed.dtype.itemsize < 2):
        raise PlanError(f"layer {name}: compressed values are {compressed.dtype}; only float, FP8 and int8 values "
                        "are read (packed int4 is not)")
    dims = [int(v) for v in torch.as_tensor(shape).flatten().tolist()]
    if len(dims) != 2 or min(dims) <= 0:
        raise PlanError(f"layer {name}: shape tensor holds {dims}, expected [N, K] with N, K > 0")
    return dims[0], dims[1]


def _unpack(bitmask: torch.Tensor, n: int, k: int, name: str) -> torch.Tensor:
    """The (N, K) bool mask of a bitmask packed with numpy.packbits(bitorder="little") per row."""
    if bitmask.dtype not in (torch.uint8, torch.int8) or tuple(bitmask.shape) != (n, -(-k // 8)):
        raise PlanError(f"layer {name}: bitmask is a {bitmask.dtype} tensor of shape {tuple(bitmask.shape)}, "
                        f"expected uint8 {(n, -(-k // 8))}")
    bits = torch.arange(8, dtype=torch.uint8)
    return ((bitmask.view(torch.uint8)[..., None] >> bits) & 1).bool().reshape(n, -1)[:, :k]


def _scatter(compressed: torch.Tensor, mask: torch.Tensor, name: str, scale: torch.Tensor | None,
             zero_point: torch.Tensor | None) -> torch.Tensor:
    """The dense (N, K) weight holding `compressed` where `mask` is set, dequantized when they are FP8 / int8."""
    quantized = compressed.dtype in QUANT_DTYPES
    weight = torch.zeros(mask.shape, dtype=torch.float32 if quantized else compressed.dtype)
    weight[mask] = compressed.reshape(-1).to(weight.dtype)  # boolean indexing is row-major: the compressor's order
    return dequantize(weight, scale, zero_point, name) if quantized else weight


def _index(path: Path, layout: str) -> dict[str, Path]:
    """{tensor name: safetensors file} of a `layout` checkpoint file or folder (its config.json checked first)."""
    return {key: f for f in _files(path, layout) for key in _keys(f)}


def _modules(where: dict[str, Path], path: str | os.PathLike, layout: str = LAYOUT) -> list[str]:
    marker = f".{MARKER[layout]}"
    modules = sorted(k.removesuffix(marker) for k in where if k.endswith(marker))
    if not modules:
        raise PlanError(f"{path}: no '<module>{marker}' tensors; not a compressed-tensors {layout} checkpoint")
    return modules


def _files(path: Path, layout: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise PlanError(f"{path}: no such file or folder")
    _check_config(path / "config.json", layout)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PlanError(f"{path}: no *.safetensors files")
    return files


def _check_config(path: Path, layout: str) -> None:
    """Refuse a checkpoint whose config.json names another sparsity layout (none named: try the tensors)."""
    if not path.is_file():
        return
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: not valid JSON ({e})") from None
    for key in ("quantization_config", "compression_config"):
        sparsity = (config.get(key) or {}).get("sparsity_config") or {}
        fmt = sparsity.get("format")
        if fmt is not None and fmt != layout and not (layout == MARLIN and fmt == "dense"):  # marlin's own record
            raise PlanError(f"{path}: sparsity format {fmt!r}; only {layout!r} is read here")


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types
        raise PlanError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _tensor(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)
