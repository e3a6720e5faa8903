"""`LayerPlan`: the tile plan of one linear weight, as frozen, validated buffers.

What a layer holds (layout drawn in the `patchc.ir` docstring): the tile kinds, the dense tiles, the
kept 2:4 values with their nibble metadata, the bias and the dtype; and what follows from them (CSR
index lists per tile row for the kernels, densities, W * M and M). Construction is `compress.py`'s,
validation `verify.py`'s: this class only ties them to the data.

Example:
    >>> layer = LayerPlan.from_mask("fc.weight", w, kinds, mask, tile=(16, 16))
    >>> layer.n_dense, layer.n_sparse, round(layer.density, 3)
    (3, 3, 0.767)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from patchc.ir.compress import compress
from patchc.ir.errors import PlanError
from patchc.ir.layer_slot import LayerSlot
from patchc.ir.patterns import unpack_meta
from patchc.ir.tiles import TILE_DENSE, TILE_SPARSE24, from_tiles, tile_grid, tile_pair, tile_sizes
from patchc.ir.verify import verify_layer


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """Tile plan of one weight (layout: the `patchc.ir` docstring). Validated on creation.

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
        object.__setattr__(self, "tile", tile_pair(self.tile, f"layer {self.name}"))
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
        return cls(**compress(name, weight, kinds, mask, bias, tile))

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

    def slot(self) -> LayerSlot:
        """Its header entry and buffer shapes, as a writer lays out a file before packing (`LayerSlot`)."""
        return LayerSlot.from_kinds(self.shape, self.tile, self.dtype, self.kinds, self.bias is not None)

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
        verify_layer(self)
