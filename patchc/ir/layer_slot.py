"""`LayerSlot`: what a file must know of a planned layer before the layer is packed.

A file's header comes before its data, so a writer that packs one layer at a time (and never holds the
whole plan: `patchc import` of a model larger than memory) needs every buffer's dtype and shape first.
They follow from the tile kinds alone: `LayerSlot.from_kinds` gives them without packing anything, and
`LayerPlan.slot()` gives a packed layer's, which must be the same.

Example:
    >>> slot = LayerSlot.from_kinds((40, 24), (16, 16), torch.float16, kinds, has_bias=False)
    >>> slot.parts()["values"]
    (torch.float16, (3, 16, 8))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from patchc.ir.tiles import TILE_DENSE, TILE_SPARSE24, tile_grid, tile_sizes


@dataclass(frozen=True)
class LayerSlot:
    """One planned layer's header entry, buffer shapes and kept-weight count (see the module docstring)."""

    shape: tuple[int, int]
    tile: tuple[int, int]
    dtype: torch.dtype
    has_bias: bool
    n_dense: int
    n_sparse: int
    n_kept: int

    @classmethod
    def from_kinds(cls, shape: tuple[int, int], tile: tuple[int, int], dtype: torch.dtype, kinds: torch.Tensor,
                   has_bias: bool) -> LayerSlot:
        """The slot of a layer whose tile kinds (Tn, Tk) are `kinds`; kept = dense tiles + half of the 2:4 ones."""
        sizes = tile_sizes(shape, tile, kinds.device)
        dense, sparse = kinds == TILE_DENSE, kinds == TILE_SPARSE24
        return cls(shape=(int(shape[0]), int(shape[1])), tile=(int(tile[0]), int(tile[1])), dtype=dtype,
                   has_bias=bool(has_bias), n_dense=int(dense.sum()), n_sparse=int(sparse.sum()),
                   n_kept=int(sizes[dense].sum()) + int(sizes[sparse].sum()) // 2)

    def parts(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{part: (dtype, shape)} of the buffers `LayerPlan.tensors()` holds, in that order."""
        b1, b2 = self.tile
        out = {
            "kinds": (torch.uint8, tile_grid(self.shape, self.tile)),
            "dense": (self.dtype, (self.n_dense, b1, b2)),
            "values": (self.dtype, (self.n_sparse, b1, b2 // 2)),
            "meta": (torch.uint8, (self.n_sparse, b1, math.ceil(b2 // 4 / 2))),
        }
        if self.has_bias:
            out["bias"] = (self.dtype, (self.shape[0],))
        return out

    @property
    def numel(self) -> int:
        """N * K (padding excluded)."""
        return self.shape[0] * self.shape[1]

    @property
    def density(self) -> float:
        """Kept / N*K."""
        return self.n_kept / self.numel

    def nbytes(self) -> int:
        """Bytes of the stored buffers (`LayerPlan.nbytes`)."""
        return sum(dtype.itemsize * math.prod(shape) for dtype, shape in self.parts().values())

    def header(self) -> dict:
        """The file header's entry: what `file_format.read_layer` needs to rebuild the layer."""
        return {"shape": list(self.shape), "tile": list(self.tile), "dtype": str(self.dtype).removeprefix("torch."),
                "has_bias": self.has_bias}


__all__ = ["LayerSlot"]
