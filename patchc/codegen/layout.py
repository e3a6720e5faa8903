"""Kernel-ready packed layout of one hybrid dense / 2:4 layer.

A layer W (N, K) of a `TilePlan` is cut into blocks of BLOCK_N x BLOCK_K (BN x BK), the kernel's tile.
The plan's tile (b1, b2) must be a multiple of the block, so every block lies inside one plan tile and
inherits its kind ("re-tiling"). Blocks are numbered on the padded grid RB x CB = ceil(N/BN) x ceil(K/BK);
edge blocks are stored zero padded to the full block, so the kernels load weights without masks.

Picture for a 3 x 4 block grid (D = dense block, S = 2:4 block)::

        col  0   1   2   3            dense   = [D00 D03 D11 D12 D13 D20]      (n_dense, BN, BK)
    row 0   D   S   S   D              values  = [S01 S02 S10 S21 S22 S23]      (n_sparse, BN, BK/2)
    row 1   S   D   D   D              meta    = [m01 m02 m10 m21 m22 m23]      (n_sparse, BN, BK/8) uint8
    row 2   D   S   S   S
                                       dense_rowptr = [0, 2, 5, 6]   dense_cols  = [0, 3, 1, 2, 3, 0]
                                       sparse_rowptr = [0, 2, 3, 6]  sparse_cols = [1, 2, 0, 1, 2, 3]

* Each kind is one contiguous, tile-major buffer in row-major grid order (CSR order): the i-th dense block
  of the CSR walk is ``dense[i]``, the i-th 2:4 block is ``values[i]`` / ``meta[i]``. A kernel walking
  row-block r reads ``[rowptr[r], rowptr[r+1])`` of each kind in two plain loops; the block index *is* the
  buffer offset, only its column (to address x) comes from ``*_cols``.
* Inside a block, rows are contiguous: dense ``[n, k]`` at ``n*BK + k``; 2:4 values ``[n, j]`` at
  ``n*BK/2 + j`` (per group of 4 weights the two kept values, lower position first); metadata
  ``[n, b]`` at ``n*BK/8 + b`` where byte b holds group 2b in its low nibble and group 2b+1 in its high
  nibble, nibble = i0 | (i1 << 2) with i0 < i1 the kept positions (the IR's exact packing).
* Block sides are powers of two >= 16 (``tl.arange`` and ``tl.dot`` need it), so every block of every
  buffer is a multiple of 16 bytes: dense BN*BK*2, values BN*BK, meta BN*BK/8 bytes (fp16), and with the
  buffers' own 16-byte aligned base every block starts 16-byte aligned (``ld.global.v4`` is legal).
* Bytes per weight element in fp16/bf16: dense 2, 2:4 1 + 0.125.

Example:
    >>> packed = pack(plan, "layers.0.feed_forward.w1.weight", block=(64, 64))   # doctest: +SKIP
    >>> packed.n_dense, packed.n_sparse, packed.dense_per_row                     # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from patchc.ir import (
    TILE_DENSE,
    TILE_SPARSE24,
    expand_tiles,
    from_tiles,
    pack_nibbles,
    tile_grid,
    unpack_nibbles,
)

_MIN_BLOCK = 16
_ALIGN = 16  # bytes: one 128-bit vector load


class PackError(ValueError):
    """A layer cannot be packed for the kernels (wrong block, all dense, inconsistent plan)."""


@dataclass(frozen=True, eq=False)
class PackedLayer:
    """One layer's weights in the kernel layout (see the module docstring for the picture).

    Example:
        >>> packed = pack(plan, fqn)                         # doctest: +SKIP
        >>> y = tile_linear(x, packed.to("cuda"))            # doctest: +SKIP
    """

    name: str
    shape: tuple[int, int]
    block: tuple[int, int]
    dtype: torch.dtype
    kinds: torch.Tensor  # (RB, CB) uint8 block kinds
    dense: torch.Tensor  # (n_dense, BN, BK)
    values: torch.Tensor  # (n_sparse, BN, BK // 2)
    meta: torch.Tensor  # (n_sparse, BN, BK // 8) uint8
    dense_rowptr: torch.Tensor  # (RB + 1,) int32
    dense_cols: torch.Tensor  # (n_dense,) int32
    sparse_rowptr: torch.Tensor  # (RB + 1,) int32
    sparse_cols: torch.Tensor  # (n_sparse,) int32
    bias: torch.Tensor | None = None
    # (dense, 2:4) blocks per block row, -1 where rows differ: plain ints fixed at pack time, so launches
    # never read the rowptr tensors back from the GPU. None = count them from the rowptrs here.
    per_row: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        bn, bk = self.block
        rb, cb = self.grid
        where = f"packed layer {self.name!r}"
        _check_block(self.block, where)
        if self.per_row is None:
            object.__setattr__(self, "per_row", (_per_row(self.dense_rowptr), _per_row(self.sparse_rowptr)))
        elif len(self.per_row) != 2 or not all(isinstance(c, int) and c >= -1 for c in self.per_row):
            raise PackError(f"{where}: per_row must be two ints >= -1 (blocks per row, -1 = varies), "
                            f"got {self.per_row!r}; rebuild it with pack()")
        expect = {
            "kinds": (rb, cb),
            "dense": (self.n_dense, bn, bk),
            "values": (self.n_sparse, bn, bk // 2),
            "meta": (self.n_sparse, bn, bk // 8),
            "dense_rowptr": (rb + 1,),
            "sparse_rowptr": (rb + 1,),
            "dense_cols": (self.n_dense,),
            "sparse_cols": (self.n_sparse,),
        }
        for attr, shape in expect.items():
            got = tuple(getattr(self, attr).shape)
            if got != shape:
                raise PackError(f"{where}: {attr} has shape {got}, expected {shape}; rebuild it with pack()")
        if self.dense.dtype != self.dtype or self.values.dtype != self.dtype:
            raise PackError(f"{where}: dense/values dtype {self.dense.dtype}/{self.values.dtype} != {self.dtype}")
        if self.meta.dtype != torch.uint8:
            raise PackError(f"{where}: meta must be uint8, got {self.meta.dtype}")
        if self.bias is not None and tuple(self.bias.shape) != (self.shape[0],):
            raise PackError(f"{where}: bias has shape {tuple(self.bias.shape)}, expected ({self.shape[0]},)")

    # --- derived sizes -------------------------------------------------------------------------------
    @property
    def grid(self) -> tuple[int, int]:
        """(RB, CB): block rows and block columns."""
        return tile_grid(self.shape, self.block)

    @property
    def n_dense(self) -> int:
        return int(self.dense_cols.shape[0])

    @property
    def n_sparse(self) -> int:
        return int(self.sparse_cols.shape[0])

    @property
    def dense_per_row(self) -> int | None:
        """Dense blocks per block row when every row has the same count (a kernel constexpr), else None."""
        return None if self.per_row[0] < 0 else self.per_row[0]

    @property
    def sparse_per_row(self) -> int | None:
        return None if self.per_row[1] < 0 else self.per_row[1]

    @property
    def all_sparse(self) -> bool:
        return self.n_dense == 0

    @property
    def all_dense(self) -> bool:
        return self.n_sparse == 0

    @property
    def weight_bytes(self) -> int:
        """Bytes the kernels read for the weights (dense + values + meta, padding included)."""
        return sum(t.numel() * t.element_size() for t in (self.dense, self.values, self.meta))

    @property
    def dense_bytes(self) -> int:
        """Bytes of the unpruned dense weight (what F.linear reads)."""
        return self.shape[0] * self.shape[1] * torch.empty((), dtype=self.dtype).element_size()

    @property
    def device(self) -> torch.device:
        return self.dense.device

    def to(self, device: Any) -> PackedLayer:
        """A copy with every buffer on `device` (the layout is device independent; `per_row` is kept)."""
        moved = {f: getattr(self, f).to(device) for f in _TENSOR_FIELDS}
        bias = None if self.bias is None else self.bias.to(device)
        return replace(self, bias=bias, **moved)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers by name (for saving or inspection)."""
        out = {f: getattr(self, f) for f in _TENSOR_FIELDS}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


_TENSOR_FIELDS = (
    "kinds", "dense", "values", "meta", "dense_rowptr", "dense_cols", "sparse_rowptr", "sparse_cols",
)


def pack(
    plan: Any,
    fqn: str | None = None,
    block: tuple[int, int] | None = None,
    *,
    allow_all_dense: bool = False,
) -> PackedLayer:
    """Pack one layer of a TilePlan (or a LayerPlan) into the kernel layout.

    `block` (BLOCK_N, BLOCK_K) defaults to the plan's tile and must divide it; both sides must be powers
    of two >= 16. An all-dense layer is refused (it belongs to F.linear / cuBLAS) unless
    `allow_all_dense` (tests of the dense loop use it).

    Example:
        >>> packed = pack(plan, "layers.0.attention.wq.weight", block=(64, 64))  # doctest: +SKIP
    """
    layer = _resolve_layer(plan, fqn)
    name = getattr(layer, "name", fqn or "<layer>")
    n, k = (int(s) for s in layer.shape)
    b1, b2 = (int(s) for s in layer.tile)
    block = (b1, b2) if block is None else (int(block[0]), int(block[1]))
    where = f"layer {name!r}"
    _check_block(block, where)
    bn, bk = block
    if b1 % bn or b2 % bk:
        raise PackError(
            f"{where}: block {block} does not divide the plan tile {(b1, b2)}; pick a block whose sides "
            f"divide the tile (e.g. {suggest_block((b1, b2))}) or harden with a tile that is a multiple of it"
        )
    kinds = layer.kinds.to(torch.uint8).cpu()
    tn, tk = tile_grid((n, k), (b1, b2))
    if tuple(kinds.shape) != (tn, tk):
        raise PackError(f"{where}: kinds has shape {tuple(kinds.shape)}, expected {(tn, tk)} for shape {(n, k)}")
    is_dense = kinds == TILE_DENSE
    if not bool(is_dense.any() | (kinds == TILE_SPARSE24).any()) or bool(((kinds != 0) & (kinds != 1)).any()):
        raise PackError(f"{where}: kinds must hold only TILE_DENSE (0) / TILE_SPARSE24 (1)")
    if bool(is_dense.all()) and not allow_all_dense:
        raise PackError(
            f"{where} is entirely dense: it gains nothing from the hybrid kernels; use "
            f"torch.nn.functional.linear (cuBLAS) for it (the runtime routes all-dense layers there)"
        )
    _check_counts(layer, int(is_dense.sum()), int((~is_dense).sum()), (b1, b2), where)

    rb_per, cb_per = b1 // bn, b2 // bk
    grid = tile_grid((n, k), block)
    block_kinds = expand_tiles(kinds, (rb_per, cb_per), grid)  # each block inherits its plan tile's kind
    dense_tiles = torch.nonzero(is_dense)  # row-major grid order == plan.dense order
    sparse_tiles = torch.nonzero(~is_dense)
    dense, d_rows, d_cols = _retile(layer.dense.cpu(), dense_tiles, (rb_per, cb_per), (bn, bk), grid)
    values, s_rows, s_cols = _retile(layer.values.cpu(), sparse_tiles, (rb_per, cb_per), (bn, bk // 2), grid)
    nibbles = unpack_nibbles(layer.meta.cpu(), b2 // 4)
    nibbles, _, _ = _retile(nibbles, sparse_tiles, (rb_per, cb_per), (bn, bk // 4), grid)
    bias = getattr(layer, "bias", None)
    dense_rowptr, sparse_rowptr = _rowptr(d_rows, grid[0]), _rowptr(s_rows, grid[0])
    return PackedLayer(
        name=name,
        shape=(n, k),
        block=block,
        dtype=layer.dtype,
        kinds=block_kinds.contiguous(),
        dense=dense.to(layer.dtype),
        values=values.to(layer.dtype),
        meta=pack_nibbles(nibbles),
        dense_rowptr=dense_rowptr,
        dense_cols=d_cols.to(torch.int32).contiguous(),
        sparse_rowptr=sparse_rowptr,
        sparse_cols=s_cols.to(torch.int32).contiguous(),
        bias=None if bias is None else bias.detach().cpu().contiguous(),
        per_row=(_per_row(dense_rowptr), _per_row(sparse_rowptr)),  # counted once, on the CPU copy
    )


# The seven tensors the kernels read, in kernel-argument order (the runtime's buffer names).
BUFFER_NAMES = ("dense", "values", "meta", "dense_rowptr", "dense_cols", "sparse_rowptr", "sparse_cols")


def kernel_buffers(packed: PackedLayer) -> tuple[torch.Tensor, ...]:
    """The seven tensors the kernels read, in kernel-argument order (`BUFFER_NAMES`)."""
    return (packed.dense, packed.values, packed.meta, packed.dense_rowptr, packed.dense_cols,
            packed.sparse_rowptr, packed.sparse_cols)


def per_row_counts(packed: PackedLayer) -> tuple[int, int]:
    """(dense, 2:4) blocks per block row when uniform, -1 where they vary: kernel constexprs.

    The ints stored at pack time: no tensor is read (no host sync when the layer is on the GPU).

    Example:
        >>> per_row_counts(pack(plan, "fc.weight"))   # doctest: +SKIP
        (1, 2)
    """
    return packed.per_row


def dense_from_buffers(
    buffers: tuple[torch.Tensor, ...],
    shape: tuple[int, int],
    block: tuple[int, int],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W*M (N, K) rebuilt from the seven kernel buffers (reads index tensors: a reference path)."""
    dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols = buffers
    bn, bk = block
    rb, cb = tile_grid(shape, block)
    dtype = dtype or values.dtype
    grid = torch.zeros(rb, cb, bn, bk, dtype=dtype, device=values.device)
    if dense_cols.numel():
        grid[_rows_of(dense_rowptr), dense_cols.long()] = dense.to(dtype)
    n_sparse = sparse_cols.numel()
    if n_sparse:
        nib = unpack_nibbles(meta, bk // 4).long()  # (ns, BN, BK/4)
        vals = values.to(dtype).reshape(n_sparse, bn, bk // 4, 2)
        groups = torch.zeros(n_sparse, bn, bk // 4, 4, dtype=dtype, device=values.device)
        groups.scatter_(-1, (nib & 3)[..., None], vals[..., :1])
        groups.scatter_(-1, (nib >> 2)[..., None], vals[..., 1:])
        grid[_rows_of(sparse_rowptr), sparse_cols.long()] = groups.reshape(-1, bn, bk)
    return from_tiles(grid, shape)


def packed_to_dense(packed: PackedLayer, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuild W*M (N, K) from the packed buffers (the inverse of pack; used by the reference and tests)."""
    return dense_from_buffers(kernel_buffers(packed), packed.shape, packed.block, dtype or packed.dtype)


# --- helpers -----------------------------------------------------------------------------------------
def _resolve_layer(plan: Any, fqn: str | None) -> Any:
    layers = getattr(plan, "layers", None)
    if layers is None:  # a LayerPlan itself
        return plan
    if fqn is None:
        raise PackError(f"pack(plan, fqn): name the layer to pack; planned layers: {sorted(layers)[:8]}")
    if fqn not in layers:
        skipped = getattr(plan, "skipped", {}) or {}
        if fqn in skipped:
            raise PackError(f"layer {fqn!r} is not in the plan (skipped: {skipped[fqn]}); run it with F.linear")
        raise PackError(f"layer {fqn!r} is not in the plan; planned layers include {sorted(layers)[:8]}")
    return layers[fqn]


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _check_block(block: tuple[int, int], where: str) -> None:
    if len(block) != 2 or not all(_is_pow2(int(b)) and int(b) >= _MIN_BLOCK for b in block):
        raise PackError(
            f"{where}: block {tuple(block)} must be two powers of two >= {_MIN_BLOCK} "
            f"(tl.arange and tl.dot need them)"
        )


def suggest_block(tile: tuple[int, int]) -> tuple[int, int] | str:
    """The kernel block a tile takes (each side's largest power-of-two divisor, up to 128), or why none fits."""
    sides = []
    for t in tile:
        b = t & -t  # largest power of two dividing t
        if b < _MIN_BLOCK:
            return f"none: tile side {t} has no power-of-two divisor >= {_MIN_BLOCK}"
        sides.append(min(b, 128))
    return tuple(sides)


def _check_counts(layer: Any, nd: int, ns: int, tile: tuple[int, int], where: str) -> None:
    b1, b2 = tile
    expect = {
        "dense": (nd, b1, b2),
        "values": (ns, b1, b2 // 2),
        "meta": (ns, b1, math.ceil(b2 / 8)),
    }
    for attr, shape in expect.items():
        got = tuple(getattr(layer, attr).shape)
        if got != shape:
            raise PackError(f"{where}: plan.{attr} has shape {got}, expected {shape}; run plan.verify()")


def _retile(
    tiles: torch.Tensor,
    tile_idx: torch.Tensor,
    per_tile: tuple[int, int],
    sub: tuple[int, int],
    grid: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut (count, b1, w) plan tiles into (sub0, sub1) blocks; return blocks in CSR order + rows + cols."""
    rp, cp = per_tile
    count = tiles.shape[0]
    blocks = tiles.reshape(count, rp, sub[0], cp, sub[1]).permute(0, 1, 3, 2, 4).reshape(-1, *sub)
    a = torch.arange(rp).view(1, rp, 1)
    c = torch.arange(cp).view(1, 1, cp)
    rows = (tile_idx[:, 0].view(-1, 1, 1) * rp + a).expand(count, rp, cp).reshape(-1)
    cols = (tile_idx[:, 1].view(-1, 1, 1) * cp + c).expand(count, rp, cp).reshape(-1)
    keep = (rows < grid[0]) & (cols < grid[1])  # blocks entirely inside the plan tile's padding
    rows, cols, blocks = rows[keep], cols[keep], blocks[keep]
    order = torch.argsort(rows * grid[1] + cols, stable=True)
    return blocks[order].contiguous(), rows[order], cols[order]


def _rowptr(rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    counts = torch.bincount(rows, minlength=n_rows)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)


def _rows_of(rowptr: torch.Tensor) -> torch.Tensor:
    counts = rowptr.long().diff()
    return torch.repeat_interleave(torch.arange(counts.numel(), device=rowptr.device), counts)


def _per_row(rowptr: torch.Tensor) -> int:
    """Blocks per row when every row has the same count, else -1 (reads the tensor: pack time only)."""
    counts = rowptr.long().diff()
    if counts.numel() == 0:
        return 0
    first = int(counts[0])
    return first if bool((counts == first).all()) else -1
