"""DBRX's experts, which it holds flat, served by the grouped kernels: `TileFlatExperts`.

DBRX's experts module keeps a block's experts as flat (E * F, H) weights on its `mlp`: w1 (gate), v1 (up) and
w2 (down, read (K, N)), and loops in Python over the experts the router picked, one slice of each. patchc plans
each flat weight whole (w2 as its (H, E * F) transpose; `patchc.models.traceable`). To serve them, each plan
is cut at the expert boundaries (`flat_slices`, `patchc.ir.slicing`: F must hold whole tiles), expert e's gate
and up rows stacked into one (2F, H) projection, and the module runs as `TileExperts` does: one grouped launch
per projection on a GPU, and on a CPU the same numbers as the model's own loop over the plan's W * M.

Example:
    >>> ffn.experts = TileFlatExperts(ffn.experts, flat_slices(ffn.experts, plan, path), path)  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from patchc.ir.layer_plan import LayerPlan
from patchc.ir.slicing import stack_rows, take_block
from patchc.ir.targets import bmm_experts, flat_experts, served_call
from patchc.runtime.experts import TileExperts
from patchc.runtime.tuner import LayerTuning

GATE, UP, DOWN = "w1", "v1", "w2"  # the flat weights' names on the experts' `mlp`, as DBRX has them


@dataclass(frozen=True)
class ExpertSlices:
    """Plan layers named as a fused-experts module's slices ("<path>.gate_up_proj.<e>", "<path>.down_proj.<e>"):
    what `TileExperts` and `tune_plan` read from a plan."""

    layers: dict[str, LayerPlan]
    meta: dict[str, Any] = field(default_factory=dict)


def is_flat(experts: nn.Module) -> bool:
    """An experts module whose `mlp` holds its experts flat (`patchc.ir.targets.FLAT_EXPERTS`: DBRX's)."""
    return bool(flat_experts(getattr(experts, "mlp", None)))


def flat_owner(model: nn.Module, param: str) -> str | None:
    """The path of the experts module that runs the flat experts weight `param` ("<experts>.mlp.w1" ->
    "<experts>"), else None."""
    path, _, leaf = param.rpartition(".")
    experts_path, _, attr = path.rpartition(".")
    if attr != "mlp" or not experts_path:
        return None
    experts = model.get_submodule(experts_path)
    return experts_path if is_flat(experts) and leaf in flat_experts(experts.mlp) else None


def flat_layers(path: str) -> dict[str, str]:
    """{flat weight: its plan layer name} of the experts module at `path` ("w1" -> "<path>.mlp.w1")."""
    return {w: f"{path}.mlp.{w}" for w in (GATE, UP, DOWN)}


def _sizes(experts: nn.Module) -> tuple[int, int, int]:
    """(E, F, H) of flat experts: experts, rows per expert, hidden size."""
    mlp = experts.mlp
    rows, hidden = getattr(mlp, GATE).shape
    num = int(getattr(mlp, "moe_num_experts", 0) or getattr(experts, "num_experts"))
    return num, rows // num, hidden


def why_unserved(experts: nn.Module, plan: Any, path: str) -> str | None:
    """Why flat experts at `path` cannot be served from `plan`, or None when they can."""
    name = type(experts).__name__
    if bmm_experts(experts) or not served_call(experts):
        return (f"{name}.forward{inspect.signature(experts.forward)} is not the routed (hidden_states, "
                "top_k_index, top_k_weights) form")
    _, f, _ = _sizes(experts)
    tiles = _tiles(plan, path)
    gate, down = tiles[GATE], tiles[DOWN]
    if tiles[UP] != gate:
        return f"its w1 and v1 are planned with different tiles {gate} and {tiles[UP]}: they are served stacked"
    if f % gate[0] or f % down[1]:
        return (f"its {f} rows per expert are not whole tiles of its plans (w1 / v1 tile {gate}, w2 {down}); "
                "plan it with tiles that divide them")
    return None


def flat_slices(experts: nn.Module, plan: Any, path: str) -> ExpertSlices:
    """Each expert's slices of the flat plans at `path`: "<path>.gate_up_proj.<e>" its w1 and v1 rows stacked
    (2F, H), "<path>.down_proj.<e>" its columns of w2's (H, E * F) plan. A flat weight without a plan is
    served as it is (all dense tiles)."""
    num, f, _ = _sizes(experts)
    tiles = _tiles(plan, path)
    names = flat_layers(path)
    planned = {w: plan.layers.get(name) for w, name in names.items()}
    dtype = next(p.dtype for p in planned.values() if p is not None)
    plans = {w: p or _all_dense(experts.mlp, w, names[w], tiles[w], dtype) for w, p in planned.items()}
    layers = {}
    for e in range(num):
        rows = (e * f, (e + 1) * f)
        name = f"{path}.gate_up_proj.{e}"
        layers[name] = stack_rows([take_block(plans[w], name, rows=rows) for w in (GATE, UP)], name)
        layers[f"{path}.down_proj.{e}"] = take_block(plans[DOWN], f"{path}.down_proj.{e}", cols=rows)
    return ExpertSlices(layers, dict(getattr(plan, "meta", {})))


def _tiles(plan: Any, path: str) -> dict[str, tuple[int, int]]:
    """The tile of each flat weight's plan; an unplanned one takes a planned sibling's (w1 and v1 share)."""
    planned = {w: plan.layers[name].tile for w, name in flat_layers(path).items() if name in plan.layers}
    if not planned:
        raise ValueError(f"{path}: none of its flat weights {GATE}, {UP}, {DOWN} is planned")
    first = next(iter(planned.values()))
    gate = planned.get(GATE) or planned.get(UP) or first
    return {GATE: planned.get(GATE, gate), UP: planned.get(UP, gate), DOWN: planned.get(DOWN, first)}


def _all_dense(mlp: nn.Module, weight: str, name: str, tile: tuple[int, int], dtype: torch.dtype) -> LayerPlan:
    """A plan of every tile dense for an unplanned flat weight, (N, K) in the host memory plans live in."""
    w = getattr(mlp, weight).detach().cpu()
    w = w.t() if flat_experts(mlp)[weight] else w
    grid = (-(-w.shape[0] // tile[0]), -(-w.shape[1] // tile[1]))
    return LayerPlan.from_mask(name, w.to(dtype), torch.zeros(grid, dtype=torch.uint8),
                               torch.ones(w.shape, dtype=torch.bool, device=w.device), tile=tile)


class TileFlatExperts(TileExperts):
    """Drop-in for DBRX's experts module, from its `flat_slices`: forward(hidden_states (B, S, H) or (T, H),
    top_k_index (T, k), top_k_weights (T, k)) -> (B, T / B, H), as DBRX's.

    Example:
        >>> fast = TileFlatExperts(experts, flat_slices(experts, plan, path), path)   # doctest: +SKIP
    """

    def __init__(self, experts: nn.Module, slices: ExpertSlices, path: str,
                 tunings: dict[str, LayerTuning | None] | None = None, dtype: torch.dtype | None = None,
                 device: Any = None) -> None:
        nn.Module.__init__(self)
        self._take_settings(experts, path)
        mlp = experts.mlp
        # no `_apply_gate`: TileExperts' default gate, act(gate) * up, is DBRX's GLU
        self.act_fn, self._gate, self.is_transposed = mlp.activation_fn, None, False
        num, f, hidden = _sizes(experts)
        w = getattr(mlp, GATE)
        # every slice is planned, so only their shape, dtype and device are read off the stored weights
        stand_in = lambda n, k: torch.empty((), dtype=w.dtype, device=w.device).expand(num, n, k)  # noqa: E731
        self._pack(slices, {"gate_up_proj": stand_in(2 * f, hidden), "down_proj": stand_in(hidden, f)}, {},
                   tunings, dtype, device)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = super().forward(rows, top_k_index, top_k_weights)
        return out.view(hidden_states.shape[0], -1, out.shape[-1])

    def replaced_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The flat w1, v1, w2 (E * F, H) from the projections' (E, N, K) W * M."""
        gate, up = weights["gate_up_proj"].chunk(2, dim=1)
        hidden = gate.shape[-1]
        return {f"mlp.{GATE}": gate.reshape(-1, hidden), f"mlp.{UP}": up.reshape(-1, hidden),
                f"mlp.{DOWN}": weights["down_proj"].transpose(1, 2).reshape(-1, hidden)}


__all__ = ["ExpertSlices", "TileFlatExperts", "flat_layers", "flat_owner", "flat_slices", "is_flat", "why_unserved"]
