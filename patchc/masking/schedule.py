"""The temperature and logit-scale schedules: linear per optimizer step from (start, end), held after T.

tau (tile logits), tau_nm (2:4 logits; tau unless given), kappa_tile and kappa_nm come from `PatchConfig`;
`MaskedProgram.step()` advances them and pushes the values into every mask.

Example:
    >>> schedule_value((2.0, 0.05), step=150, total=300)
    1.025
    >>> round(schedule_at(PatchConfig(steps=300), 300)["tau"], 6)
    0.05
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from patchc.config import PatchConfig


def schedule_value(pair: tuple[float, float], step: int, total: int) -> float:
    """Linear schedule from pair[0] at step 0 to pair[1] at step `total` (held after)."""
    frac = min(max(step, 0) / total, 1.0)
    return pair[0] + (pair[1] - pair[0]) * frac


def schedule_at(cfg: PatchConfig, step: int) -> dict[str, float]:
    """tau (tile), tau_nm, kappa_tile, kappa_nm at optimizer step `step` of `cfg.steps`."""
    total = cfg.steps
    return {
        "tau": schedule_value(cfg.tau, step, total),
        "tau_nm": schedule_value(cfg.tau_nm, step, total),
        "kappa_tile": schedule_value(cfg.kappa_tile, step, total),
        "kappa_nm": schedule_value(cfg.kappa_nm, step, total),
    }
