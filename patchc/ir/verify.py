"""Validation of one layer's buffers: everything `LayerPlan` checks on creation and `verify()` re-checks.

Shapes and dtypes against the grid, known tile kinds, one device, finite values, 2:4 metadata that names two distinct
positions per group (and leaves the unused last nibble 0), and zero padding outside the (N, K) extent
of partial edge tiles. Each failure raises `PlanError` naming the layer and, where it applies, the tile,
row and columns.

Example:
    >>> verify_layer(layer)          # None, or PlanError("layer fc.weight: tile (2, 1) ...")
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from patchc.ir.errors import PlanError, describe, first_true
from patchc.ir.tiles import TILE_DENSE, TILE_SPARSE24, nth_tile, tile_extent

if TYPE_CHECKING:
    from patchc.ir.layer_plan import LayerPlan

PARTS = ("kinds", "dense", "values", "meta")  # the buffers every layer has (bias is optional)


def verify_layer(layer: LayerPlan) -> None:
    """Raise `PlanError` (naming the layer, and the tile/group where relevant) if inconsistent."""
    name, (n, k), (b1, b2) = layer.name, layer.shape, layer.tile
    where = f"layer {name}"
    if n <= 0 or k <= 0:
        raise PlanError(f"{where}: shape {layer.shape} must be positive")
    if b1 <= 0 or b2 <= 0 or b1 % 4 or b2 % 4:
        raise PlanError(f"{where}: tile {layer.tile} must be positive multiples of 4")
    if k % 4:
        raise PlanError(
            f"{where}: K={k} is not a multiple of 4 (no 2:4 groups); such layers are skipped, not planned"
        )
    if not isinstance(layer.dtype, torch.dtype) or not layer.dtype.is_floating_point:
        raise PlanError(f"{where}: dtype must be a float torch.dtype, got {layer.dtype!r}")
    for part in PARTS:
        if not isinstance(getattr(layer, part), torch.Tensor):
            raise PlanError(f"{where}: {part} must be a tensor, got {type(getattr(layer, part)).__name__}")
    grid = layer.grid
    if layer.kinds.dtype != torch.uint8 or tuple(layer.kinds.shape) != grid:
        raise PlanError(
            f"{where}: kinds must be uint8 of the grid shape {grid} for shape {layer.shape} and tile {layer.tile}, "
            f"got {describe(layer.kinds)}"
        )
    bad_kind = (layer.kinds != TILE_DENSE) & (layer.kinds != TILE_SPARSE24)
    if bad_kind.any():
        r, c = first_true(bad_kind)
        raise PlanError(f"{where}: tile ({r}, {c}) has unknown kind code {int(layer.kinds[r, c])} (0 dense, 1 2:4)")
    devices = {t.device for t in (layer.kinds, layer.dense, layer.values, layer.meta)}
    if layer.bias is not None and isinstance(layer.bias, torch.Tensor):
        devices.add(layer.bias.device)
    if len(devices) > 1:
        on = sorted(map(str, devices))
        raise PlanError(f"{where}: buffers live on different devices {on}; move them to one device")
    nd, ns = layer.n_dense, layer.n_sparse
    expect = {
        "dense": ((nd, b1, b2), layer.dtype),
        "values": ((ns, b1, b2 // 2), layer.dtype),
        "meta": ((ns, b1, math.ceil(b2 / 8)), torch.uint8),
    }
    for part, (want_shape, want_dtype) in expect.items():
        t = getattr(layer, part)
        if t.dtype != want_dtype:
            raise PlanError(
                f"{where}: {part} has dtype {t.dtype}, expected {want_dtype} "
                "(dense, values and bias share the layer dtype; meta and kinds are uint8)"
            )
        if tuple(t.shape) != want_shape:
            count = want_shape[0]
            if t.dim() == 3 and tuple(t.shape[1:]) == want_shape[1:]:
                raise PlanError(
                    f"{where}: {part} holds {t.shape[0]} tiles but kinds has {count} "
                    f"{'dense' if part == 'dense' else '2:4'} tiles (truncated or extra buffer)"
                )
            raise PlanError(
                f"{where}: {part} has shape {tuple(t.shape)}, expected {want_shape} for tile {layer.tile}"
            )
    if layer.bias is not None:
        if not isinstance(layer.bias, torch.Tensor) or tuple(layer.bias.shape) != (n,):
            raise PlanError(f"{where}: bias must have shape ({n},), got {describe(layer.bias)}")
        if layer.bias.dtype != layer.dtype:
            raise PlanError(f"{where}: bias has dtype {layer.bias.dtype}, expected the layer dtype {layer.dtype}")
    _verify_finite(layer)
    if ns:
        _verify_meta(layer)
    _verify_padding(layer)


def _verify_finite(layer: LayerPlan) -> None:
    """NaN or inf weights would silently poison every output that reads them."""
    for part in ("dense", "values", "bias"):
        t = getattr(layer, part)
        if t is None or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t)
        if bad.any():
            where = f"tile {first_true(bad.flatten(1).any(1, keepdim=True))[0]}" if t.dim() == 3 else "element"
            raise PlanError(f"layer {layer.name}: {part} holds {int(bad.sum())} NaN/inf values (first in {part} "
                            f"{where}); the weights it was made from were not finite")

def _verify_meta(layer: LayerPlan) -> None:
    b1, b2 = layer.tile
    if b2 % 8 == 4:
        hi = (layer.meta[..., -1] >> 4) != 0
        if hi.any():
            t, i = first_true(hi)
            r, c = nth_tile(layer.kinds, TILE_SPARSE24, t)
            raise PlanError(
                f"layer {layer.name}: tile ({r}, {c}) row {r * b1 + i}: unused high nibble of the last meta byte "
                "is not 0 (b2 % 8 == 4)"
            )
    # uint8 nibble arithmetic (no int64 unpack) keeps this cheap on big layers
    nib = torch.stack([layer.meta & 0xF, layer.meta >> 4], dim=-1).flatten(-2)[..., : b2 // 4]
    bad = (nib & 3) >= (nib >> 2)
    if bad.any():
        t, i, g = first_true(bad)
        pos = layer.positions()
        r, c = nth_tile(layer.kinds, TILE_SPARSE24, t)
        i0, i1 = pos[t, i, g].tolist()
        raise PlanError(
            f"layer {layer.name}: tile ({r}, {c}) group at row {r * b1 + i}, columns {c * b2 + 4 * g}.."
            f"{c * b2 + 4 * g + 3} has meta positions ({i0}, {i1}); need i0 < i1 in 0..3 "
            "(2 distinct kept positions per group; the meta buffer is corrupt)"
        )

def _verify_padding(layer: LayerPlan) -> None:
    (n, k), (b1, b2) = layer.shape, layer.tile
    if n % b1 == 0 and k % b2 == 0:
        return
    rows, cols = tile_extent(layer.shape, layer.tile, layer.kinds.device)
    for code, buf, width, unit in (
        (TILE_DENSE, layer.dense, b2, 1),
        (TILE_SPARSE24, layer.values, b2 // 2, 2),  # value j belongs to group j // 2, columns 4 * (j // 2)..
    ):
        rc = (layer.kinds == code).nonzero()
        if not len(rc):
            continue
        vr, vc = rows[rc[:, 0]], cols[rc[:, 1]]
        edge = (vr < b1) | (vc < b2)
        if not edge.any():
            continue
        sub = buf[edge.to(buf.device)]
        col_start = (torch.arange(width, device=buf.device) // unit) * (4 if unit == 2 else 1)
        oob = (torch.arange(b1, device=buf.device)[None, :, None] >= vr[edge][:, None, None]) | (
            col_start[None, None, :] >= vc[edge][:, None, None]
        )
        bad = (sub != 0) & oob
        if bad.any():
            e, i, j = first_true(bad)
            r, c = rc[edge][e].tolist()
            col = c * b2 + int(col_start[j])
            kind = "dense" if code == TILE_DENSE else "2:4"
            part = "" if code == TILE_DENSE else f" (a kept value of the group at columns {col}..{col + 3})"
            raise PlanError(
                f"layer {layer.name}: {kind} tile ({r}, {c}) has a nonzero in its padding at row {r * b1 + i}, "
                f"column {col}{part}, outside the ({n}, {k}) extent; padding must be 0"
            )
