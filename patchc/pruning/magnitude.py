"""Magnitude pruning: score |W|, no calibration data.

Example:
    >>> magnitude_scores(torch.tensor([[-3., 1.]]))
    tensor([[3., 1.]])
"""

from __future__ import annotations

import torch


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    """|W| in float32 (N, K); compared within a row (unstructured) or a group of 4 (2:4)."""
    return weight.detach().to(torch.float32).abs()


__all__ = ["magnitude_scores"]
