"""Parts of a `LayerPlan` that are whole tiles, and plans stacked row-wise, without unpacking any weight.

A plan's buffers list its tiles in row-major grid order (the `patchc.ir` docstring), so the plan of a block of
whole tiles is its kinds' sub-grid and the dense tiles, 2:4 values and metadata of the tiles inside it, in the
same order; the plan of weights stacked along N is their buffers concatenated. The runtime uses both to serve
experts a model holds flat (DBRX's (E * F, H) weights, planned whole): expert e's rows of w1, its columns of
w2's (H, E * F) transpose, and its gate and up rows as one (2F, H) projection.

Example:
    >>> w1_e = take_block(w1, "experts.gate.3", rows=(3 * 32, 4 * 32))   # expert 3 of F = 32 rows each
    >>> gate_up = stack_rows([w1_e, v1_e], "experts.gate_up_proj.3")     # (64, H)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from patchc.ir.errors import PlanError
from patchc.ir.layer_plan import LayerPlan
from patchc.ir.tiles import TILE_DENSE, TILE_SPARSE24


def take_block(layer: LayerPlan, name: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> LayerPlan:
    """The plan of ``W[r0:r1, c0:c1]`` (None: every row / column), named `name`. Each bound must lie on a tile
    boundary of `layer` (an end may also be the weight's edge); a biased layer can give rows, not columns."""
    (n, k), (b1, b2) = layer.shape, layer.tile
    r0, r1 = _span(layer, rows, n, b1, "rows")
    c0, c1 = _span(layer, cols, k, b2, "columns")
    if layer.bias is not None and (c0, c1) != (0, k):
        raise PlanError(f"layer {layer.name}: columns {c0}..{c1} of a biased layer have no bias of their own; "
                        "take whole rows")
    grid = (slice(r0 // b1, -(-r1 // b1)), slice(c0 // b2, -(-c1 // b2)))
    inside = torch.zeros(layer.grid, dtype=torch.bool, device=layer.kinds.device)
    inside[grid] = True
    inside, kinds = inside.flatten(), layer.kinds.flatten()
    dense, sparse = inside[kinds == TILE_DENSE], inside[kinds == TILE_SPARSE24]
    bias = None if layer.bias is None else layer.bias[r0:r1].clone()
    return LayerPlan(name, (r1 - r0, c1 - c0), layer.tile, layer.kinds[grid].contiguous(), layer.dense[dense],
                     layer.values[sparse], layer.meta[sparse], bias, layer.dtype)


def stack_rows(parts: Sequence[LayerPlan], name: str) -> LayerPlan:
    """The plan of ``torch.cat([W_0, W_1, ...])`` (rows after rows), named `name`: the parts share K, tile and
    dtype, each but the last holds whole tile rows, and all or none have a bias."""
    if not parts:
        raise PlanError(f"layer {name}: stack_rows needs at least one plan")
    first = parts[0]
    for i, part in enumerate(parts):
        if (part.shape[1], part.tile, part.dtype) != (first.shape[1], first.tile, first.dtype):
            raise PlanError(f"layer {name}: cannot stack {part.name} (K={part.shape[1]}, tile {part.tile}, "
                            f"{part.dtype}) under {first.name} (K={first.shape[1]}, tile {first.tile}, {first.dtype})")
        if i < len(parts) - 1 and part.shape[0] % part.tile[0]:
            raise PlanError(f"layer {name}: {part.name} has {part.shape[0]} rows, not whole {part.tile[0]}-row "
                            "tiles, so the next plan's tiles would not start on a tile row")
    if len({p.bias is None for p in parts}) > 1:
        raise PlanError(f"layer {name}: some of {[p.name for p in parts]} have a bias and some do not")

    def cat(part: str) -> torch.Tensor:
        return torch.cat([getattr(p, part) for p in parts])

    bias = None if first.bias is None else cat("bias")
    return LayerPlan(name, (sum(p.shape[0] for p in parts), first.shape[1]), first.tile, cat("kinds"),
                     cat("dense"), cat("values"), cat("meta"), bias, first.dtype)


def _span(layer: LayerPlan, span: tuple[int, int] | None, size: int, tile: int, what: str) -> tuple[int, int]:
    """(start, end) of `span` along a dimension of `size` cut into `tile`-wide tiles, checked."""
    start, end = (0, size) if span is None else (int(span[0]), int(span[1]))
    if not 0 <= start < end <= size:
        raise PlanError(f"layer {layer.name}: {what} {start}..{end} are not inside its {size} {what}")
    if start % tile or (end % tile and end != size):
        raise PlanError(f"layer {layer.name}: {what} {start}..{end} do not start and end on its {tile}-wide tiles "
                        f"(tile {layer.tile}); a part of a plan is whole tiles")
    return start, end


__all__ = ["stack_rows", "take_block"]
