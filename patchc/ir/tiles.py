"""Tile geometry: the padded grid of a weight, per-tile sizes, tiling and untiling, tile kind codes.

A weight W (N, K) is cut into b1 x b2 tiles (b1 rows along N, b2 columns along K). The grid is
(Tn, Tk) = (ceil(N / b1), ceil(K / b2)); edge tiles are partial and stored zero padded to the full
b1 x b2 ("padded grid"). Each tile is TILE_DENSE or TILE_SPARSE24. Tile grid of a (40, 24) weight
with tile (16, 16): grid 3 x 2::

              K ->  cols 0..15   16..23 (+8 padding)
    N  rows  0..15  [ tile 0,0 ]  [ 0,1 :pad ]
    |  rows 16..31  [ tile 1,0 ]  [ 1,1 :pad ]
    v  rows 32..39  [ tile 2,0 ]  [ 2,1 :pad ]
          (+8 pad)  [   pad    ]  [ pad :pad ]

Example:
    >>> tile_grid((40, 24), (16, 16)), int(tile_sizes((40, 24), (16, 16))[2, 1])
    ((3, 2), 64)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from patchc.ir.errors import PlanError

TILE_DENSE = 0
TILE_SPARSE24 = 1
KIND_NAMES = {TILE_DENSE: "dense", TILE_SPARSE24: "2:4"}


def tile_grid(shape: tuple[int, int], tile: tuple[int, int]) -> tuple[int, int]:
    """Padded grid (Tn, Tk) = (ceil(N / b1), ceil(K / b2)), e.g. tile_grid((40, 24), (16, 16)) == (3, 2)."""
    return math.ceil(shape[0] / tile[0]), math.ceil(shape[1] / tile[1])


def padded_numel(shape: tuple[int, int], tile: tuple[int, int]) -> int:
    """Elements of the padded grid (what a plan stores), e.g. padded_numel((40, 24), (16, 16)) == 48 * 32."""
    tn, tk = tile_grid(shape, tile)
    return tn * tile[0] * tk * tile[1]


def tile_sizes(
    shape: tuple[int, int], tile: tuple[int, int], device: torch.device | str | None = None
) -> torch.Tensor:
    """Real (unpadded) elements per tile, int64 (Tn, Tk), e.g. tile_sizes((40, 24), (16, 16))[2, 1] == 8 * 8."""
    rows, cols = tile_extent(shape, tile, device)
    return rows[:, None] * cols[None, :]


def expand_tiles(t: torch.Tensor, tile: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Per-tile (Tn, Tk) -> per-element (N, K), edge cropped: expand_tiles(eye(2), (2, 2), (3, 4)).shape == (3, 4)."""
    return t.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[: shape[0], : shape[1]]


def to_tiles(x: torch.Tensor, tile: tuple[int, int], value: float = 0) -> torch.Tensor:
    """(N, K) -> (Tn, Tk, b1, b2), padding the bottom/right edge with `value`."""
    (n, k), (b1, b2) = x.shape, tile
    tn, tk = tile_grid((n, k), tile)
    if x.dtype == torch.bool:  # F.pad has no bool kernel
        return to_tiles(x.to(torch.uint8), tile, int(bool(value))).bool()
    x = F.pad(x, (0, tk * b2 - k, 0, tn * b1 - n), value=value)
    return x.view(tn, b1, tk, b2).permute(0, 2, 1, 3)


def from_tiles(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(Tn, Tk, b1, b2) -> (N, K), cropping the padding."""
    tn, tk, b1, b2 = t.shape
    return t.permute(0, 2, 1, 3).reshape(tn * b1, tk * b2)[: shape[0], : shape[1]].contiguous()


def tile_extent(
    shape: tuple[int, int], tile: tuple[int, int], device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid rows per tile row (Tn,) and valid columns per tile column (Tk,) of the padded grid."""
    tn, tk = tile_grid(shape, tile)
    rows = (shape[0] - torch.arange(tn, device=device) * tile[0]).clamp(max=tile[0])
    cols = (shape[1] - torch.arange(tk, device=device) * tile[1]).clamp(max=tile[1])
    return rows, cols


def valid_groups(shape: tuple[int, int], tile: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(Tn, Tk, b1, b2 // 4) bool: group lies inside (N, K) (K % 4 == 0 so a group is all in or out)."""
    rows, cols = tile_extent(shape, tile, device)
    b1, b2 = tile
    r_ok = torch.arange(b1, device=device)[None, :] < rows[:, None]  # (Tn, b1)
    g_ok = torch.arange(b2 // 4, device=device)[None, :] * 4 < cols[:, None]  # (Tk, G)
    return r_ok[:, None, :, None] & g_ok[None, :, None, :]


def tile_pair(tile: Any, what: str) -> tuple[int, int]:
    """(b1, b2) from an int or a pair; `PlanError` naming `what` for anything else."""
    if isinstance(tile, int):
        tile = (tile, tile)
    try:
        b1, b2 = (int(t) for t in tile)
    except (TypeError, ValueError):
        raise PlanError(f"{what}: tile must be a pair (b1, b2) of ints, got {tile!r}") from None
    return b1, b2


def nth_tile(kinds: torch.Tensor, code: int, t: int) -> tuple[int, int]:
    """Grid (row, col) of the t-th tile of kind `code` in buffer (row-major) order."""
    r, c = (kinds == code).nonzero()[t].tolist()
    return r, c
