"""Prior logits from one-shot masks (DESIGN.md section 1, "Priors"); the caller scales by std * strength.

- `nm_prior`: per 2:4 group, each of the 6 candidates scores how many of its 2 kept positions the
  one-shot 2:4 mask keeps (0, 1 or 2); the prior is score - 1 in {-1, 0, +1}. The one-shot choice is
  the unique candidate at +1, so the argmax of the shifted logits reproduces it.
- `tile_prior`: tiles ranked by the kept fraction of the unstructured one-shot mask at the target
  density; the top round(2 * n_tiles * (density - 0.5)) get +1 (dense), the rest -1.

Example:
    >>> nm_prior(torch.tensor([[True, False, True, False]]))
    tensor([[ 0.,  1.,  0.,  0., -1.,  0.]])
"""

from __future__ import annotations

import torch

from patchc.pruning.patterns import check_groups, check_tile

from patchc.ir.patterns import PATTERNS
from patchc.ir.tiles import tile_sizes, to_tiles

# Candidate p keeps positions (0,1) (0,2) (0,3) (1,2) (1,3) (2,3): the IR's order.
CANDIDATES = PATTERNS.to(torch.float32)


def nm_prior(mask24: torch.Tensor) -> torch.Tensor:
    """(N*K/4, 6) float32 prior: for each group (row-major) and candidate, (#kept positions both keep) - 1.

    Example:
        >>> nm_prior(torch.tensor([[False, True, True, False]]))   # the mask is candidate 3 (0110)
        tensor([[ 0.,  0., -1.,  1.,  0.,  0.]])
    """
    check_groups(tuple(mask24.shape), "nm_prior mask")
    groups = mask24.reshape(-1, 4).to(torch.float32)
    return groups @ CANDIDATES.to(groups.device).T - 1.0


def dense_tile_count(n_tiles: int, density: float) -> int:
    """round(2 * n_tiles * (density - 0.5)) clamped to [0, n_tiles] (Python round, half to even)."""
    if not 0.5 <= float(density) <= 1.0:
        raise ValueError(f"density={density} must lie in [0.5, 1]: tiles are dense or 2:4")
    return min(max(int(round(2 * n_tiles * (float(density) - 0.5))), 0), n_tiles)


def tile_kept_fraction(mask: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """(Tn, Tk) float64 kept fraction per tile; partial edge tiles count only their real elements."""
    kept = to_tiles(mask.to(torch.float64), tile).sum((2, 3))  # zero padding: never counts
    return kept / tile_sizes(tuple(mask.shape), tile, mask.device).to(torch.float64)


def dense_tiles(mask_unstructured: torch.Tensor, tile, density: float) -> torch.Tensor:
    """(Tn, Tk) bool: the top dense_tile_count tiles by kept fraction (ties: row-major order first)."""
    tile = check_tile(tile)
    if mask_unstructured.dim() != 2:
        raise ValueError(f"tile_prior needs a 2-D mask, got shape {tuple(mask_unstructured.shape)}")
    frac = tile_kept_fraction(mask_unstructured, tile)
    n_dense = dense_tile_count(frac.numel(), density)
    order = torch.argsort(frac.flatten(), descending=True, stable=True)[:n_dense]
    chosen = torch.zeros(frac.numel(), dtype=torch.bool, device=frac.device)
    chosen[order] = True
    return chosen.reshape(frac.shape)


def tile_prior(mask_unstructured: torch.Tensor, tile, density: float) -> torch.Tensor:
    """(Tn, Tk) float32 prior: +1 for the dense tiles chosen by `dense_tiles`, -1 for the rest.

    Example:
        >>> m = torch.ones(8, 8, dtype=torch.bool); m[:, 4:] = False    # left tiles fully kept
        >>> tile_prior(m, (4, 4), density=0.75)                        # 2 of 4 tiles dense
        tensor([[ 1., -1.],
                [ 1., -1.]])
    """
    return dense_tiles(mask_unstructured, tile, density).to(torch.float32) * 2.0 - 1.0


__all__ = ["CANDIDATES", "nm_prior", "tile_prior", "dense_tiles", "dense_tile_count", "tile_kept_fraction"]
