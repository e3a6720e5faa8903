"""The tile-plan IR: which tiles of each weight stay dense, which are 2:4, and their packed buffers.

A `LayerPlan` describes one linear weight W of shape (N, K) = (out_features, in_features), cut into
b1 x b2 tiles (b1 rows along N, b2 columns along K). The grid is (Tn, Tk) = (ceil(N/b1), ceil(K/b2));
edge tiles are partial and stored zero padded to the full b1 x b2 ("padded grid"). Each tile is
TILE_DENSE (all its weights kept) or TILE_SPARSE24 (exactly 2 of every 4 consecutive weights along K
kept). A `TilePlan` maps weight FQNs to `LayerPlan`s, lists the layers it skipped (and why), and
carries free-form JSON metadata (config, schedule, ...).

Tile grid of a (40, 24) weight with tile (16, 16): grid 3 x 2, `kinds` row-major; `D` dense, `S` 2:4::

              K ->  cols 0..15   16..23 (+8 padding)
    N  rows  0..15  [   D    ]  [  S  :pad ]     dense  = tiles (0,0), (1,1), (2,0)      (row-major)
    |  rows 16..31  [   S    ]  [  D  :pad ]     sparse = tiles (0,1), (1,0), (2,1)
    v  rows 32..39  [   D    ]  [  S  :pad ]     dense_rowptr  = [0, 1, 2, 3], dense_cols  = [0, 1, 0]
          (+8 pad)  [  pad   ]  [ pad :pad ]     sparse_rowptr = [0, 1, 2, 3], sparse_cols = [1, 0, 1]

One tile row of a 2:4 tile with b2 = 8 (two groups of 4): group 0 keeps positions (1, 3), group 1
keeps (0, 1). The kept values go to `values` in increasing position order; each group's positions
become a nibble i0 | (i1 << 2); byte j of a tile row holds group 2j (low nibble) and 2j+1 (high)::

    W row        [ 0  a  0  b | c  d  0  0 ]
    values row   [ a  b  c  d ]                      (b2 / 2 values per tile row)
    nibbles      g0 = 1 | 3 << 2 = 0b1101 = 0xD      g1 = 0 | 1 << 2 = 0b0100 = 0x4
    meta row     [ 0x4D ]                            (ceil(b2 / 8) bytes; for b2 % 8 == 4 the last
                                                      byte's high nibble is 0)

The 6 candidate patterns, in this order everywhere (`PATTERNS`, index p <-> positions (i0, i1)):
1100 (0,1), 1010 (0,2), 1001 (0,3), 0110 (1,2), 0101 (1,3), 0011 (2,3).

Buffers (all tensors in row-major grid order; the i-th dense tile is the i-th `TILE_DENSE` entry of
`kinds.flatten()`, which is also the i-th tile in CSR order `dense_rowptr`/`dense_cols`):

    kinds  uint8 (Tn, Tk)              dense  dtype (n_dense, b1, b2)
    values dtype (n_sparse, b1, b2/2)  meta   uint8 (n_sparse, b1, ceil(b2/8))   bias dtype (N,) or None

Stored as one safetensors file: tensors "<fqn>::kinds|dense|values|meta|bias" and metadata
{"patchc": JSON header} (format "patchc.tileplan", version 1). Loading never unpickles anything.

Example:
    >>> import torch
    >>> w = torch.randn(40, 24)
    >>> kinds = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.uint8)
    >>> mask = torch.ones(40, 24, dtype=torch.bool)
    >>> mask[16:32, :16] = PATTERNS[1].repeat(16, 4)          # tile (1, 0): keep positions 0, 2
    >>> mask[:16, 16:] = mask[32:, 16:] = PATTERNS[0].repeat(1, 2)  # tiles (0, 1), (2, 1): keep 0, 1
    >>> layer = LayerPlan.from_mask("fc.weight", w, kinds, mask, tile=(16, 16))
    >>> torch.equal(layer.to_dense(), w * mask), layer.n_dense, layer.n_sparse
    (True, 3, 3)
    >>> plan = TilePlan(layers={"fc.weight": layer}, skipped={"head.weight": "excluded"})
    >>> plan.save("/tmp/fc.patch"); TilePlan.load("/tmp/fc.patch").density == plan.density
    True
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from patchc.files import atomic_path

TILE_DENSE = 0
TILE_SPARSE24 = 1
KIND_NAMES = {TILE_DENSE: "dense", TILE_SPARSE24: "2:4"}

# The 6 ways to keep 2 of 4, fixed order (shared with the masks, the kernels and the files).
PATTERNS = torch.tensor(
    [[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.bool
)
_POSITIONS = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]], dtype=torch.int64)


def _code_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Lookup tables over the 16 bit codes of a group (bit i = position i kept).

    exact[code]: pattern index of a code with exactly 2 bits, else -1.
    cover[code]: pattern that keeps every set bit of a code with at most 2 bits, filling with the
        lowest free positions (used to infer positions from already-pruned weights), else -1.
    """
    exact = torch.full((16,), -1, dtype=torch.int64)
    cover = torch.full((16,), -1, dtype=torch.int64)
    for p, (i0, i1) in enumerate(_POSITIONS.tolist()):
        exact[(1 << i0) | (1 << i1)] = p
    for code in range(16):
        kept = [i for i in range(4) if code >> i & 1]
        if len(kept) <= 2:
            free = [i for i in range(4) if i not in kept]
            pair = tuple(sorted(kept + free[: 2 - len(kept)]))
            cover[code] = _POSITIONS.tolist().index(list(pair))
    return exact, cover


_EXACT, _COVER = _code_tables()
_NIBBLES = (_POSITIONS[:, 0] | (_POSITIONS[:, 1] << 2)).to(torch.uint8)  # pattern index -> meta nibble

FORMAT = "patchc.tileplan"
VERSION = 1
_PARTS = ("kinds", "dense", "values", "meta")
_FLOAT_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


class PlanError(ValueError):
    """An invalid or inconsistent tile plan (the message names the layer, file, tile or group)."""


# ---------------------------------------------------------------------------------------------
# Pattern and metadata helpers (vectorised: no Python loops over elements)
# ---------------------------------------------------------------------------------------------


def group_codes(mask4: torch.Tensor) -> torch.Tensor:
    """Bit code (0..15) of each group of 4 in `mask4` (..., 4): bit i set iff position i is kept."""
    m = mask4.to(torch.uint8)  # uint8 shifts: ~40x faster than an int64 weighted sum on CPU
    return (m[..., 0] | (m[..., 1] << 1) | (m[..., 2] << 2) | (m[..., 3] << 3)).long()


def pattern_index(mask4: torch.Tensor) -> torch.Tensor:
    """Index into `PATTERNS` of each (..., 4) bool group; -1 where the group does not keep exactly 2.

    Example:
        >>> pattern_index(torch.tensor([[True, False, True, False], [True, True, True, False]]))
        tensor([ 1, -1])
    """
    if mask4.shape[-1:] != (4,):
        raise ValueError(f"pattern_index expects groups of 4 in the last dim, got shape {tuple(mask4.shape)}")
    return _EXACT.to(mask4.device)[group_codes(mask4)]


def pattern_to_positions(index: torch.Tensor) -> torch.Tensor:
    """Kept positions (..., 2) int64, i0 < i1, of pattern indices (...) in 0..5.

    Example:
        >>> pattern_to_positions(torch.tensor([0, 4]))
        tensor([[0, 1],
                [1, 3]])
    """
    if index.numel() and (int(index.min()) < 0 or int(index.max()) > 5):
        raise ValueError("pattern indices must lie in 0..5 (see PATTERNS)")
    return _POSITIONS.to(index.device)[index.long()]


def pack_meta(positions: torch.Tensor) -> torch.Tensor:
    """Pack kept positions (..., G, 2) (i0 < i1, in 0..3) into nibbles: uint8 (..., ceil(G / 2)).

    nibble(g) = i0 | (i1 << 2); byte j holds group 2j in its low and group 2j+1 in its high nibble;
    an odd G leaves the last high nibble 0.

    Example:
        >>> pack_meta(torch.tensor([[1, 3], [0, 1]]))
        tensor([77], dtype=torch.uint8)
    """
    if positions.shape[-1:] != (2,) or positions.dim() < 2:
        raise ValueError(f"pack_meta expects positions of shape (..., G, 2), got {tuple(positions.shape)}")
    pos = positions.to(torch.uint8)
    return pack_nibbles(pos[..., 0] | (pos[..., 1] << 2))


def pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """Nibbles (..., G) -> uint8 bytes (..., ceil(G / 2)), group 2j low, 2j+1 high (the IR and kernel format)."""
    nib = nib.to(torch.uint8)
    if nib.shape[-1] % 2:
        nib = F.pad(nib, (0, 1))
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous()


def unpack_nibbles(meta: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 (..., ceil(G / 2)) -> uint8 nibbles (..., G)."""
    both = torch.stack([meta & 0xF, meta >> 4], dim=-1).flatten(-2)
    return both[..., :groups].contiguous()


def unpack_meta(meta: torch.Tensor, b2: int) -> torch.Tensor:
    """Inverse of `pack_meta`: uint8 (..., ceil(b2 / 8)) -> positions (..., b2 // 4, 2) int64.

    Example:
        >>> unpack_meta(torch.tensor([0x4D], dtype=torch.uint8), 8)
        tensor([[1, 3],
                [0, 1]])
    """
    groups = b2 // 4
    if meta.shape[-1:] != (math.ceil(groups / 2),):
        raise ValueError(f"meta last dim {tuple(meta.shape)[-1:]} does not match b2={b2} (want ceil(b2/8))")
    nib = unpack_nibbles(meta, groups).to(torch.int64)
    return torch.stack([nib & 3, nib >> 2], dim=-1)


# ---------------------------------------------------------------------------------------------
# Tiling helpers
# ---------------------------------------------------------------------------------------------


def tile_grid(shape: tuple[int, int], tile: tuple[int, int]) -> tuple[int, int]:
    """Padded grid (Tn, Tk) = (ceil(N / b1), ceil(K / b2)), e.g. tile_grid((40, 24), (16, 16)) == (3, 2)."""
    return math.ceil(shape[0] / tile[0]), math.ceil(shape[1] / tile[1])


def tile_sizes(
    shape: tuple[int, int], tile: tuple[int, int], device: torch.device | str | None = None
) -> torch.Tensor:
    """Real (unpadded) elements per tile, int64 (Tn, Tk), e.g. tile_sizes((40, 24), (16, 16))[2, 1] == 8 * 8."""
    rows, cols = _extent(shape, tile, device)
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


def _extent(
    shape: tuple[int, int], tile: tuple[int, int], device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid rows per tile row (Tn,) and valid columns per tile column (Tk,) of the padded grid."""
    tn, tk = tile_grid(shape, tile)
    rows = (shape[0] - torch.arange(tn, device=device) * tile[0]).clamp(max=tile[0])
    cols = (shape[1] - torch.arange(tk, device=device) * tile[1]).clamp(max=tile[1])
    return rows, cols


def _valid_groups(shape: tuple[int, int], tile: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(Tn, Tk, b1, b2 // 4) bool: group lies inside (N, K) (K % 4 == 0 so a group is all in or out)."""
    rows, cols = _extent(shape, tile, device)
    b1, b2 = tile
    r_ok = torch.arange(b1, device=device)[None, :] < rows[:, None]  # (Tn, b1)
    g_ok = torch.arange(b2 // 4, device=device)[None, :] * 4 < cols[:, None]  # (Tk, G)
    return r_ok[:, None, :, None] & g_ok[None, :, None, :]


def _tile_pair(tile: Any, what: str) -> tuple[int, int]:
    if isinstance(tile, int):
        tile = (tile, tile)
    try:
        b1, b2 = (int(t) for t in tile)
    except (TypeError, ValueError):
        raise PlanError(f"{what}: tile must be a pair (b1, b2) of ints, got {tile!r}") from None
    return b1, b2


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# LayerPlan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """Tile plan of one weight (see the module docstring for the layout). Validated on creation.

    Example (w, kinds, mask as in the module docstring)::

        layer = LayerPlan.from_mask("fc.weight", w, kinds, mask, tile=(16, 16))
        layer.to_dense()                    # (N, K) W * M in layer.dtype
        layer.dense_rowptr, layer.dense_cols  # CSR over tile rows, int32
    """

    name: str
    shape: tuple[int, int]
    tile: tuple[int, int]
    kinds: torch.Tensor
    dense: torch.Tensor
    values: torch.Tensor
    meta: torch.Tensor
    bias: torch.Tensor | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"layer name must be a non-empty str (the weight FQN), got {self.name!r}")
        try:
            n, k = (int(s) for s in self.shape)
        except (TypeError, ValueError):
            raise PlanError(f"layer {self.name}: shape must be (N, K) ints, got {self.shape!r}") from None
        object.__setattr__(self, "shape", (n, k))
        object.__setattr__(self, "tile", _tile_pair(self.tile, f"layer {self.name}"))
        if self.dtype is None and isinstance(self.dense, torch.Tensor):
            object.__setattr__(self, "dtype", self.dense.dtype)
        self.verify()

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_mask(
        cls,
        name: str,
        weight: torch.Tensor,
        kinds: torch.Tensor,
        mask: torch.Tensor,
        bias: torch.Tensor | None = None,
        tile: tuple[int, int] = (128, 128),
    ) -> LayerPlan:
        """Pack W * M given tile kinds (Tn, Tk) and a hard mask (N, K).

        The mask must be all-true in dense tiles and keep exactly 2 of every 4 in sparse tiles;
        padding groups of partial edge tiles get positions (0, 1) and zero values.

        Example::

            LayerPlan.from_mask("fc.weight", w, kinds, mask, bias=b, tile=(16, 16)).density
        """
        b1, b2 = tile = _tile_pair(tile, f"layer {name}")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            raise PlanError(f"layer {name}: weight must be a 2-D float tensor, got {_describe(weight)}")
        shape = (n, k) = tuple(weight.shape)
        if b1 <= 0 or b2 <= 0 or b1 % 4 or b2 % 4:
            raise PlanError(f"layer {name}: tile {tile} must be positive multiples of 4")
        if k % 4:
            raise PlanError(f"layer {name}: K={k} is not a multiple of 4, so it has no 2:4 groups; skip this layer")
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape or mask.dtype != torch.bool:
            raise PlanError(f"layer {name}: mask must be a bool tensor of shape {shape}, got {_describe(mask)}")
        grid = tile_grid(shape, tile)
        if not isinstance(kinds, torch.Tensor) or tuple(kinds.shape) != grid:
            raise PlanError(
                f"layer {name}: kinds must have the grid shape {grid} for tile {tile}, got {_describe(kinds)}"
            )
        weight, dev = weight.detach(), weight.device
        kinds = kinds.to(dev)
        bad_kind = (kinds != TILE_DENSE) & (kinds != TILE_SPARSE24)
        if bad_kind.any():
            r, c = _first(bad_kind)
            raise PlanError(f"layer {name}: tile ({r}, {c}) has unknown kind code {int(kinds[r, c])} (0 dense, 1 2:4)")
        kinds = kinds.to(torch.uint8)
        is_dense = kinds == TILE_DENSE
        mask = mask.to(dev)

        mtiles = to_tiles(mask, tile, value=True)  # padding counts as kept for the dense check
        dense_ok = mtiles.flatten(2).all(-1)
        bad = is_dense & ~dense_ok
        if bad.any():
            r, c = _first(bad)
            i, j = _first(~mtiles[r, c])
            raise PlanError(
                f"layer {name}: tile ({r}, {c}) is dense but its mask drops weight ({r * b1 + i}, {c * b2 + j}); "
                "a dense tile keeps every weight"
            )

        flat_kinds = kinds.flatten()
        wtiles = to_tiles(weight, tile).reshape(-1, b1, b2)
        dense = wtiles[flat_kinds == TILE_DENSE].contiguous()

        sparse_sel = flat_kinds == TILE_SPARSE24
        groups = mtiles.reshape(-1, b1, b2 // 4, 4)[sparse_sel]  # (n_sparse, b1, G, 4)
        valid = _valid_groups(shape, tile, dev).reshape(-1, b1, b2 // 4)[sparse_sel]
        pidx = torch.where(valid, _EXACT.to(dev)[group_codes(groups)], 0)  # padding groups -> (0, 1)
        if (pidx < 0).any():
            t, i, g = _first(pidx < 0)
            r, c = _nth_tile(kinds, TILE_SPARSE24, t)
            kept = int(groups[t, i, g].sum())
            raise PlanError(
                f"layer {name}: tile ({r}, {c}) is 2:4 but group at row {r * b1 + i}, columns "
                f"{c * b2 + 4 * g}..{c * b2 + 4 * g + 3} keeps {kept} of 4; a 2:4 tile keeps exactly 2 per group"
            )
        positions = pattern_to_positions(pidx)  # (n_sparse, b1, G, 2)
        wgroups = wtiles[sparse_sel].reshape(-1, b1, b2 // 4, 4)
        values = torch.gather(wgroups, -1, positions).reshape(-1, b1, b2 // 2).contiguous()
        meta = pack_nibbles(_NIBBLES.to(dev)[pidx])
        if bias is not None:
            bias = bias.detach().to(device=dev, dtype=weight.dtype)
        return cls(
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

    # -- derived ---------------------------------------------------------------------------------

    @property
    def grid(self) -> tuple[int, int]:
        """(Tn, Tk) = (ceil(N / b1), ceil(K / b2))."""
        return tile_grid(self.shape, self.tile)

    @property
    def n_dense(self) -> int:
        """Number of dense tiles."""
        return int((self.kinds == TILE_DENSE).sum())

    @property
    def n_sparse(self) -> int:
        """Number of 2:4 tiles."""
        return int((self.kinds == TILE_SPARSE24).sum())

    @cached_property
    def _csr(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out = []
        for code in (TILE_DENSE, TILE_SPARSE24):
            hit = self.kinds == code
            rowptr = F.pad(hit.sum(1).cumsum(0), (1, 0)).to(torch.int32)
            cols = hit.nonzero()[:, 1].to(torch.int32)  # nonzero() is row-major: buffer order
            out += [rowptr, cols]
        return tuple(out)  # type: ignore[return-value]

    @property
    def dense_rowptr(self) -> torch.Tensor:
        """int32 (Tn + 1): dense tiles of tile row r are dense[dense_rowptr[r]:dense_rowptr[r + 1]]."""
        return self._csr[0]

    @property
    def dense_cols(self) -> torch.Tensor:
        """int32 (n_dense): tile column of each dense tile, in buffer order."""
        return self._csr[1]

    @property
    def sparse_rowptr(self) -> torch.Tensor:
        """int32 (Tn + 1): 2:4 tiles of tile row r are values/meta[sparse_rowptr[r]:sparse_rowptr[r + 1]]."""
        return self._csr[2]

    @property
    def sparse_cols(self) -> torch.Tensor:
        """int32 (n_sparse): tile column of each 2:4 tile, in buffer order."""
        return self._csr[3]

    @property
    def numel(self) -> int:
        """N * K (padding excluded)."""
        return self.shape[0] * self.shape[1]

    @property
    def n_kept(self) -> int:
        """Kept weights inside (N, K): all of the dense tiles, half of the 2:4 tiles."""
        sizes = tile_sizes(self.shape, self.tile, self.kinds.device)
        dense = int(sizes[self.kinds == TILE_DENSE].sum())
        sparse = int(sizes[self.kinds == TILE_SPARSE24].sum())
        return dense + sparse // 2

    @property
    def density(self) -> float:
        """Kept / N*K (padding excluded)."""
        return self.n_kept / self.numel

    def nbytes(self) -> int:
        """Actual bytes of the stored buffers (kinds, dense, values, meta, bias)."""
        bufs = [self.kinds, self.dense, self.values, self.meta] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in bufs)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored buffers by part name ("kinds", "dense", "values", "meta" and "bias" if any)."""
        out = {"kinds": self.kinds, "dense": self.dense, "values": self.values, "meta": self.meta}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def positions(self) -> torch.Tensor:
        """Kept positions of every 2:4 group: int64 (n_sparse, b1, b2 // 4, 2)."""
        return unpack_meta(self.meta, self.tile[1])

    def to_dense(self) -> torch.Tensor:
        """The pruned weight W * M, shape (N, K), in `dtype`."""
        b1, b2 = self.tile
        tn, tk = self.grid
        flat = self.kinds.flatten()
        out = torch.zeros(tn * tk, b1, b2, dtype=self.dtype, device=self.dense.device)
        out[flat == TILE_DENSE] = self.dense
        if self.n_sparse:
            groups = torch.zeros(self.n_sparse, b1, b2 // 4, 4, dtype=self.dtype, device=self.dense.device)
            groups.scatter_(-1, self.positions().to(groups.device), self.values.view(-1, b1, b2 // 4, 2))
            out[flat == TILE_SPARSE24] = groups.view(-1, b1, b2)
        return from_tiles(out.view(tn, tk, b1, b2), self.shape)

    def mask(self) -> torch.Tensor:
        """The hard mask M, (N, K) bool: true in dense tiles and at the kept 2:4 positions."""
        b1, b2 = self.tile
        tn, tk = self.grid
        flat = self.kinds.flatten()
        dev = self.kinds.device
        out = torch.ones(tn * tk, b1, b2, dtype=torch.bool, device=dev)
        if self.n_sparse:
            groups = torch.zeros(self.n_sparse, b1, b2 // 4, 4, dtype=torch.bool, device=dev)
            groups.scatter_(-1, self.positions().to(dev), True)
            out[flat == TILE_SPARSE24] = groups.view(-1, b1, b2)
        return from_tiles(out.view(tn, tk, b1, b2), self.shape)

    # -- validation ------------------------------------------------------------------------------

    def verify(self) -> None:
        """Raise `PlanError` (naming the layer, and the tile/group where relevant) if inconsistent."""
        name, (n, k), (b1, b2) = self.name, self.shape, self.tile
        where = f"layer {name}"
        if n <= 0 or k <= 0:
            raise PlanError(f"{where}: shape {self.shape} must be positive")
        if b1 <= 0 or b2 <= 0 or b1 % 4 or b2 % 4:
            raise PlanError(f"{where}: tile {self.tile} must be positive multiples of 4")
        if k % 4:
            raise PlanError(
                f"{where}: K={k} is not a multiple of 4 (no 2:4 groups); such layers are skipped, not planned"
            )
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise PlanError(f"{where}: dtype must be a float torch.dtype, got {self.dtype!r}")
        for part in _PARTS:
            if not isinstance(getattr(self, part), torch.Tensor):
                raise PlanError(f"{where}: {part} must be a tensor, got {type(getattr(self, part)).__name__}")
        grid = self.grid
        if self.kinds.dtype != torch.uint8 or tuple(self.kinds.shape) != grid:
            raise PlanError(
                f"{where}: kinds must be uint8 of the grid shape {grid} for shape {self.shape} and tile {self.tile}, "
                f"got {_describe(self.kinds)}"
            )
        bad_kind = (self.kinds != TILE_DENSE) & (self.kinds != TILE_SPARSE24)
        if bad_kind.any():
            r, c = _first(bad_kind)
            raise PlanError(f"{where}: tile ({r}, {c}) has unknown kind code {int(self.kinds[r, c])} (0 dense, 1 2:4)")
        devices = {t.device for t in (self.kinds, self.dense, self.values, self.meta)}
        if self.bias is not None and isinstance(self.bias, torch.Tensor):
            devices.add(self.bias.device)
        if len(devices) > 1:
            on = sorted(map(str, devices))
            raise PlanError(f"{where}: buffers live on different devices {on}; move them to one device")
        nd, ns = self.n_dense, self.n_sparse
        expect = {
            "dense": ((nd, b1, b2), self.dtype),
            "values": ((ns, b1, b2 // 2), self.dtype),
            "meta": ((ns, b1, math.ceil(b2 / 8)), torch.uint8),
        }
        for part, (want_shape, want_dtype) in expect.items():
            t = getattr(self, part)
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
                    f"{where}: {part} has shape {tuple(t.shape)}, expected {want_shape} for tile {self.tile}"
                )
        if self.bias is not None:
            if not isinstance(self.bias, torch.Tensor) or tuple(self.bias.shape) != (n,):
                raise PlanError(f"{where}: bias must have shape ({n},), got {_describe(self.bias)}")
            if self.bias.dtype != self.dtype:
                raise PlanError(f"{where}: bias has dtype {self.bias.dtype}, expected the layer dtype {self.dtype}")
        if ns:
            self._verify_meta()
        self._verify_padding()

    def _verify_meta(self) -> None:
        b1, b2 = self.tile
        if b2 % 8 == 4:
            hi = (self.meta[..., -1] >> 4) != 0
            if hi.any():
                t, i = _first(hi)
                r, c = _nth_tile(self.kinds, TILE_SPARSE24, t)
                raise PlanError(
                    f"layer {self.name}: tile ({r}, {c}) row {r * b1 + i}: unused high nibble of the last meta byte "
                    "is not 0 (b2 % 8 == 4)"
                )
        # uint8 nibble arithmetic (no int64 unpack) keeps this cheap on big layers
        nib = torch.stack([self.meta & 0xF, self.meta >> 4], dim=-1).flatten(-2)[..., : b2 // 4]
        bad = (nib & 3) >= (nib >> 2)
        if bad.any():
            t, i, g = _first(bad)
            pos = self.positions()
            r, c = _nth_tile(self.kinds, TILE_SPARSE24, t)
            i0, i1 = pos[t, i, g].tolist()
            raise PlanError(
                f"layer {self.name}: tile ({r}, {c}) group at row {r * b1 + i}, columns {c * b2 + 4 * g}.."
                f"{c * b2 + 4 * g + 3} has meta positions ({i0}, {i1}); need i0 < i1 in 0..3 "
                "(2 distinct kept positions per group; the meta buffer is corrupt)"
            )

    def _verify_padding(self) -> None:
        (n, k), (b1, b2) = self.shape, self.tile
        if n % b1 == 0 and k % b2 == 0:
            return
        rows, cols = _extent(self.shape, self.tile, self.kinds.device)
        for code, buf, width, unit in (
            (TILE_DENSE, self.dense, b2, 1),
            (TILE_SPARSE24, self.values, b2 // 2, 2),  # value j belongs to group j // 2, columns 4 * (j // 2)..
        ):
            rc = (self.kinds == code).nonzero()
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
                e, i, j = _first(bad)
                r, c = rc[edge][e].tolist()
                col = c * b2 + int(col_start[j])
                kind = "dense" if code == TILE_DENSE else "2:4"
                part = "" if code == TILE_DENSE else f" (a kept value of the group at columns {col}..{col + 3})"
                raise PlanError(
                    f"layer {self.name}: {kind} tile ({r}, {c}) has a nonzero in its padding at row {r * b1 + i}, "
                    f"column {col}{part}, outside the ({n}, {k}) extent; padding must be 0"
                )


# ---------------------------------------------------------------------------------------------
# TilePlan
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class TilePlan:
    """Tile plans of a model's weights, keyed by weight FQN, plus skipped layers and metadata.

    Example::

        plan = TilePlan.from_weights(model.state_dict(), tile=(16, 16))
        plan.save("model.patch"); plan = TilePlan.load("model.patch")
        print(plan.summary()); plan.apply(model)
    """

    layers: dict[str, LayerPlan] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = dict(self.layers)
        self.skipped = {str(k): str(v) for k, v in dict(self.skipped).items()}
        self.meta = dict(self.meta)
        self.verify(deep=False)

    # -- validation ------------------------------------------------------------------------------

    def verify(self, deep: bool = True) -> None:
        """Raise `PlanError` if any layer is inconsistent (`deep=False`: only the structure)."""
        for fqn, layer in self.layers.items():
            if not isinstance(layer, LayerPlan):
                raise PlanError(f"layer {fqn}: expected a LayerPlan, got {type(layer).__name__}")
            if layer.name != fqn:
                raise PlanError(
                    f"layer {fqn}: keyed as {fqn!r} but named {layer.name!r}; key layers by their weight FQN"
                )
            if "::" in fqn:
                raise PlanError(f"layer {fqn}: '::' is reserved as the tensor-name separator in plan files")
            if deep:
                layer.verify()
        both = sorted(set(self.layers) & set(self.skipped))
        if both:
            raise PlanError(f"layer {both[0]}: both planned and skipped; keep it in one of layers / skipped")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as e:
            raise PlanError(f"plan meta must be JSON-serialisable (it is saved in the file header): {e}") from None

    # -- measures --------------------------------------------------------------------------------

    @property
    def density(self) -> float:
        """Global kept / total over planned layers (parameter weighted); 1.0 for an empty plan."""
        total = sum(layer.numel for layer in self.layers.values())
        return sum(layer.n_kept for layer in self.layers.values()) / total if total else 1.0

    @property
    def sparsity(self) -> float:
        """1 - density."""
        return 1.0 - self.density

    def nbytes(self) -> int:
        """Actual bytes of all stored buffers (per layer: `plan.layers[fqn].nbytes()`)."""
        return sum(layer.nbytes() for layer in self.layers.values())

    def summary(self) -> str:
        """A table: per layer shape, tile, dense / 2:4 tiles, density, bytes; skipped layers; totals."""
        head = ("layer", "shape", "tile", "dense / 2:4 tiles", "density", "bytes")
        rows = [
            (
                fqn,
                f"{layer.shape[0]}x{layer.shape[1]}",
                f"{layer.tile[0]}x{layer.tile[1]}",
                f"{layer.n_dense} / {layer.n_sparse}",
                f"{layer.density:.4f}",
                f"{layer.nbytes():,}",
            )
            for fqn, layer in self.layers.items()
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        def fmt(row: tuple[str, ...]) -> str:  # layer names left aligned, numbers right aligned
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

        lines = [fmt(head), "  ".join("-" * w for w in widths), *map(fmt, rows)]
        if self.skipped:
            lines += ["", f"skipped ({len(self.skipped)}):"]
            lines += [f"  {fqn}: {why}" for fqn, why in self.skipped.items()]
        kept = sum(layer.n_kept for layer in self.layers.values())
        total = sum(layer.numel for layer in self.layers.values())
        lines += [
            "",
            f"global (parameter weighted over {len(self.layers)} planned layers): {kept:,} / {total:,} weights kept, "
            f"density {self.density:.4f}, sparsity {self.sparsity:.4f}; stored {self.nbytes():,} bytes",
        ]
        return "\n".join(lines)

    # -- apply -----------------------------------------------------------------------------------

    def apply(self, model: nn.Module) -> nn.Module:
        """Write each layer's W * M (and its bias, if the plan has one and the model a matching
        `<module>.bias`) into `model`'s parameters in place; returns `model`.

        Every target is checked before anything is written. Example: `plan.apply(copy.deepcopy(model))`.
        """
        writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        for fqn, layer in self.layers.items():
            try:
                param = model.get_parameter(fqn)
            except AttributeError as e:
                raise PlanError(f"layer {fqn}: the model has no parameter {fqn!r} ({e})") from None
            if tuple(param.shape) != layer.shape:
                raise PlanError(
                    f"layer {fqn}: the model's parameter has shape {tuple(param.shape)}, the plan {layer.shape}"
                )
            writes.append((param, layer.to_dense()))
            if layer.bias is not None:
                bias_name = fqn.rsplit(".", 1)[0] + ".bias" if "." in fqn else "bias"
                try:
                    bias = model.get_parameter(bias_name)
                except AttributeError:
                    bias = None
                if bias is not None and tuple(bias.shape) == tuple(layer.bias.shape):
                    writes.append((bias, layer.bias))
        with torch.no_grad():
            for param, value in writes:
                param.copy_(value.to(device=param.device, dtype=param.dtype))
        return model

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_weights(
        cls,
        state_dict: Mapping[str, torch.Tensor] | nn.Module,
        tile: tuple[int, int] | int = (128, 128),
        include: Callable[[str], bool] | None = None,
        meta: dict | None = None,
    ) -> TilePlan:
        """Infer a plan from already-pruned weights: a tile is 2:4 iff every group has <= 2 nonzeros.

        Only 2-D float tensors named `*.weight` with K % 4 == 0 (and `include(fqn)` true, if given)
        are planned; other `*.weight` entries go to `skipped` with the reason. Positions of a 2:4
        group cover its nonzeros, filled with the lowest free positions. `<module>.bias` is carried.

        Example::

            plan = TilePlan.from_weights(pruned.state_dict(), tile=(16, 16), include=lambda f: "embed" not in f)
        """
        sd = state_dict.state_dict() if isinstance(state_dict, nn.Module) else state_dict
        tile = _tile_pair(tile, "from_weights")
        layers: dict[str, LayerPlan] = {}
        skipped: dict[str, str] = {}
        for fqn, w in sd.items():
            if not (fqn == "weight" or fqn.endswith(".weight")):
                continue
            why = _why_skip(fqn, w, include)
            if why:
                skipped[fqn] = why
                continue
            w = w.detach()
            kinds, mask = _infer_from_weight(w, tile)
            layers[fqn] = LayerPlan.from_mask(fqn, w, kinds, mask, bias=_find_bias(sd, fqn, w), tile=tile)
        return cls(layers=layers, skipped=skipped, meta=dict(meta or {"source": "from_weights", "tile": list(tile)}))

    @classmethod
    def from_masks(
        cls,
        model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
        masks: Mapping[str, torch.Tensor],
        tile: tuple[int, int] | int = (128, 128),
        allow_lossy: bool = False,
        meta: dict | None = None,
    ) -> TilePlan:
        """Build a plan from hard masks (N, K) bool per weight FQN.

        A tile whose mask keeps exactly 2 of 4 in every group becomes 2:4, an all-true tile dense.
        Anything else (e.g. an unstructured mask) raises `PlanError` naming the layer and tile,
        unless `allow_lossy=True`, where such a tile becomes dense (keeping weights the mask drops).

        Example::

            masks = patchc.oneshot(model, method="wanda", pattern="2:4", calib=calib)
            plan = TilePlan.from_masks(model, masks, tile=(16, 16))
        """
        if isinstance(model_or_state_dict, nn.Module):
            params = dict(model_or_state_dict.named_parameters(remove_duplicate=False))
            sd = {**model_or_state_dict.state_dict(keep_vars=True), **params}
        else:
            sd = dict(model_or_state_dict)
        tile = b1, b2 = _tile_pair(tile, "from_masks")
        layers: dict[str, LayerPlan] = {}
        skipped: dict[str, str] = {}
        for fqn, mask in masks.items():
            if fqn not in sd:
                raise PlanError(f"layer {fqn}: a mask is given but the model has no weight {fqn!r}")
            w = sd[fqn].detach()
            why = _why_skip(fqn, w, None)
            if why:
                skipped[fqn] = why
                continue
            mask = torch.as_tensor(mask).to(w.device)
            if tuple(mask.shape) != tuple(w.shape):
                raise PlanError(
                    f"layer {fqn}: mask shape {tuple(mask.shape)} differs from the weight's {tuple(w.shape)}"
                )
            mask = mask.bool()
            shape = tuple(w.shape)
            mtiles = to_tiles(mask, tile, value=True)
            all_true = mtiles.flatten(2).all(-1)
            groups = mtiles.reshape(*mtiles.shape[:3], b2 // 4, 4)
            ok24 = _EXACT.to(w.device)[group_codes(groups)] >= 0
            ok24 = (ok24 | ~_valid_groups(shape, tile, w.device)).flatten(2).all(-1)
            bad = ~all_true & ~ok24
            if bad.any() and not allow_lossy:
                r, c = _first(bad)
                t = mask[r * b1 : (r + 1) * b1, c * b2 : (c + 1) * b2]
                raise PlanError(
                    f"layer {fqn}: tile ({r}, {c}) is neither all kept nor 2:4 (keeps {int(t.sum())} of {t.numel()}, "
                    "not exactly 2 in every group of 4); use a structured mask, "
                    "or allow_lossy=True to keep such tiles dense"
                )
            dense = all_true | bad
            kinds = torch.where(dense, TILE_DENSE, TILE_SPARSE24).to(torch.uint8)
            full = from_tiles(mtiles | dense[:, :, None, None], shape)
            layers[fqn] = LayerPlan.from_mask(fqn, w, kinds, full, bias=_find_bias(sd, fqn, w), tile=tile)
        base = {"source": "from_masks", "tile": list(tile), "allow_lossy": allow_lossy}
        return cls(layers=layers, skipped=skipped, meta=dict(meta or base))

    # -- files -----------------------------------------------------------------------------------

    def header(self) -> dict:
        """The JSON header stored in the file's metadata under "patchc"."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "layers": {
                fqn: {
                    "shape": list(layer.shape),
                    "tile": list(layer.tile),
                    "dtype": _dtype_name(layer.dtype),
                    "has_bias": layer.bias is not None,
                }
                for fqn, layer in self.layers.items()
            },
            "skipped": self.skipped,
            "meta": self.meta,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Verify, then write one safetensors file atomically (temp file in the same dir + os.replace).

        Example: `plan.save("model.patch")`.
        """
        from safetensors.torch import save_file

        self.verify()
        path = Path(path)
        tensors = {
            f"{fqn}::{part}": t.detach().cpu().contiguous()
            for fqn, layer in self.layers.items()
            for part, t in layer.tensors().items()
        }
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"patchc": json.dumps(self.header())})

    @classmethod
    def load(cls, path: str | os.PathLike) -> TilePlan:
        """Read and verify a plan written by `save` (safetensors only: nothing is ever unpickled).

        Example: `plan = TilePlan.load("model.patch")`.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such plan file")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {key: f.get_tensor(key) for key in f.keys()}
        except Exception as e:  # safetensors raises its own SafetensorError / OSError types
            raise PlanError(f"{path}: not a readable safetensors plan file ({type(e).__name__}: {e})") from None
        header = _parse_header(path, metadata)
        layers: dict[str, LayerPlan] = {}
        used: set[str] = set()
        for fqn, info in header["layers"].items():
            where = f"{path}: layer {fqn}"
            try:
                shape, tile = tuple(info["shape"]), tuple(info["tile"])
                dtype_name, has_bias = info["dtype"], bool(info["has_bias"])
            except (KeyError, TypeError):
                raise PlanError(f"{where}: header entry needs shape, tile, dtype and has_bias, got {info!r}") from None
            if dtype_name not in _FLOAT_DTYPES:
                raise PlanError(f"{where}: unsupported dtype {dtype_name!r} in header (one of {sorted(_FLOAT_DTYPES)})")
            parts = {}
            for part in _PARTS + (("bias",) if has_bias else ()):
                key = f"{fqn}::{part}"
                if key not in tensors:
                    raise PlanError(f"{where}: tensor {key!r} is missing from the file")
                parts[part] = tensors[key]
                used.add(key)
            try:
                layers[fqn] = LayerPlan(
                    name=fqn,
                    shape=shape,
                    tile=tile,
                    dtype=_FLOAT_DTYPES[dtype_name],
                    bias=parts.pop("bias", None),
                    **parts,
                )
            except PlanError as e:
                raise PlanError(f"{path}: {e}") from None
        extra = sorted(set(tensors) - used)
        if extra:
            raise PlanError(f"{path}: tensor {extra[0]!r} is not described by the header (corrupt or foreign file)")
        try:
            return cls(layers=layers, skipped=header["skipped"], meta=header["meta"])
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Internals
# ---------------------------------------------------------------------------------------------


def _parse_header(path: Path, metadata: dict[str, str]) -> dict:
    if "patchc" not in metadata:
        raise PlanError(f"{path}: safetensors file without a 'patchc' header; not a patchc plan")
    try:
        header = json.loads(metadata["patchc"])
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: the 'patchc' header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        fmt = header.get("format") if isinstance(header, dict) else None
        raise PlanError(f"{path}: header format is {fmt!r}, expected {FORMAT!r}")
    if header.get("version") != VERSION:
        raise PlanError(
            f"{path}: plan format version {header.get('version')!r} is not supported "
            f"(this patchc reads version {VERSION})"
        )
    for key, typ in (("layers", dict), ("skipped", dict), ("meta", dict)):
        if not isinstance(header.get(key), typ):
            raise PlanError(f"{path}: header field {key!r} must be a JSON object")
    return header


def _why_skip(fqn: str, w: Any, include: Callable[[str], bool] | None) -> str | None:
    if not isinstance(w, torch.Tensor):
        return f"not a tensor ({type(w).__name__})"
    if w.dim() != 2:
        return f"not 2-D (shape {tuple(w.shape)})"
    if not w.is_floating_point():
        return f"not a float tensor ({w.dtype})"
    if w.shape[1] % 4:
        return f"K={w.shape[1]} is not a multiple of 4 (no 2:4 groups)"
    if include is not None and not include(fqn):
        return "excluded by include()"
    return None


def _find_bias(sd: Mapping[str, Any], fqn: str, w: torch.Tensor) -> torch.Tensor | None:
    name = fqn[: -len("weight")] + "bias"
    b = sd.get(name)
    if isinstance(b, torch.Tensor) and tuple(b.shape) == (w.shape[0],) and b.is_floating_point():
        return b.detach().to(device=w.device, dtype=w.dtype)
    return None


def _infer_from_weight(w: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Kinds and a mask for already-pruned weights (see `TilePlan.from_weights`)."""
    b1, b2 = tile
    nz = to_tiles(w != 0, tile)  # padding is zero: never counts
    codes = group_codes(nz.reshape(*nz.shape[:3], b2 // 4, 4))  # (Tn, Tk, b1, G)
    pidx = _COVER.to(w.device)[codes]
    sparse = (pidx >= 0).flatten(2).all(-1)
    kinds = torch.where(sparse, TILE_SPARSE24, TILE_DENSE).to(torch.uint8)
    kept = PATTERNS.to(w.device)[pidx.clamp(min=0)].reshape(nz.shape)
    mask = from_tiles(kept | ~sparse[:, :, None, None], tuple(w.shape))
    return kinds, mask


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first true element (row-major) of a bool tensor with at least one true."""
    return tuple(int(i) for i in mask.nonzero()[0])


def _nth_tile(kinds: torch.Tensor, code: int, t: int) -> tuple[int, int]:
    """Grid (row, col) of the t-th tile of kind `code` in buffer (row-major) order."""
    r, c = (kinds == code).nonzero()[t].tolist()
    return r, c


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
