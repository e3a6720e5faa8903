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

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from patchc.ir import TILE_DENSE, TILE_SPARSE24, LayerPlan, TilePlan
from patchc.ir.provenance import fingerprint
from patchc.ir.targets import recorded_meta

if TYPE_CHECKING:
    from patchc.masking.hybrid_mask import HybridMask
    from patchc.passes.program import MaskedProgram


def _whole(t: torch.Tensor) -> torch.Tensor:
    """`t`, or the whole tensor of an FSDP2 shard (a DTensor: a collective, every rank reads it in turn)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def tile_scores(masks: Iterable[HybridMask]) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
    """{layer: (its tile logits or None, elements per tile)} on the CPU: all `budget_tiles` reads. Sharded tile
    logits are gathered alone (one per tile), so a sharded program needs no weights gathered for them."""
    return {m.name: (None if m.tile_logits is None else _whole(m.tile_logits).float().cpu(),
                     m.tile_numel.detach().cpu()) for m in masks}


def budget_tiles(prog: MaskedProgram) -> dict[str, torch.Tensor]:
    """Global top-k dense tiles by logit so the density lands within one tile of the target."""
    scores = tile_scores(prog.layers.values())
    total = sum(float(sizes.double().sum()) for _, sizes in scores.values())  # fp32 sums drift past 2**24
    dense_budget = (2.0 * prog.cfg.density - 1.0) * total  # density = 0.5 + 0.5 * dense_elems / total
    chosen = {name: torch.zeros(sizes.shape, dtype=torch.bool) for name, (_, sizes) in scores.items()}
    learned = {name: pair for name, pair in scores.items() if pair[0] is not None}
    if not learned or dense_budget <= 0:
        return chosen
    logits = torch.cat([tl.flatten() for tl, _ in learned.values()])
    sizes = torch.cat([ts.flatten() for _, ts in learned.values()]).double()
    order = torch.argsort(logits, descending=True, stable=True)
    cumulative = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(sizes[order], 0)])
    # cumulative[k] = dense elements of the top-k tiles: take the k closest to the budget.
    k = int((cumulative - dense_budget).abs().argmin())
    flat = torch.zeros(len(logits), dtype=torch.bool)
    flat[order[:k]] = True
    for (name, (tl, _)), piece in zip(learned.items(), flat.split([tl.numel() for tl, _ in learned.values()])):
        chosen[name] = piece.view(tl.shape)
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
    for m in prog.layers.values():  # a diverged run's NaN logits would sort, and harden, as plausible tiles
        check_finite_logits(m)
    chosen = budget_tiles(prog) if exact_budget else {}
    layers = {fqn: harden_layer(prog, m, chosen.get(fqn)) for fqn, m in prog.layers.items()}
    return assemble_plan(prog, layers, exact_budget)


def check_finite_logits(m: HybridMask) -> None:
    """FloatingPointError naming the layer whose tile or 2:4 logits hold a NaN or inf (each rank its shard)."""
    for what, t in (("tile", m.tile_logits), ("2:4", getattr(m, "nm_logits", None))):
        local = t.to_local() if hasattr(t, "to_local") else t
        if isinstance(local, torch.Tensor) and not bool(torch.isfinite(local).all()):
            raise FloatingPointError(f"harden: layer {m.name}: its {what} logits are not finite (training diverged: "
                                     "a loss went nan or inf); train again with a lower lr, or from an earlier "
                                     "checkpoint")


@torch.no_grad()
def harden_layer(prog: MaskedProgram, m: HybridMask, tiles: torch.Tensor | None = None) -> tuple[LayerPlan, dict]:
    """One layer's `LayerPlan` (on the CPU) and the fingerprint of its dense weight; `tiles`: the dense
    tiles `budget_tiles` chose, else dense iff logit > 0."""
    tiles = m.hard_tiles().cpu() if tiles is None else tiles
    kinds = torch.where(tiles, TILE_DENSE, TILE_SPARSE24).to(torch.uint8)
    weight = prog.weight(m.name).detach()
    mask = m.hard_mask(tiles.to(m.nm_logits.device)).cpu()
    layer = LayerPlan.from_mask(m.name, weight.cpu(), kinds, mask, bias=_bias(prog, m.name), tile=m.tile)
    return layer, fingerprint(weight)


def assemble_plan(prog: MaskedProgram, layers: dict[str, tuple[LayerPlan, dict]], exact_budget: bool) -> TilePlan:
    """The verified `TilePlan` of `harden_layer`'s results, in the program's layer order, with its meta."""
    meta = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in prog.cfg.to_dict().items()},
        "exact_budget": exact_budget,
        "schedule_step": int(prog.schedule_step),
        # plan.apply refuses a model with other weights
        "fingerprints": {name: layers[name][1] for name in prog.layers},
    }
    # expert slices / transposed (Conv1D) weights: apply and the fingerprint check read these
    meta.update(recorded_meta(prog.plan_targets()))
    plan = TilePlan(layers={name: layers[name][0] for name in prog.layers}, skipped=dict(prog.skipped), meta=meta)
    plan.verify()
    return plan
