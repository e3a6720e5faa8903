"""Hardening: learned logits -> hard masks -> a validated `TilePlan`.

Rule (the paper's): a tile is dense iff its logit > 0; each 2:4 group keeps its argmax candidate.
The final density is then whatever the signs give. `exact_budget=True` instead ranks every tile of
every layer by its logit and keeps the top ones dense until the global density is as close to the
target as one tile allows (edge tiles of a padded grid count by their real elements). That moves the
tiles whose logits sit on the wrong side of the cut: such a plan differs from the eval-mode program
(`prog.eval()`, dense iff logit > 0) in exactly those tiles; with `exact_budget=False` the two are equal.
Layer names are weight FQNs, or "<fqn>.<expert>" for fused expert weights (`patchc.ir.targets`).

Example:
    >>> plan = patchc.harden(prog, exact_budget=True)
    >>> abs(plan.density - prog.cfg.density) <= max_tile_elems / total_elems
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from patchc.ir import TILE_DENSE, TILE_SPARSE24, LayerPlan, TilePlan
from patchc.ir.provenance import fingerprints
from patchc.ir.targets import META_KEY as TARGETS_KEY
from patchc.ir.targets import recorded_targets

if TYPE_CHECKING:
    from patchc.passes.program import MaskedProgram


def budget_tiles(prog: MaskedProgram) -> dict[str, torch.Tensor]:
    """Global top-k dense tiles by logit so the density lands within one tile of the target."""
    masks = list(prog.layers.values())
    total = sum(m.numel for m in masks)
    dense_budget = (2.0 * prog.cfg.density - 1.0) * total  # density = 0.5 + 0.5 * dense_elems / total
    chosen = {m.name: torch.zeros(m.grid, dtype=torch.bool) for m in masks}
    learned = [m for m in masks if m.tile_logits is not None]
    if not learned or dense_budget <= 0:
        return chosen
    logits = torch.cat([m.tile_logits.detach().flatten().cpu() for m in learned])
    sizes = torch.cat([m.tile_numel.flatten().cpu() for m in learned]).double()
    order = torch.argsort(logits, descending=True, stable=True)
    cumulative = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(sizes[order], 0)])
    # cumulative[k] = dense elements of the top-k tiles: take the k closest to the budget.
    k = int((cumulative - dense_budget).abs().argmin())
    flat = torch.zeros(len(logits), dtype=torch.bool)
    flat[order[:k]] = True
    for m, piece in zip(learned, flat.split([m.tile_logits.numel() for m in learned])):
        chosen[m.name] = piece.view(m.grid)
    return chosen


def _bias(prog: MaskedProgram, fqn: str) -> torch.Tensor | None:
    """The bias a read of weight `fqn` adds where it is its own module's (`<module>.bias`, where plan.apply
    writes it): a weight tied to another module is read with that module's bias too, which stays that
    module's."""
    own = fqn.rpartition(".")[0] + ".bias" if "." in fqn else "bias"
    if any(site.fqn == fqn and site.bias == own for site in prog.sites):
        return prog.weight(own).detach()
    return None


@torch.no_grad()
def harden(prog: MaskedProgram, exact_budget: bool = False) -> TilePlan:
    """Turn a trained `MaskedProgram` into a verified `TilePlan` keyed by weight FQN.

    Args:
        exact_budget: choose dense tiles by a global top-k of the tile logits so that the plan's
            density is within one tile of `1 - cfg.sparsity`; otherwise dense iff logit > 0.
    """
    chosen = budget_tiles(prog) if exact_budget else None
    layers: dict[str, LayerPlan] = {}
    sources: dict[str, torch.Tensor] = {}
    for fqn, m in prog.layers.items():
        tiles = m.hard_tiles().cpu() if chosen is None else chosen[fqn]
        kinds = torch.where(tiles, TILE_DENSE, TILE_SPARSE24).to(torch.uint8)
        weight = sources[fqn] = prog.weight(fqn).detach()
        mask = m.hard_mask(tiles.to(m.nm_logits.device)).cpu()
        layers[fqn] = LayerPlan.from_mask(fqn, weight.cpu(), kinds, mask, bias=_bias(prog, fqn), tile=m.tile)
    meta = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in prog.cfg.to_dict().items()},
        "exact_budget": exact_budget,
        "schedule_step": int(prog.schedule_step),
        "fingerprints": fingerprints(sources),  # plan.apply refuses a model with other weights
    }
    where = recorded_targets(prog.plan_targets())
    if where:  # expert slices / transposed (Conv1D) weights: apply and the fingerprint check read these
        meta[TARGETS_KEY] = where
    plan = TilePlan(layers=layers, skipped=dict(prog.skipped), meta=meta)
    plan.verify()
    return plan
