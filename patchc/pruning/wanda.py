"""Wanda (Sun et al., 2023): score |W_ij| * ||X_j||_2, pruning by weights and activations.

The input-channel norm ||X_j||_2 is taken over every calibration token; scores are compared within
each output row (unstructured) or within each group of 4 along K (2:4), never across rows.

Example:
    >>> wanda_scores(torch.tensor([[1., -1.]]), torch.tensor([4., 1.]))
    tensor([[2., 1.]])
"""

from __future__ import annotations

import torch


def wanda_scores(weight: torch.Tensor, sq_norm: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """|W| * sqrt(sq_norm)[None, :] in float32, sq_norm = sum over tokens of x_j^2 (K,)."""
    if sq_norm.shape != weight.shape[-1:]:
        raise ValueError(
            f"{name}: Wanda channel norms have shape {tuple(sq_norm.shape)}, expected ({weight.shape[-1]},) "
            "(in_features); were the statistics calibrated for this layer?"
        )
    norm = sq_norm.to(device=weight.device, dtype=torch.float32).clamp_min(0).sqrt()
    return weight.detach().to(torch.float32).abs() * norm[None, :]


__all__ = ["wanda_scores"]
