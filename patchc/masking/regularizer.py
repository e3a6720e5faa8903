"""The regulariser: a density term that pulls the kept share to the target, and a decaying magnitude term.

    L_reg = lambda1 * |density - rho| - lambda2 * (1 - t/T) * sum_i ||M_i * W_i||^2 / sum_i ||W_i||^2

The density is parameter weighted over the masked layers: "expected" (P(tile dense) = sigmoid(kappa *
P_t), smooth, the default) or "sampled" (sum of the last training forward's masks). The density term is
global (one term, the paper's) or one term per transformer block averaged (`scope="block"`, the
ablation). The magnitude term uses the masks of the last training forward and is 0 before one.

Example:
    >>> groups = density_groups(masks, "global")
    >>> loss = regularizer(masks, groups, cfg, step=10, weight_sq_norm=w_sq)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from patchc.masking.hybrid_mask import HybridMask
from patchc.utils.names import block_index

if TYPE_CHECKING:
    from patchc.config import PatchConfig


def density_groups(masks: list[HybridMask], scope: str) -> list[list[HybridMask]]:
    """The layers each density term covers: all of them ("global"), or one group per block ("block").

    A weight outside any transformer block forms a group of its own.
    """
    if scope == "global":
        return [masks]
    by_block: dict[object, list[HybridMask]] = {}
    for m in masks:
        block = block_index(m.name)
        by_block.setdefault(m.name if block is None else block, []).append(m)
    return list(by_block.values())


def density(masks: Sequence[HybridMask], mode: str) -> torch.Tensor:
    """Parameter-weighted density of `masks`: "expected" or "sampled" (needs a training forward first)."""
    if mode == "expected":
        kept = [m.expected_kept() for m in masks]
    elif mode == "sampled":
        if any(m.last_sum is None for m in masks):
            raise RuntimeError("density_mode='sampled' needs a training-mode forward before regularizer()")
        kept = [m.last_sum for m in masks]
    else:
        raise ValueError(f"unknown density mode {mode!r}; choose 'expected' or 'sampled'")
    return torch.stack(kept).sum() / sum(m.numel for m in masks)


def regularizer(
    masks: Sequence[HybridMask],
    groups: Sequence[Sequence[HybridMask]],
    cfg: PatchConfig,
    step: int,
    weight_sq_norm: torch.Tensor,
) -> torch.Tensor:
    """lambda1 * mean over `groups` of |density - rho| - lambda2 * (1 - step/T) * sum ||M*W||^2 / `weight_sq_norm`."""
    rho = cfg.density
    density_term = torch.stack([(density(g, cfg.density_mode) - rho).abs() for g in groups]).mean()
    loss = cfg.lambda_density * density_term
    if cfg.lambda_norm > 0 and all(m.last_sq_norm is not None for m in masks):
        decay = max(0.0, 1.0 - step / cfg.steps)
        kept_norm = torch.stack([m.last_sq_norm for m in masks]).sum()
        loss = loss - cfg.lambda_norm * decay * kept_norm / weight_sq_norm
    return loss
