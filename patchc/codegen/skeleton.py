"""A layer's kernel layout without its weights: what offline generation needs from `pack`, at no copy cost.

`generate()` reads only the layout of a packed layer (shape, block, block kinds, CSR index lists, blocks
per row, buffer shapes and dtypes), never a weight value: the cubins take the weights as runtime
arguments. Packing a 7B model's weights just to read their shapes costs minutes and gigabytes, so
`pack_skeleton` builds the same `PackedLayer` from the tile kinds alone, with the weight buffers
(dense, values, meta, bias) as shape-only tensors on the "meta" device. It uses `pack`'s own block
checks and CSR helpers, so both agree on every index (tests compare them layer by layer).

Example:
    >>> skel = pack_skeleton(plan, "layers.0.attention.wq.weight", block=(128, 64))   # doctest: +SKIP
    >>> skel.per_row, skel.dense.device                                               # doctest: +SKIP
    ((-1, -1), device(type='meta'))
"""

from __future__ import annotations

from typing import Any

import torch

from patchc.codegen.layout import PackedLayer, PackError, _check_block, _per_row, _rowptr, suggest_block
from patchc.ir import TILE_DENSE, TILE_SPARSE24, expand_tiles, tile_grid


def pack_skeleton(plan: Any, fqn: str | None = None, block: tuple[int, int] | None = None,
                  dtype: torch.dtype | None = None) -> PackedLayer:
    """`pack(plan, fqn, block)` without the weights: the same indices, weight buffers on the meta device,
    in `dtype` (default: the layer's).

    Refuses what `pack` refuses (a block that does not divide the tile, unknown kinds, an all-dense layer).

    Example:
        >>> skel = pack_skeleton(plan, "fc.weight", block=(64, 64))   # doctest: +SKIP
        >>> skel.n_dense, skel.n_sparse, skel.weight_bytes              # doctest: +SKIP
        (3, 5, 73728)
    """
    layer = plan.layers[fqn] if hasattr(plan, "layers") else plan
    name = getattr(layer, "name", fqn or "<layer>")
    where = f"layer {name!r}"
    n, k = (int(s) for s in layer.shape)
    b1, b2 = (int(s) for s in layer.tile)
    bn, bk = (b1, b2) if block is None else (int(block[0]), int(block[1]))
    _check_block((bn, bk), where)
    if b1 % bn or b2 % bk:
        raise PackError(f"{where}: block {(bn, bk)} does not divide the plan tile {(b1, b2)}; pick a block "
                        f"whose sides divide the tile (e.g. {suggest_block((b1, b2))})")
    kinds = layer.kinds.to(torch.uint8).cpu()
    if bool(((kinds != TILE_DENSE) & (kinds != TILE_SPARSE24)).any()):
        raise PackError(f"{where}: kinds must hold only TILE_DENSE (0) / TILE_SPARSE24 (1)")
    if bool((kinds == TILE_DENSE).all()):
        raise PackError(f"{where} is entirely dense: it gets no hybrid kernel (route it to F.linear)")
    grid = tile_grid((n, k), (bn, bk))
    # each block inherits its plan tile's kind; nonzero() walks row-major, which is pack's CSR order
    block_kinds = expand_tiles(kinds, (b1 // bn, b2 // bk), grid).contiguous()
    dense_at = torch.nonzero(block_kinds == TILE_DENSE)
    sparse_at = torch.nonzero(block_kinds == TILE_SPARSE24)
    dense_rowptr, sparse_rowptr = _rowptr(dense_at[:, 0], grid[0]), _rowptr(sparse_at[:, 0], grid[0])
    dtype = dtype or layer.dtype
    bias = getattr(layer, "bias", None)
    return PackedLayer(
        name=name,
        shape=(n, k),
        block=(bn, bk),
        dtype=dtype,
        kinds=block_kinds,
        dense=_shape_only((len(dense_at), bn, bk), dtype),
        values=_shape_only((len(sparse_at), bn, bk // 2), dtype),
        meta=_shape_only((len(sparse_at), bn, bk // 8), torch.uint8),
        dense_rowptr=dense_rowptr,
        dense_cols=dense_at[:, 1].to(torch.int32).contiguous(),
        sparse_rowptr=sparse_rowptr,
        sparse_cols=sparse_at[:, 1].to(torch.int32).contiguous(),
        bias=None if bias is None else _shape_only(tuple(bias.shape), dtype),
        per_row=(_per_row(dense_rowptr), _per_row(sparse_rowptr)),
    )


def _shape_only(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor with a shape and dtype but no storage (reading it raises: nothing here may read weights)."""
    return torch.empty(shape, dtype=dtype, device="meta")


__all__ = ["pack_skeleton"]
