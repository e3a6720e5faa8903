"""Turning per-weight scores into masks: 2:4, unstructured per row, and dense / 2:4 tiles.

Convention (everywhere in patchc): a mask is a bool tensor shaped like W (N, K), True = kept. The
higher the score, the more a weight is worth keeping. Ties are broken deterministically: among equal
scores the lower column index is kept (2:4 and unstructured alike).

Example:
    >>> mask_24(torch.tensor([[4., 1., 3., 2.]]))
    tensor([[ True, False,  True, False]])
"""

from __future__ import annotations

import math

import torch

from patchc.config import check_tile_sides
from patchc.ir.tiles import expand_tiles


def prune_count(k: int, sparsity: float) -> int:
    """How many of k weights a row prunes at `sparsity`: floor(sparsity * k + 1/2)."""
    return int(math.floor(float(sparsity) * k + 0.5))


def check_groups(shape: tuple[int, ...], name: str = "weight") -> None:
    """Raise if a (N, K) weight cannot hold 2:4 groups along K."""
    if len(shape) != 2:
        raise ValueError(f"{name}: 2:4 masks need a 2-D weight, got shape {tuple(shape)}")
    if shape[1] % 4:
        raise ValueError(
            f"{name}: in_features K={shape[1]} is not a multiple of 4, so it has no 2:4 groups; "
            "leave this layer out (layers=...) or use pattern='unstructured'"
        )


def mask_24(scores: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Keep the 2 highest-scoring of every 4 consecutive elements along K."""
    check_groups(tuple(scores.shape), name)
    n, k = scores.shape
    groups = scores.reshape(n, k // 4, 4)
    top = torch.argsort(groups, dim=-1, descending=True, stable=True)[..., :2]
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True)
    return keep.reshape(n, k)


def mask_unstructured(scores: torch.Tensor, sparsity: float, name: str = "weight") -> torch.Tensor:
    """Prune the prune_count(K, sparsity) lowest-scoring weights of every row."""
    if scores.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D score tensor, got shape {tuple(scores.shape)}")
    check_sparsity(sparsity, name)
    n, k = scores.shape
    n_prune = prune_count(k, sparsity)
    keep = torch.ones(n, k, dtype=torch.bool, device=scores.device)
    if n_prune:
        low = torch.argsort(scores, dim=1, descending=True, stable=True)[:, k - n_prune :]
        keep.scatter_(1, low, False)
    return keep


def check_sparsity(sparsity: float, name: str = "weight", upper: float = 1.0) -> None:
    if not 0.0 <= float(sparsity) <= upper:
        raise ValueError(f"{name}: sparsity={sparsity} must lie in [0, {upper}]")


def check_tile(tile) -> tuple[int, int]:
    if tile is None:
        raise ValueError("pattern='tiles' needs tile=(b1, b2), e.g. tile=(16, 16)")
    tile = tuple(int(t) for t in tile)
    if len(tile) != 2:
        raise ValueError(f"tile={tile}: a tile is a pair (b1, b2), e.g. (16, 16)")
    check_tile_sides(tile, f"tile={tile}", "e.g. (16, 16)")
    return tile


def merge_tiles(dense_tiles: torch.Tensor, mask24: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Hybrid mask: all-kept inside dense tiles, the 2:4 mask elsewhere."""
    return expand_tiles(dense_tiles.to(torch.bool), tile, tuple(mask24.shape)) | mask24


__all__ = [
    "prune_count",
    "check_groups",
    "check_sparsity",
    "check_tile",
    "mask_24",
    "mask_unstructured",
    "merge_tiles",
]
