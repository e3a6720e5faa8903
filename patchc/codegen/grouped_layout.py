"""Kernel layout of fused MoE experts: every expert's packed slice stacked into one layer.

E experts of shape (N, K) on blocks (BN, BK) stack into one `PackedLayer` of shape (E * RB * BN, K),
RB = ceil(N / BN): expert e's block row r is the stacked layer's block row e * RB + r, so the stacked
CSR (rowptr, cols, dense / values / meta buffers) is the experts' own, one after another, with each
expert's rowptr shifted by the blocks before it. An expert without a plan (or planned all dense) is
stored as dense blocks of its weight: one launch serves every expert (`grouped_kernels`).

Example:
    >>> stacked = stack_experts([pack(plan, f"mlp.experts.down_proj.{e}", block=(16, 16)) for e in range(4)])
    ... # doctest: +SKIP
    >>> stacked.grid   # (4 * RB, CB)                                                        # doctest: +SKIP
"""

from __future__ import annotations

import torch

from patchc.codegen.layout import PackedLayer, PackError, _per_row, dense_from_buffers
from patchc.ir import TILE_DENSE, tile_grid


def pack_dense(weight: torch.Tensor, block: tuple[int, int], name: str = "<dense>") -> PackedLayer:
    """An (N, K) weight as all-dense blocks of the kernel layout (edge blocks zero padded).

    Example:
        >>> pack_dense(torch.ones(20, 16), (16, 16)).n_dense
        2
    """
    if weight.dim() != 2:
        raise PackError(f"layer {name!r}: pack_dense needs an (N, K) weight, got shape {tuple(weight.shape)}")
    (n, k), (bn, bk) = weight.shape, block
    rb, cb = tile_grid((n, k), block)
    blocks = _dense_blocks(weight.detach()[None], block)
    counts = torch.arange(rb + 1, dtype=torch.int32) * cb
    return PackedLayer(
        name=name, shape=(n, k), block=block, dtype=weight.dtype,
        kinds=torch.full((rb, cb), TILE_DENSE, dtype=torch.uint8),
        dense=blocks.cpu(), values=weight.new_zeros(0, bn, bk // 2).cpu(), meta=torch.zeros(0, bn, bk // 8, dtype=torch.uint8),
        dense_rowptr=counts, dense_cols=torch.arange(cb, dtype=torch.int32).repeat(rb),
        sparse_rowptr=torch.zeros(rb + 1, dtype=torch.int32), sparse_cols=torch.zeros(0, dtype=torch.int32),
    )


def stack_experts(experts: list[PackedLayer], name: str | None = None) -> PackedLayer:
    """One `PackedLayer` of E * RB block rows from E packed slices of one shape, block and dtype.

    Example:
        >>> a = pack_dense(torch.ones(16, 32), (16, 16)); stack_experts([a, a]).shape
        (32, 32)
    """
    if not experts:
        raise PackError("stack_experts needs at least one expert")
    first = experts[0]
    name = name or first.name
    for e, p in enumerate(experts):
        if (p.shape, p.block, p.dtype) != (first.shape, first.block, first.dtype):
            raise PackError(f"{name}: expert {e} is {p.shape} on block {p.block} in {p.dtype}, expert 0 "
                            f"{first.shape} on {first.block} in {first.dtype}; experts must share all three")
    rb, cb = first.grid
    bn = first.block[0]
    dense_rowptr = _stack_rowptr([p.dense_rowptr for p in experts])
    sparse_rowptr = _stack_rowptr([p.sparse_rowptr for p in experts])
    return PackedLayer(
        name=name, shape=(len(experts) * rb * bn, first.shape[1]), block=first.block, dtype=first.dtype,
        kinds=torch.cat([p.kinds for p in experts]),
        dense=torch.cat([p.dense for p in experts]), values=torch.cat([p.values for p in experts]),
        meta=torch.cat([p.meta for p in experts]),
        dense_rowptr=dense_rowptr, dense_cols=torch.cat([p.dense_cols for p in experts]),
        sparse_rowptr=sparse_rowptr, sparse_cols=torch.cat([p.sparse_cols for p in experts]),
        per_row=(_per_row(dense_rowptr), _per_row(sparse_rowptr)),
    )


def _stack_rowptr(rowptrs: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate CSR row pointers: each expert's rows shifted by the blocks of the experts before it."""
    parts, base = [torch.zeros(1, dtype=torch.int64)], 0
    for ptr in rowptrs:
        parts.append(ptr[1:].to(torch.int64) + base)
        base += int(ptr[-1])
    out = torch.cat(parts)
    if base >= 2**31:
        raise PackError(f"stacked experts hold {base} blocks, more than an int32 block index addresses")
    return out.to(torch.int32)


def stack_transposed(w: torch.Tensor, block: tuple[int, int], name: str = "<transposed experts>") -> PackedLayer:
    """Every expert's transpose W_e^T (K, N), of w (E, N, K), as all-dense blocks of one stacked layout: what
    `stack_experts([pack_dense(w[e].t(), block) for e in range(E)])` gives, built on w's device by copies
    alone (no value read on the host). The grouped kernels then multiply rows by W_e, as the fused experts'
    backward to x needs.

    Example:
        >>> stack_transposed(torch.ones(2, 20, 16), (16, 16)).shape   # 2 experts x 1 block row, 20 columns
        (32, 20)
    """
    if w.dim() != 3:
        raise PackError(f"{name}: stack_transposed needs (E, N, K) weights, got shape {tuple(w.shape)}")
    out = transposed_layout(w.shape[0], tuple(w.shape[1:]), block, w.dtype, w.device, name)
    fill_transposed(out, w, 0)
    return out


def transposed_layout(num_experts: int, shape: tuple[int, int], block: tuple[int, int], dtype: torch.dtype,
                      device: torch.device, name: str = "<transposed experts>") -> PackedLayer:
    """The all-dense stacked layout of E experts' (K, N) transposes of (N, K) weights, its blocks zeros:
    `fill_transposed` writes them, a few experts at a time if need be.

    Example:
        >>> transposed_layout(2, (20, 16), (16, 16), torch.float32, torch.device("cpu")).dense.shape
        torch.Size([4, 16, 16])
    """
    (n, k), (bn, bk) = shape, block
    rb, cb = tile_grid((k, n), block)
    ints = dict(dtype=torch.int32, device=device)
    return PackedLayer(
        name=name, shape=(num_experts * rb * bn, n), block=block, dtype=dtype,
        kinds=torch.full((num_experts * rb, cb), TILE_DENSE, dtype=torch.uint8, device=device),
        dense=torch.zeros(num_experts * rb * cb, bn, bk, dtype=dtype, device=device),
        values=torch.zeros(0, bn, bk // 2, dtype=dtype, device=device),
        meta=torch.zeros(0, bn, bk // 8, dtype=torch.uint8, device=device),
        dense_rowptr=torch.arange(num_experts * rb + 1, **ints) * cb,
        dense_cols=torch.arange(cb, **ints).repeat(num_experts * rb),
        sparse_rowptr=torch.zeros(num_experts * rb + 1, **ints), sparse_cols=torch.zeros(0, **ints), per_row=(cb, 0),
    )


def fill_transposed(layout: PackedLayer, w: torch.Tensor, first: int) -> None:
    """Write experts first .. first + len(w) - 1 of a `transposed_layout`: their W_e^T blocks, of w (E', N, K)."""
    rb, cb = tile_grid((w.shape[2], w.shape[1]), layout.block)
    blocks = layout.dense[first * rb * cb : (first + w.shape[0]) * rb * cb]
    _dense_blocks(w.transpose(1, 2), layout.block, out=blocks)


def _dense_blocks(w: torch.Tensor, block: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
    """(E, R, C) weights as the kernel layout's dense blocks, (E * RB * CB, BN, BK) on w's device: each
    weight's block rows in turn, a row's blocks in column order, the edge blocks zero padded. Written into
    `out` (zeros, or new) by strided copies of w's views, so nothing but `out` is allocated (a padded copy
    and its permuted copy held the weights three times over)."""
    e, r, c = w.shape
    bn, bk = block
    rb, cb = tile_grid((r, c), block)
    out = w.new_zeros(e * rb * cb, bn, bk) if out is None else out
    dst = out.view(e, rb, cb, bn, bk).permute(0, 1, 3, 2, 4)  # (E, RB, BN, CB, BK): rows and columns of w
    fr, fc, tr, tc = r // bn, c // bk, r % bn, c % bk  # full block rows / columns, then the tails
    if fr and fc:
        dst[:, :fr, :, :fc].copy_(w[:, : fr * bn, : fc * bk].unflatten(1, (fr, bn)).unflatten(3, (fc, bk)))
    if fr and tc:
        dst[:, :fr, :, fc, :tc].copy_(w[:, : fr * bn, fc * bk :].unflatten(1, (fr, bn)))
    if tr and fc:
        dst[:, fr, :tr, :fc].copy_(w[:, fr * bn :, : fc * bk].unflatten(2, (fc, bk)))
    if tr and tc:
        dst[:, fr, :tr, fc, :tc].copy_(w[:, fr * bn :, fc * bk :])
    return out


def experts_from_buffers(buffers: tuple[torch.Tensor, ...], num_experts: int, shape: tuple[int, int],
                         block: tuple[int, int]) -> torch.Tensor:
    """(E, N, K) W_hat of every expert from the stacked buffers (reads index tensors: a reference path)."""
    n, k = shape
    rows = tile_grid(shape, block)[0] * block[0]
    stacked = dense_from_buffers(buffers, (num_experts * rows, k), block)
    return stacked.reshape(num_experts, rows, k)[:, :n]


__all__ = ["experts_from_buffers", "fill_transposed", "pack_dense", "stack_experts", "stack_transposed",
           "transposed_layout"]
