"""Plans from what other tools produce: weights that are already pruned, or hard masks per weight.

`layers_from_weights` infers each tile's kind from the zeros (a tile is 2:4 iff every group has at most
2 nonzeros); `layers_from_masks` reads the kinds off boolean masks (all kept -> dense, exactly 2 of
every 4 -> 2:4, anything else refused or, with `allow_lossy`, kept dense). Both return the planned
layers and the skipped ones with their reasons; `TilePlan.from_weights` / `from_masks` wrap them.

Example:
    >>> layers, skipped, tile = layers_from_weights(pruned.state_dict(), tile=(16, 16))
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from patchc.ir import targets
from patchc.ir.errors import PlanError, first_true
from patchc.ir.layer_plan import LayerPlan
from patchc.ir.layer_slot import LayerSlot
from patchc.ir.patterns import COVER_PATTERN, EXACT_PATTERN, PATTERNS, group_codes
from patchc.ir.tiles import (TILE_DENSE, TILE_SPARSE24, from_tiles, padded_numel, tile_pair, tile_sizes, to_tiles,
                             valid_groups)

Layers = tuple[dict[str, LayerPlan], dict[str, str], tuple[int, int]]

# Square tile sides `infer_tile` picks from, widest first: each divides the ones before it.
INFER_SIDES = (128, 64, 32, 16)
# A side whose edge tiles pad the planned weights to more than this times their size at the finest side is
# not picked: a 32 x 32 weight in one 128 x 128 tile stores 16 times its weights (a tiny model came out 7x dense).
MAX_PADDING = 1.05


def layers_from_weights(
    state_dict: Mapping[str, torch.Tensor] | nn.Module,
    tile: tuple[int, int] | int,
    include: Callable[[str], bool] | None = None,
) -> Layers:
    """(layers, skipped, tile) inferred from already-pruned weights (see `TilePlan.from_weights`)."""
    if isinstance(state_dict, nn.Module):  # weights as stored: a Conv1D's (K, N) would be read along N
        odd = [n for n, t in targets.model_matrices(state_dict).items() if t.transposed or t.expert is not None]
        if odd:
            raise PlanError(f"from_weights: {odd[0]} is a transposed (Conv1D) or fused-expert weight ({len(odd)} "
                            "such); TilePlan.from_linears(model) reads them as the runtime serves them")
    sd = state_dict.state_dict() if isinstance(state_dict, nn.Module) else state_dict
    tile = tile_pair(tile, "from_weights")
    layers: dict[str, LayerPlan] = {}
    skipped: dict[str, str] = {}
    for fqn, w in sd.items():
        if not (fqn == "weight" or fqn.endswith(".weight")):
            continue
        why = _why_skip(fqn, w, include)
        if why:
            skipped[fqn] = why
            continue
        layers[fqn] = layer_from_weight(fqn, w, tile, bias=_find_bias(sd, fqn, w))
    return layers, skipped, tile


def layers_from_linears(model: nn.Module, tile: tuple[int, int] | int
                        ) -> tuple[dict[str, LayerPlan], dict[str, str], tuple[int, int], dict[str, dict]]:
    """(layers, left, tile, meta): every weight matrix of `model` the runtime serves (`targets.model_matrices`:
    nn.Linear, Conv1D, fused experts' slices) that holds a 2:4 tile, planned from its zeros; `left` names
    the others and why (see `TilePlan.from_linears`); `meta` records where the expert slices and transposed
    weights among them live (`targets.recorded_meta`), as the job's plans do."""
    where, slots, left = survey_linears(model, tile)
    layers = {name: layer_from_linear(model, name, where[name], slot.tile) for name, slot in slots.items()}
    return layers, left, tile_pair(tile, "from_linears"), targets.recorded_meta(where)


def survey_linears(model: nn.Module, tile: tuple[int, int] | int) -> tuple[dict[str, targets.Target],
                                                                           dict[str, LayerSlot], dict[str, str]]:
    """The first half of `layers_from_linears`, which packs nothing: (where each matrix to plan lives, its
    `LayerSlot`, the matrices left plain and why). `layer_from_linear` packs one when it is wanted, so a
    writer can lay a file out first and then hold one packed layer at a time."""
    tile = tile_pair(tile, "from_linears")
    where: dict[str, targets.Target] = {}
    slots: dict[str, LayerSlot] = {}
    left: dict[str, str] = {}
    for name, target in targets.model_matrices(model).items():
        w = targets.read(model, target).detach()
        why = _why_skip(name, w, None) or _router(name)
        if why:
            left[name] = why
            continue
        slot = slot_from_weight(w, tile)
        if not slot.n_sparse:  # known before packing: a dense model packs nothing
            left[name] = "no 2:4 tile"
            continue
        where[name] = target
        slots[name] = dataclasses.replace(slot, has_bias=_linear_bias(model, name, target, w) is not None)
    return where, slots, left


def infer_tile(model: nn.Module, keep: float = 0.99) -> tuple[int, int]:
    """The widest square tile of `INFER_SIDES` whose 2:4 tiles hold at least `keep` of the weights that
    16 x 16 tiles find 2:4 (`sparse_coverage`): 128 x 128 for a model that is 2:4 throughout, the tile it
    was pruned with for a hybrid one (wider tiles would turn its 2:4 tiles dense), and never one whose edge
    tiles would pad the weights by more than `MAX_PADDING` (a model narrower than 128 gets a narrower tile).

    Example:
        >>> infer_tile(sparsegpt_2of4_llama), infer_tile(patch_hybrid_model_with_32x32_tiles)
        ((128, 128), (32, 32))
    """
    covered, padded = sparse_coverage(model)
    return pick_tile(covered, keep, padded)


def pick_tile(covered: dict[int, int], keep: float = 0.99, padded: dict[int, int] | None = None) -> tuple[int, int]:
    """`infer_tile`'s choice from a `sparse_coverage`: the widest side keeping `keep` of the 2:4 weights whose
    padded size (`padded`, {side: weights with the edge tiles' padding}) is within `MAX_PADDING` of the finest's."""
    if not 0 < keep <= 1:
        raise PlanError(f"infer_tile: keep must be in (0, 1], got {keep}")
    fine = INFER_SIDES[-1]
    if covered[fine] == 0:  # nothing is 2:4 at any side: the finest, so that "no 2:4 tile at 16 x 16" says so
        return fine, fine
    fits = (lambda s: padded[s] <= MAX_PADDING * padded[fine]) if padded else (lambda s: True)
    side = next(s for s in INFER_SIDES if covered[s] >= keep * covered[fine] and fits(s))
    return side, side


def sparse_coverage(model: nn.Module) -> tuple[dict[int, int], dict[int, int]]:
    """({side: weights in 2:4 tiles of side x side}, {side: weights once padded to side x side tiles}) over
    the weights `survey_linears` plans, for each of `INFER_SIDES`; one pass at 16 x 16, the wider tiles read
    off it (a tile is 2:4 iff all its 16 x 16 tiles are, since 2:4 groups never straddle them)."""
    fine = INFER_SIDES[-1]
    covered, padded = dict.fromkeys(INFER_SIDES, 0), dict.fromkeys(INFER_SIDES, 0)
    for name, target in targets.model_matrices(model).items():
        w = targets.read(model, target).detach()
        if _why_skip(name, w, None) or _router(name):
            continue
        sparse = _kinds_from_weight(w, (fine, fine)) == TILE_SPARSE24  # (Tn, Tk) at the finest side
        sizes = tile_sizes(tuple(w.shape), (fine, fine), w.device)
        for side in INFER_SIDES:
            covered[side] += int(sizes[_coarsen(sparse, side // fine)].sum())
            padded[side] += padded_numel(tuple(w.shape), (side, side))
    return covered, padded


def _coarsen(sparse: torch.Tensor, f: int) -> torch.Tensor:
    """Per fine tile: whether the f x f block of fine tiles around it is all 2:4 (one coarse 2:4 tile);
    the grid's padding counts as 2:4, as padded zeros do."""
    tn, tk = sparse.shape
    pad = torch.ones(-(-tn // f) * f, -(-tk // f) * f, dtype=torch.bool, device=sparse.device)
    pad[:tn, :tk] = sparse
    coarse = pad.view(pad.shape[0] // f, f, pad.shape[1] // f, f).all(3).all(1)
    return coarse.repeat_interleave(f, 0).repeat_interleave(f, 1)[:tn, :tk]


def layer_from_linear(model: nn.Module, name: str, target: targets.Target, tile: tuple[int, int]) -> LayerPlan:
    """The LayerPlan of one matrix `survey_linears` found (its `<module>.bias` carried, never an expert's)."""
    w = targets.read(model, target).detach()
    kinds, mask = _infer_from_weight(w, tile)
    return LayerPlan.from_mask(name, w, kinds, mask, bias=_linear_bias(model, name, target, w), tile=tile)


def layer_from_weight(name: str, w: torch.Tensor, tile: tuple[int, int], bias: torch.Tensor | None = None) -> LayerPlan:
    """The LayerPlan of one already-pruned (N, K) matrix under any name (an expert slice "experts.up_proj.3"
    too): a tile is 2:4 iff every group of 4 holds at most 2 nonzeros.

    Example:
        >>> layer_from_weight("experts.down_proj.0", pruned_experts.down_proj[0], (16, 16)).n_sparse
    """
    why = _why_skip(name, w, None)
    if why:
        raise PlanError(f"layer {name!r}: cannot plan it from its weights: {why}")
    w = w.detach()
    kinds, mask = _infer_from_weight(w, tile)
    return LayerPlan.from_mask(name, w, kinds, mask, bias=bias, tile=tile)


def slot_from_weight(w: torch.Tensor, tile: tuple[int, int]) -> LayerSlot:
    """`layer_from_weight(name, w, tile).slot()` without packing anything (no bias): the tile kinds from a count
    of nonzeros per group, about a fifth of the work.

    Example:
        >>> slot_from_weight(pruned.weight, (16, 16)).n_sparse
    """
    w = w.detach()
    return LayerSlot.from_kinds(tuple(w.shape), tile, w.dtype, _kinds_from_weight(w, tile), has_bias=False)


def layers_from_masks(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    masks: Mapping[str, torch.Tensor],
    tile: tuple[int, int] | int,
    allow_lossy: bool = False,
) -> tuple[dict[str, LayerPlan], dict[str, str], tuple[int, int], dict[str, targets.Target]]:
    """(layers, skipped, tile, where) from hard masks (N, K) bool per weight FQN (see `TilePlan.from_masks`);
    `where`: the `targets.Target` of each weight read through the module (a Conv1D's transpose, an expert's
    "<param>.<e>" slice), as `patchc.oneshot` names and shapes their masks."""
    where: dict[str, targets.Target] = {}
    if isinstance(model_or_state_dict, nn.Module):
        params = dict(model_or_state_dict.named_parameters(remove_duplicate=False))
        sd = {**model_or_state_dict.state_dict(keep_vars=True), **params}
        where = targets.model_matrices(model_or_state_dict)
        sd |= {name: targets.read(model_or_state_dict, t) for name, t in where.items()}
    else:
        sd = dict(model_or_state_dict)
    tile = b1, b2 = tile_pair(tile, "from_masks")
    layers: dict[str, LayerPlan] = {}
    skipped: dict[str, str] = {}
    for fqn, mask in masks.items():
        if fqn not in sd:
            expert = "" if where or targets.expert_slice(fqn)[1] is None else (
                " (an expert's \"<param>.<e>\" is read through the model: pass it, not its state)")
            raise PlanError(f"layer {fqn}: a mask is given but the model has no weight {fqn!r}{expert}")
        w = sd[fqn].detach()
        why = _why_skip(fqn, w, None)
        if why:
            skipped[fqn] = why
            continue
        mask = torch.as_tensor(mask).to(w.device)
        if tuple(mask.shape) != tuple(w.shape):
            hint = " (a GPT-2 Conv1D weight is stored transposed: pass the model, not a state dict)" if (
                not where and tuple(mask.shape) == tuple(w.shape)[::-1]) else ""
            raise PlanError(
                f"layer {fqn}: mask shape {tuple(mask.shape)} differs from the weight's {tuple(w.shape)}{hint}"
            )
        mask = mask.bool()
        shape = tuple(w.shape)
        mtiles = to_tiles(mask, tile, value=True)
        all_true = mtiles.flatten(2).all(-1)
        groups = mtiles.reshape(*mtiles.shape[:3], b2 // 4, 4)
        ok24 = EXACT_PATTERN.to(w.device)[group_codes(groups)] >= 0
        ok24 = (ok24 | ~valid_groups(shape, tile, w.device)).flatten(2).all(-1)
        bad = ~all_true & ~ok24
        if bad.any() and not allow_lossy:
            r, c = first_true(bad)
            t = mask[r * b1 : (r + 1) * b1, c * b2 : (c + 1) * b2]
            raise PlanError(
                f"layer {fqn}: tile ({r}, {c}) is neither all kept nor 2:4 (keeps {int(t.sum())} of {t.numel()}, "
                "not exactly 2 in every group of 4); use a structured mask, "
                "or allow_lossy=True to keep such tiles dense"
            )
        dense = all_true | bad
        kinds = torch.where(dense, TILE_DENSE, TILE_SPARSE24).to(torch.uint8)
        full = from_tiles(mtiles | dense[:, :, None, None], shape)
        bias = None if fqn in where and where[fqn].expert is not None else _find_bias(sd, fqn, w)
        layers[fqn] = LayerPlan.from_mask(fqn, w, kinds, full, bias=bias, tile=tile)
    return layers, skipped, tile, {name: where[name] for name in layers if name in where}


def skip_reason(name: str, w: Any) -> str | None:
    """Why `w` cannot be planned from its values (not a 2-D float tensor, or K not a multiple of 4), or None."""
    return _why_skip(name, w, None)


def _why_skip(fqn: str, w: Any, include: Callable[[str], bool] | None) -> str | None:
    if not isinstance(w, torch.Tensor):
        return f"not a tensor ({type(w).__name__})"
    if w.dim() != 2:
        return f"not 2-D (shape {tuple(w.shape)})"
    if not w.is_floating_point():
        return f"not a float tensor ({w.dtype})"
    if w.shape[1] % 4:
        return f"K={w.shape[1]} is not a multiple of 4 (no 2:4 groups)"
    if include is not None and not include(fqn):
        return "excluded by include()"
    return None


def _router(fqn: str) -> str | None:
    """Why a MoE router is never planned (Llama 4's is an nn.Linear whose forward returns a tuple)."""
    from patchc.config import ROUTER_EXCLUDE

    hit = next((g for g in ROUTER_EXCLUDE if fnmatch.fnmatchcase(fqn, g)), None)
    return None if hit is None else f"a MoE router ({hit!r}): sparsifying it changes routing"


def _find_bias(sd: Mapping[str, Any], fqn: str, w: torch.Tensor) -> torch.Tensor | None:
    name = fqn[: -len("weight")] + "bias"
    b = sd.get(name)
    if isinstance(b, torch.Tensor) and tuple(b.shape) == (w.shape[0],) and b.is_floating_point():
        return b.detach().to(device=w.device, dtype=w.dtype)
    return None


def _linear_bias(model: nn.Module, name: str, target: targets.Target, w: torch.Tensor) -> torch.Tensor | None:
    if target.expert is not None or not name.endswith("weight"):
        return None
    bias = name[: -len("weight")] + "bias"
    try:
        return _find_bias({bias: model.get_parameter(bias)}, name, w)
    except AttributeError:
        return None


def _kinds_from_weight(w: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """The tile kinds `_infer_from_weight` gives (2:4 iff every group of 4 holds at most 2 nonzeros), without
    working out the patterns: a count of nonzeros per group."""
    nz = to_tiles(w != 0, tile).view(torch.uint8)  # padding is zero: never counts
    per_group = nz.reshape(*nz.shape[:3], tile[1] // 4, 4).sum(-1, dtype=torch.uint8)
    sparse = (per_group <= 2).flatten(2).all(-1)
    return torch.where(sparse, TILE_SPARSE24, TILE_DENSE).to(torch.uint8)


def _infer_from_weight(w: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Kinds and a mask for already-pruned weights (see `TilePlan.from_weights`)."""
    b1, b2 = tile
    nz = to_tiles(w != 0, tile)  # padding is zero: never counts
    codes = group_codes(nz.reshape(*nz.shape[:3], b2 // 4, 4))  # (Tn, Tk, b1, G)
    pidx = COVER_PATTERN.to(w.device)[codes]
    sparse = (pidx >= 0).flatten(2).all(-1)
    kinds = torch.where(sparse, TILE_SPARSE24, TILE_DENSE).to(torch.uint8)
    kept = PATTERNS.to(w.device)[pidx.clamp(min=0)].reshape(nz.shape)
    mask = from_tiles(kept | ~sparse[:, :, None, None], tuple(w.shape))
    return kinds, mask
