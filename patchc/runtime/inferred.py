"""The plan the dynamo backend infers from the zeros of a graph's weights: surveyed in every graph, packed once.

Without ``options["plan"]`` every graph dynamo hands the backend is planned from the zero pattern of the
weights it reads (a ``generate()`` hands it three). Packing a layer (`layer_from_weight`: its 2:4 patterns,
values and metadata) costs about five times what finding its tile kinds does, and only the first graph needs
it: later graphs reuse the packed modules (`patchc.runtime.packs`). So an `InferredPlan` holds each weight's
`LayerSlot` (shape and tile counts, all that deciding what to serve needs), kept beside the weight for its
version and the tile, so a later graph finds it without reading the weight again; `packed(names)` packs
layers only when a packed module is built (or the tuner times the first layer of a tuning class).

Example:
    >>> plan = InferredPlan.survey({"layers.0.mlp.up_proj.weight": (weight, False)}, {}, (16, 16))  # doctest: +SKIP
    >>> plan.layers["layers.0.mlp.up_proj.weight"].n_sparse, plan.packed(["layers.0.mlp.up_proj.weight"])
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from patchc.ir import TilePlan
from patchc.ir.from_pruned import layer_from_weight, skip_reason, slot_from_weight
from patchc.ir.layer_slot import LayerSlot

# weight -> {(tile, transposed): (weight version, its slot, or one per expert slice (None: no 2:4 tile))}
_SLOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class InferredPlan:
    """A plan from weights' zeros: `layers` {name: LayerSlot} of the layers holding a 2:4 tile, `meta` as a
    `TilePlan`'s (source, tile, targets), and `packed(names)` for the packed layers (see the module docstring)."""

    def __init__(self, matrices: dict[str, torch.Tensor], layers: dict[str, LayerSlot], meta: dict[str, Any]):
        self.matrices = matrices  # name -> the (N, K) matrix it is packed from
        self.layers = layers
        self.meta = meta
        self._packed = TilePlan(layers={}, meta=dict(meta))

    @classmethod
    def survey(cls, linear: dict[str, tuple[torch.Tensor, bool]], grouped: dict[str, tuple[torch.Tensor, bool]],
               tile: tuple[int, int]) -> InferredPlan:
        """The plan of 2-D weights `linear` {fqn: (weight, read transposed)} and 3-D weights `grouped` (one layer
        per expert slice, "<fqn>.<e>"). Only parameters are planned, whatever their names (DeepSeek-V4's mixers
        are not "*.weight"): a graph input or a computed tensor may hold other values at the next call."""
        matrices, layers, targets = {}, {}, {}
        for fqn, (w, transposed) in linear.items():
            matrix = w.detach().t() if transposed else w.detach()
            if isinstance(w, torch.nn.Parameter) and skip_reason(fqn, matrix) is None:
                slot = _slot(w, matrix, tile, transposed)
                if slot is not None:
                    matrices[fqn], layers[fqn] = matrix, slot
                    targets[fqn] = {"param": fqn, "expert": None, "transposed": True} if transposed else None
        for fqn, (w, transposed) in grouped.items():
            slices = w.detach().transpose(1, 2) if transposed else w.detach()  # (E, N, K)
            if not isinstance(w, torch.nn.Parameter) or slices.shape[2] % 4:
                continue
            for e, slot in enumerate(_expert_slots(w, slices, tile, transposed)):
                if slot is not None:
                    matrices[f"{fqn}.{e}"], layers[f"{fqn}.{e}"] = slices[e], slot
                    targets[f"{fqn}.{e}"] = {"param": fqn, "expert": e, "transposed": transposed}
        meta = {"source": "from_weights", "tile": list(tile),
                "targets": {name: t for name, t in targets.items() if t is not None}}
        return cls(matrices, layers, meta)

    def packed(self, names: list[str]) -> TilePlan:
        """A `TilePlan` holding the packed layers `names` (each packed on its first ask, then kept until
        `release`: the tuner and the module built after it read the same layers)."""
        for name in names:
            if name not in self._packed.layers:
                self._packed.layers[name] = layer_from_weight(name, self.matrices[name], tuple(self.meta["tile"]))
        return self._packed

    def release(self, names: list[str]) -> None:
        """Drop the packed layers `names` (their module is built): a graph holds at most the layers the tuner
        asked for (the first of each tuning class) and the one being built, never a packed copy of them all."""
        for name in names:
            self._packed.layers.pop(name, None)


def packed_plan(plan: Any, names: list[str]) -> Any:
    """`plan` itself, or an inferred plan's packed layers `names` (`InferredPlan.packed`)."""
    return plan.packed(names) if isinstance(plan, InferredPlan) else plan


def built(plan: Any, names: list[str], module: Any) -> Any:
    """`module`, built from layers `names`: an inferred plan drops them (`InferredPlan.release`)."""
    if isinstance(plan, InferredPlan):
        plan.release(names)
    return module


def _slot(w: torch.Tensor, matrix: torch.Tensor, tile: tuple[int, int], transposed: bool) -> LayerSlot | None:
    """The slot of a 2-D weight read as `matrix` (None: no 2:4 tile), found once per weight version."""
    return _cached(w, (tile, transposed), lambda: _matrix_slot(matrix, tile))


def _expert_slots(w: torch.Tensor, slices: torch.Tensor, tile: tuple[int, int],
                  transposed: bool) -> list[LayerSlot | None]:
    """The slot of each expert slice (N, K) of a 3-D weight, found once per weight version."""
    return _cached(w, (tile, transposed), lambda: [_matrix_slot(m, tile) for m in slices])


def _matrix_slot(matrix: torch.Tensor, tile: tuple[int, int]) -> LayerSlot | None:
    slot = slot_from_weight(matrix, tile)
    return slot if slot.n_sparse else None


def _cached(w: torch.Tensor, key: tuple[Any, ...], find: Any) -> Any:
    """`find()` for (`w`, `key`), kept beside `w` while `w` lives and its version stays (an in-place edit
    surveys it again)."""
    entries = _SLOTS.get(w)
    if entries is None:
        entries = _SLOTS[w] = {}
    hit = entries.get(key)
    if hit is not None and hit[0] == w._version:
        return hit[1]
    entries[key] = (w._version, find())
    return entries[key][1]


__all__ = ["InferredPlan", "built", "packed_plan"]
