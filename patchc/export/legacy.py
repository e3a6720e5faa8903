"""Reading compressed-tensors' legacy ``sparse-24-bitmask`` checkpoints into an all-2:4 `TilePlan`.

compressed-tensors (neuralmagic / vLLM) stored a 2:4-sparse weight ``<module>.weight`` of shape (N, K)
as three tensors, named after the module (the ``.weight`` suffix dropped):

    <module>.compressed   (N, K/2)              the kept values of each row, in increasing column order
    <module>.bitmask      uint8 (N, ceil(K/8))  the (N, K) keep mask, each row packed with
                                                numpy.packbits(bitorder="little"): column c is bit c % 8
                                                (value 1 << (c % 8)) of byte c // 8
    <module>.shape        int (2, 1)            [N, K]

Its compressor kept the 2 largest magnitudes of every group of 4 consecutive columns, so each group
has exactly 2 bits set (a kept value may be 0). The checkpoint's config.json names the layout in
``quantization_config.sparsity_config.format`` (older ones: ``compression_config``). The library
dropped its sparse compressors in 2026; this reader keeps such checkpoints usable. Quantized
values (int8 / fp8 ``compressed`` with scales) are refused: patchc plans hold float weights.

Example:
    >>> plan = plan_from_compressed_tensors("llama-2-7b-2of4/", tile=(128, 128))
    >>> plan.layers["model.layers.0.mlp.up_proj.weight"].n_dense
    0
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from patchc.ir import TILE_SPARSE24, LayerPlan, PlanError, TilePlan
from patchc.ir.tiles import tile_grid, tile_pair
from patchc.utils.progress import progress

LAYOUT = "sparse-24-bitmask"
SUFFIXES = (".compressed", ".bitmask", ".shape")


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
    files = _files(Path(path_or_dir))
    where: dict[str, Path] = {}
    for f in files:
        for key in _keys(f):
            where[key] = f
    modules = sorted(k.removesuffix(".bitmask") for k in where if k.endswith(".bitmask"))
    if not modules:
        raise PlanError(f"{path_or_dir}: no '<module>.bitmask' tensors; not a {LAYOUT} checkpoint")
    layers = {}
    for module in progress(modules, desc="sparse-24-bitmask layers", disable=not show_progress):
        parts = {}
        for suffix in SUFFIXES:
            if module + suffix not in where:
                raise PlanError(f"{where[module + '.bitmask']}: layer {module}.weight: tensor {module + suffix!r} missing")
            parts[suffix[1:]] = _tensor(where[module + suffix], module + suffix)
        bias = _tensor(where[module + ".bias"], module + ".bias") if module + ".bias" in where else None
        name = f"{module}.weight"
        weight, mask = decode_24_bitmask(parts["compressed"], parts["bitmask"], parts["shape"], name)
        kinds = torch.full(tile_grid(tuple(weight.shape), tile), TILE_SPARSE24, dtype=torch.uint8)
        layers[name] = LayerPlan.from_mask(name, weight, kinds, mask, bias=bias, tile=tile)
    meta = {"source": f"compressed-tensors {LAYOUT}", "path": str(path_or_dir), "tile": list(tile)}
    return TilePlan(layers=layers, meta=meta)


def decode_24_bitmask(compressed: torch.Tensor, bitmask: torch.Tensor, shape: torch.Tensor | list[int],
                      name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(W * M of shape (N, K), keep mask M) from one layer's three tensors; `PlanError` naming `name` if bad.

    Example:
        >>> w, m = decode_24_bitmask(values, bits, torch.tensor([[8], [16]]))
        >>> w.shape, int(m.sum())
        (torch.Size([8, 16]), 64)
    """
    dims = [int(v) for v in torch.as_tensor(shape).flatten().tolist()]
    if len(dims) != 2 or min(dims) <= 0:
        raise PlanError(f"layer {name}: shape tensor holds {dims}, expected [N, K] with N, K > 0")
    n, k = dims
    if k % 4:
        raise PlanError(f"layer {name}: K={k} is not a multiple of 4 (no 2:4 groups)")
    if not compressed.is_floating_point() or compressed.dtype.itemsize < 2:
        raise PlanError(f"layer {name}: compressed values are {compressed.dtype}; quantized {LAYOUT} checkpoints "
                        "are not supported (patchc plans hold fp32 / fp16 / bf16 weights)")
    if tuple(compressed.shape) != (n, k // 2) and compressed.numel() != n * k // 2:
        raise PlanError(f"layer {name}: compressed has shape {tuple(compressed.shape)}, expected {(n, k // 2)}")
    if bitmask.dtype not in (torch.uint8, torch.int8) or tuple(bitmask.shape) != (n, -(-k // 8)):
        raise PlanError(f"layer {name}: bitmask is a {bitmask.dtype} tensor of shape {tuple(bitmask.shape)}, "
                        f"expected uint8 {(n, -(-k // 8))}")
    bits = torch.arange(8, dtype=torch.uint8)
    mask = ((bitmask.view(torch.uint8)[..., None] >> bits) & 1).bool().reshape(n, -1)[:, :k]
    per_group = mask.reshape(n, k // 4, 4).sum(-1)
    if (per_group != 2).any():
        r, g = (int(i) for i in (per_group != 2).nonzero()[0])
        raise PlanError(f"layer {name}: row {r}, columns {4 * g}..{4 * g + 3} keep {int(per_group[r, g])} of 4 "
                        "in the bitmask; a 2:4 layout keeps exactly 2")
    weight = torch.zeros(n, k, dtype=compressed.dtype)
    weight[mask] = compressed.reshape(-1)  # boolean indexing is row-major: the compressor's order
    return weight, mask


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise PlanError(f"{path}: no such file or folder")
    _check_config(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PlanError(f"{path}: no *.safetensors files")
    return files


def _check_config(path: Path) -> None:
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
        if fmt is not None and fmt != LAYOUT:
            raise PlanError(f"{path}: sparsity format {fmt!r}; only {LAYOUT!r} is read")


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
