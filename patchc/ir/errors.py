"""The IR's one error type, and the helpers its messages use to point at a tile or a value.

Example:
    >>> raise PlanError("layer fc.weight: tile (0, 1) is 2:4 but group at row 3 keeps 3 of 4")
    Traceback (most recent call last):
    PlanError: layer fc.weight: tile (0, 1) is 2:4 but group at row 3 keeps 3 of 4
"""

from __future__ import annotations

from typing import Any

import torch


class PlanError(ValueError):
    """An invalid or inconsistent tile plan (the message names the layer, file, tile or group)."""


def first_true(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first true element (row-major) of a bool tensor with at least one true."""
    return tuple(int(i) for i in mask.nonzero()[0])


def describe(x: Any) -> str:
    """What a wrong argument was, for an error message: dtype and shape of a tensor, else its type."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
