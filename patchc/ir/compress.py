"""Compressing W * M into the IR's buffers: dense tiles whole, 2:4 tiles as kept values + nibble metadata.

`compress` is the construction half of `LayerPlan.from_mask`: it checks the mask against the tile kinds
(a dense tile keeps every weight, a 2:4 tile exactly 2 of every 4) and returns the buffers in the
layout the module docstring of `patchc.ir` draws. Padding groups of partial edge tiles get positions
(0, 1) and zero values.

Example:
    >>> fields = compress("fc.weight", w, kinds, mask, tile=(16, 16))
    >>> sorted(fields)
    ['bias', 'dense', 'dtype', 'kinds', 'meta', 'name', 'shape', 'tile', 'values']
"""

from __future__ import annotations

from typing import Any

import torch

from patchc.ir.errors import PlanError, describe, first_true
from patchc.ir.patterns import EXACT_PATTERN, PATTERN_NIBBLES, group_codes, pack_nibbles, pattern_to_positions
from patchc.ir.tiles import TILE_DENSE, TILE_SPARSE24, nth_tile, tile_grid, tile_pair, to_tiles, valid_groups


def compress(
    name: str,
    weight: torch.Tensor,
    kinds: torch.Tensor,
    mask: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: tuple[int, int] = (128, 128),
) -> dict[str, Any]:
    """The `LayerPlan` fields of W * M, given tile kinds (Tn, Tk) and a hard mask (N, K) bool."""
    b1, b2 = tile = tile_pair(tile, f"layer {name}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise PlanError(f"layer {name}: weight must be a 2-D float tensor, got {describe(weight)}")
    shape = (n, k) = tuple(weight.shape)
    if b1 <= 0 or b2 <= 0 or b1 % 4 or b2 % 4:
        raise PlanError(f"layer {name}: tile {tile} must be positive multiples of 4")
    if k % 4:
        raise PlanError(f"layer {name}: K={k} is not a multiple of 4, so it has no 2:4 groups; skip this layer")
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape or mask.dtype != torch.bool:
        raise PlanError(f"layer {name}: mask must be a bool tensor of shape {shape}, got {describe(mask)}")
    grid = tile_grid(shape, tile)
    if not isinstance(kinds, torch.Tensor) or tuple(kinds.shape) != grid:
        raise PlanError(
            f"layer {name}: kinds must have the grid shape {grid} for tile {tile}, got {describe(kinds)}"
        )
    weight, dev = weight.detach(), weight.device
    kinds = kinds.to(dev)
    bad_kind = (kinds != TILE_DENSE) & (kinds != TILE_SPARSE24)
    if bad_kind.any():
        r, c = first_true(bad_kind)
        raise PlanError(f"layer {name}: tile ({r}, {c}) has unknown kind code {int(kinds[r, c])} (0 dense, 1 2:4)")
    kinds = kinds.to(torch.uint8)
    is_dense = kinds == TILE_DENSE
    mask = mask.to(dev)

    mtiles = to_tiles(mask, tile, value=True)  # padding counts as kept for the dense check
    dense_ok = mtiles.flatten(2).all(-1)
    bad = is_dense & ~dense_ok
    if bad.any():
        r, c = first_true(bad)
        i, j = first_true(~mtiles[r, c])
        raise PlanError(
            f"layer {name}: tile ({r}, {c}) is dense but its mask drops weight ({r * b1 + i}, {c * b2 + j}); "
            "a dense tile keeps every weight"
        )

    flat_kinds = kinds.flatten()
    wtiles = to_tiles(weight, tile).reshape(-1, b1, b2)
    dense = wtiles[flat_kinds == TILE_DENSE].contiguous()

    sparse_sel = flat_kinds == TILE_SPARSE24
    groups = mtiles.reshape(-1, b1, b2 // 4, 4)[sparse_sel]  # (n_sparse, b1, G, 4)
    valid = valid_groups(shape, tile, dev).reshape(-1, b1, b2 // 4)[sparse_sel]
    pidx = torch.where(valid, EXACT_PATTERN.to(dev)[group_codes(groups)], 0)  # padding groups -> (0, 1)
    if (pidx < 0).any():
        t, i, g = first_true(pidx < 0)
        r, c = nth_tile(kinds, TILE_SPARSE24, t)
        kept = int(groups[t, i, g].sum())
        raise PlanError(
            f"layer {name}: tile ({r}, {c}) is 2:4 but group at row {r * b1 + i}, columns "
            f"{c * b2 + 4 * g}..{c * b2 + 4 * g + 3} keeps {kept} of 4; a 2:4 tile keeps exactly 2 per group"
        )
    positions = pattern_to_positions(pidx)  # (n_sparse, b1, G, 2)
    wgroups = wtiles[sparse_sel].reshape(-1, b1, b2 // 4, 4)
    values = torch.gather(wgroups, -1, positions).reshape(-1, b1, b2 // 2).contiguous()
    meta = pack_nibbles(PATTERN_NIBBLES.to(dev)[pidx])
    if bias is not None:  # a copy: the plan owns its buffers (FSDP2 frees a gathered bias once its block is done)
        bias = bias.detach().to(device=dev, dtype=weight.dtype, copy=True)
    return dict(
        name=name,
        shape=shape,
        tile=tile,
        kinds=kinds.contiguous(),
        dense=dense,
        values=values,
        meta=meta.contiguous(),
        bias=bias,
        dtype=weight.dtype,
    )
