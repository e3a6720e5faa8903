"""`ParamMask`: the mask of a weight that is not one plain (N, K) matrix.

Two layouts need it (see `patchc.ir.targets`):

    transposed   a (K, N) weight (GPT-2 Conv1D): M is learned on W^T, so 2:4 groups run along K
    experts      a fused 3-D (E, N, K) or (E, K, N) weight: one `HybridMask` per expert slice, so
                 tiles never cross experts, each named "<fqn>.<expert>"; a weight with rows past the
                 masked experts (LongCat-Flash's, for experts that compute nothing, which the model
                 slices off before its matmul) keeps those rows as they are

It returns the masked weight in the stored layout, so the graph around it is unchanged. With every
mask in "ones" mode it returns the weight bit for bit.

Example:
    >>> pm = ParamMask("mlp.experts.down_proj", [HybridMask(f"mlp.experts.down_proj.{e}", (32, 64), (16, 16))
    ...                                          for e in range(4)], experts=True)
    >>> pm(torch.randn(4, 32, 64)).shape
    torch.Size([4, 32, 64])
"""

from __future__ import annotations

import torch
from torch import nn

from patchc.masking.hybrid_mask import HybridMask


class ParamMask(nn.Module):
    """Masks of one parameter stored transposed and / or as stacked experts (see module docstring)."""

    def __init__(self, name: str, masks: list[HybridMask], experts: bool, transposed: bool = False) -> None:
        super().__init__()
        if not experts and len(masks) != 1:
            raise ValueError(f"{name}: a 2-D weight has one mask, got {len(masks)}")
        self.name, self.experts, self.transposed = name, experts, transposed
        self.masks = nn.ModuleList(masks)

    def extra_repr(self) -> str:
        return f"{self.name}, experts={len(self.masks) if self.experts else None}, transposed={self.transposed}"

    def _one(self, mask: HybridMask, w: torch.Tensor) -> torch.Tensor:
        return mask(w.t()).t() if self.transposed else mask(w)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.experts:
            return self._one(self.masks[0], weight)
        if weight.dim() != 3 or weight.shape[0] < len(self.masks):
            raise ValueError(f"{self.name}: built for {len(self.masks)} experts, got a weight of shape "
                             f"{tuple(weight.shape)}")
        # one allocation for the masked experts and the rows past them (none but LongCat-Flash's)
        parts = [self._one(m, weight[e]).unsqueeze(0) for e, m in enumerate(self.masks)]
        return torch.cat([*parts, weight[len(self.masks):]])


def hybrid_masks(modules) -> list[HybridMask]:
    """Every `HybridMask` among `modules` (a ParamMask contributes its per-expert masks), in order."""
    out: list[HybridMask] = []
    for m in modules:
        out.extend(m.masks if isinstance(m, ParamMask) else [m])
    return out


__all__ = ["ParamMask", "hybrid_masks"]
