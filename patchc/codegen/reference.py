"""Plain-PyTorch reference of the hybrid linear, and random plans for tests and benchmarks.

`reference_tile_linear` rebuilds W*M straight from the IR (LayerPlan: kinds / dense / values / meta) or
from a PackedLayer and computes x @ (W*M)^T (+ bias) in float64, the yardstick of the kernel tests.

Example:
    >>> layer = random_layer_plan(96, 80, tile=(32, 16), kinds="mixed", seed=0)
    >>> y64 = reference_tile_linear(torch.randn(3, 80), layer)
    >>> y64.shape, y64.dtype
    (torch.Size([3, 96]), torch.float64)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from patchc.codegen.layout import PackedLayer, packed_to_dense

KIND_PRESETS = ("dense", "sparse", "mixed", "rows_no_dense", "rows_no_sparse")


def reference_tile_linear(
    x: torch.Tensor, layer: Any, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 x @ (W*M)^T (+ bias) for a PackedLayer or a LayerPlan; bias defaults to the layer's own."""
    if isinstance(layer, PackedLayer):
        w = packed_to_dense(layer, torch.float64)
    else:
        w = layerplan_to_dense(layer, torch.float64)
    bias = getattr(layer, "bias", None) if bias is None else bias
    y = x.to(torch.float64) @ w.to(x.device).T
    if bias is not None:
        y = y + bias.to(device=x.device, dtype=torch.float64)
    return y


def layerplan_to_dense(layer: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W*M (N, K) from a LayerPlan's tensors (independent of the packing code, on purpose)."""
    n, k = layer.shape
    b1, b2 = layer.tile
    dtype = dtype or layer.dtype
    kinds = layer.kinds.to(torch.uint8).cpu()
    tn, tk = kinds.shape
    tiles = torch.zeros(tn, tk, b1, b2, dtype=dtype)
    tiles[kinds == 0] = layer.dense.cpu().to(dtype)
    ns = int((kinds == 1).sum())
    if ns:
        meta = layer.meta.cpu()
        nib = torch.stack([meta & 15, meta >> 4], -1).reshape(ns, b1, 2 * meta.shape[-1])[..., : b2 // 4].long()
        vals = layer.values.cpu().to(dtype).reshape(ns, b1, b2 // 4, 2)
        groups = torch.zeros(ns, b1, b2 // 4, 4, dtype=dtype)
        groups.scatter_(-1, (nib & 3)[..., None], vals[..., :1])
        groups.scatter_(-1, (nib >> 2)[..., None], vals[..., 1:])
        tiles[kinds == 1] = groups.reshape(ns, b1, b2)
    return tiles.permute(0, 2, 1, 3).reshape(tn * b1, tk * b2)[:n, :k].contiguous()


def random_kinds(tn: int, tk: int, preset: str | float, generator: torch.Generator) -> torch.Tensor:
    """(tn, tk) uint8 tile kinds: a preset name, or a float = probability that a tile is dense."""
    if isinstance(preset, float):
        return (torch.rand(tn, tk, generator=generator) >= preset).to(torch.uint8)
    if preset == "dense":
        return torch.zeros(tn, tk, dtype=torch.uint8)
    if preset == "sparse":
        return torch.ones(tn, tk, dtype=torch.uint8)
    kinds = (torch.rand(tn, tk, generator=generator) < 0.5).to(torch.uint8)
    kinds.view(-1)[0], kinds.view(-1)[-1] = 0, 1  # both kinds present
    if preset == "rows_no_dense" and tn > 1:
        kinds[0] = 1  # a row without dense tiles
    elif preset == "rows_no_sparse" and tn > 1:
        kinds[0] = 0  # a row without 2:4 tiles
        kinds[-1, -1] = 1
    elif preset not in ("mixed", "rows_no_dense", "rows_no_sparse"):
        raise ValueError(f"unknown kinds preset {preset!r}; use one of {KIND_PRESETS} or a float")
    return kinds


def random_24_mask(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """(n, k) bool mask with exactly 2 kept per group of 4 along K (K % 4 == 0)."""
    from patchc.ir import PATTERNS

    idx = torch.randint(0, 6, (n, k // 4), generator=generator)
    return PATTERNS.to(torch.bool)[idx].reshape(n, k)


def random_layer_plan(
    n: int,
    k: int,
    tile: tuple[int, int] = (16, 16),
    kinds: str | float | torch.Tensor = "mixed",
    *,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    seed: int = 0,
    name: str = "layer.weight",
) -> Any:
    """A LayerPlan with random weights, random tile kinds and random 2:4 patterns (via LayerPlan.from_mask)."""
    from patchc.ir import LayerPlan

    g = torch.Generator().manual_seed(seed)
    tn, tk = math.ceil(n / tile[0]), math.ceil(k / tile[1])
    if not isinstance(kinds, torch.Tensor):
        kinds = random_kinds(tn, tk, kinds, g)
    weight = torch.randn(n, k, generator=g).to(dtype)
    dense_elems = (kinds == 0).repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:n, :k]
    mask = dense_elems | random_24_mask(n, k, g)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return LayerPlan.from_mask(name, weight, kinds.to(torch.uint8), mask, bias=b, tile=tuple(tile))


def random_tile_plan(layers: dict[str, dict[str, Any]], seed: int = 0) -> Any:
    """TilePlan of random layers: {fqn: random_layer_plan kwargs (n, k, tile, kinds, ...)}."""
    from patchc.ir import TilePlan

    built = {
        fqn: random_layer_plan(name=fqn, seed=seed + i, **kw) for i, (fqn, kw) in enumerate(layers.items())
    }
    return TilePlan(layers=built, skipped={}, meta={})
