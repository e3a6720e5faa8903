"""One-shot pruning: magnitude, Wanda and SparseGPT, as baselines and as priors for learned masks.

    calib = patchc.calibrate(model, batches)          # per-layer input statistics
    masks = patchc.oneshot(model, "sparsegpt", "2:4", calib=calib)   # {plan layer name: bool (N, K)}
    apply_masks(model, masks)                          # the one-shot baseline (expert slices, Conv1D too)
    plan  = patchc.TilePlan.from_masks(model, masks, tile=(16, 16))

Patterns:
- "2:4": 2 of every 4 consecutive weights along K kept (sparsity 0.5).
- "unstructured": each row prunes floor(sparsity * K + 1/2) weights.
- "tiles": dense / 2:4 tiles. The unstructured one-shot mask at the target density ranks tiles by
  kept fraction; the top round(2 * n_tiles * (density - 0.5)) stay dense, the rest take the
  one-shot 2:4 mask (needs `tile=`).

Beside the pipeline: the transform takes its priors from here, and the job its baselines.

    calibrate.py    input statistics per layer (Wanda norms, SparseGPT Hessians), observers for masked programs
    observe.py      a plain model's layers under plan names (Linear, Conv1D, fused experts) and their observers
    magnitude.py, wanda.py, sparsegpt.py    the methods' scores / OBS updates
    patterns.py     masks from scores: 2:4, unstructured, tiles
    priors.py       initial logits from one-shot masks (2:4 pattern scores, dense-tile choice)
    mask_files.py   the published PATCH and MaskLLM `.npz` mask formats (`patchc.masks`)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from patchc.pruning.calibrate import Calibration, InputStats, calibrate, default_layers
from patchc.pruning.magnitude import magnitude_scores
from patchc.pruning.observe import layer_matrix
from patchc.pruning.patterns import check_sparsity, check_tile, mask_24, mask_unstructured, merge_tiles
from patchc.pruning.priors import dense_tiles
from patchc.pruning.sparsegpt import check_hessian, factor_of, shared_factors, sparsegpt
from patchc.pruning.wanda import wanda_scores

METHODS = ("magnitude", "wanda", "sparsegpt")
PATTERNS = ("2:4", "unstructured", "tiles")
NEEDS_CALIB = ("wanda", "sparsegpt")


def _hessian(stats: Any, name: str) -> torch.Tensor:
    if isinstance(stats, torch.Tensor):
        if stats.dim() != 2:
            raise ValueError(f"{name}: SparseGPT needs a (K, K) Hessian, got a tensor of shape {tuple(stats.shape)}")
        return stats
    if not getattr(stats, "has_hessian", True):
        raise ValueError(f"{name}: SparseGPT needs the layer's Hessian: calibrate with hessian=True (the default)")
    return stats.hessian


def _sq_norm(stats: Any) -> torch.Tensor:
    if isinstance(stats, torch.Tensor):
        return stats.diagonal() if stats.dim() == 2 else stats  # diag(X^T X) is the squared channel norm
    return stats.sq_norm


def _check_args(method: str, pattern: str, sparsity: float, stats: Any, name: str) -> None:
    if method not in METHODS:
        raise ValueError(f"{name}: unknown one-shot method {method!r}; choose one of {METHODS}")
    if pattern not in PATTERNS:
        raise ValueError(f"{name}: unknown pattern {pattern!r}; choose one of {PATTERNS}")
    if method in NEEDS_CALIB and stats is None:
        raise ValueError(
            f"{name}: method={method!r} needs calibration statistics: calib = patchc.calibrate(model, batches)"
        )
    if pattern == "2:4" and float(sparsity) != 0.5:
        raise ValueError(
            f"{name}: pattern='2:4' always prunes half (sparsity 0.5), got sparsity={sparsity}; "
            "use pattern='tiles' or 'unstructured' for another sparsity"
        )
    if pattern == "tiles":
        check_sparsity(sparsity, name, upper=0.5)
    else:
        check_sparsity(sparsity, name)


def prune_weight(
    weight: torch.Tensor,
    method: str = "sparsegpt",
    pattern: str = "2:4",
    stats: Any = None,
    sparsity: float = 0.5,
    tile: tuple[int, int] | None = None,
    update_weights: bool = False,
    blocksize: int = 128,
    percdamp: float = 0.01,
    name: str = "weight",
):
    """One-shot mask of one weight (N, K); with update_weights=True returns (mask, new weight).

    Args:
        weight: (N, K) weight (not modified).
        method: "magnitude", "wanda" or "sparsegpt".
        pattern: "2:4", "unstructured" or "tiles".
        stats: `InputStats` of the layer's inputs (Wanda, SparseGPT), or a (K, K) Hessian tensor,
            or a (K,) tensor of squared channel norms (Wanda only).
        sparsity: fraction pruned ("2:4": must be 0.5; "tiles": in [0, 0.5]).
        tile: (b1, b2) for pattern="tiles".
        update_weights: also return the weight after pruning: SparseGPT's OBS-updated weight
            (pruned entries 0), or weight * mask for the other methods.
        blocksize, percdamp: SparseGPT's lazy-update block width and relative damping.
        name: weight FQN for messages.

    Example:
        >>> mask = prune_weight(w, "wanda", "2:4", stats=calib["fc.weight"])
        >>> mask, w_new = prune_weight(w, "sparsegpt", "unstructured", stats, sparsity=0.35, update_weights=True)
    """
    _check_args(method, pattern, sparsity, stats, name)
    if weight.dim() != 2:
        raise ValueError(f"{name}: one-shot pruning needs a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.detach()
    if method == "sparsegpt":
        # SparseGPT updates W^T in place after `.T.contiguous()`, which is no copy when W is a transposed
        # view (a Conv1D weight, an experts module with is_transposed): it would write the model.
        w = w.contiguous()
        hessian = _hessian(stats, name)
        check_hessian(hessian, w.shape[1], name)  # before factoring it
        factor = factor_of(stats, hessian, w.device, percdamp, name)
        kw = dict(blocksize=blocksize, percdamp=percdamp, name=name, factor=factor)
        if pattern == "tiles":
            tile = check_tile(tile)
            loose, _ = sparsegpt(w, hessian, "unstructured", sparsity, **kw)
            m24, _ = sparsegpt(w, hessian, "2:4", **kw)
            mask = merge_tiles(dense_tiles(loose, tile, 1.0 - float(sparsity)), m24, tile)
            if not update_weights:
                return mask
            # The OBS update for the hybrid mask itself: one more pass with the mask fixed.
            return sparsegpt(w, hessian, mask=mask, **kw)
        mask, new = sparsegpt(w, hessian, pattern, sparsity, **kw)
        return (mask, new) if update_weights else mask

    if method == "magnitude":
        scores = magnitude_scores(w)
    else:
        scores = wanda_scores(w, _sq_norm(stats), name)
    if pattern == "2:4":
        mask = mask_24(scores, name)
    elif pattern == "unstructured":
        mask = mask_unstructured(scores, sparsity, name)
    else:
        tile = check_tile(tile)
        loose = mask_unstructured(scores, sparsity, name)
        mask = merge_tiles(dense_tiles(loose, tile, 1.0 - float(sparsity)), mask_24(scores, name), tile)
    return (mask, w * mask) if update_weights else mask


def _weight_of(model: Any, fqn: str) -> torch.Tensor:
    if hasattr(model, "observe_inputs") and hasattr(model, "weight"):
        return model.weight(fqn)  # a MaskedProgram: weights live in its graph module
    return layer_matrix(model, fqn)  # (N, K): a Conv1D weight's transpose, an expert's slice (views)


def apply_masks(model: torch.nn.Module, masks: Mapping[str, torch.Tensor],
                recorded: Mapping[str, Mapping] | None = None) -> torch.nn.Module:
    """Zero the weights `masks` drops ({plan layer name: bool (N, K)}, True = kept), in place; returns `model`.

    Names are plan layer names (`patchc.ir.targets`): a Conv1D weight is masked as its transpose, and
    "<param>.<e>" masks expert e's slice of a fused 3-D weight only. `recorded`: a plan's
    `meta["targets"]`, for layers the model alone cannot place.

    Example:
        >>> masks = patchc.oneshot(model, "wanda", "2:4", calib=calib)
        >>> apply_masks(model, masks)          # the one-shot baseline
    """
    from patchc.ir import targets

    with torch.no_grad():
        for name, mask in masks.items():
            view = targets.read(model, targets.resolve(model, name, recorded))
            if tuple(mask.shape) != tuple(view.shape):
                raise ValueError(f"apply_masks: layer {name}: mask {tuple(mask.shape)} != (N, K) {tuple(view.shape)}")
            view.mul_(mask.to(device=view.device, dtype=view.dtype))
    return model


def oneshot(
    model: Any,
    method: str = "sparsegpt",
    pattern: str = "2:4",
    calib: Mapping[str, InputStats] | None = None,
    sparsity: float = 0.5,
    tile: tuple[int, int] | None = None,
    update_weights: bool = False,
    layers: Iterable[str] | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """One-shot masks for a model's layers: {plan layer name: bool (N, K), True = kept}.

    Args:
        model: an nn.Module (default layers: those `patchc.transform` masks, as `calibrate`'s
            `default_layers`: nn.Linear, Conv1D as its (N, K) transpose, "<param>.<e>" per fused expert)
            or a `MaskedProgram` (default: its masked layers).
        method: "magnitude" | "wanda" | "sparsegpt" (the last two need `calib`).
        pattern: "2:4" | "unstructured" (with sparsity=) | "tiles" (with sparsity= and tile=).
        calib: `patchc.calibrate(model, batches)`.
        update_weights: write the pruned weights into the model's parameters: SparseGPT's
            OBS-updated weights, W * M for the other methods. False leaves the model untouched.
            (A MaskedProgram's weights share storage with the exported model: they change too.)
        layers: weight FQNs to prune (default as above). For "2:4" and "tiles", default layers
            whose K is not a multiple of 4 are skipped with a warning; named ones raise.

    Example:
        >>> masks = oneshot(model, "wanda", "unstructured", calib=calib, sparsity=0.35)
    """
    _check_args(method, pattern, sparsity, calib, "oneshot")
    explicit = layers is not None
    names = list(layers) if explicit else list(default_layers(model))
    if method in NEEDS_CALIB:
        missing = [f for f in names if f not in calib]
        if missing:
            raise ValueError(
                f"oneshot(method={method!r}): no calibration statistics for {missing}; "
                "calibrate these layers (calibrate(model, batches, layers=...)) or leave them out (layers=...)"
            )
    from tqdm.auto import tqdm

    masks: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for fqn in names:  # every weight before any work: a NaN surfaces later as a Hessian or sort error
        bad = int((~torch.isfinite(_weight_of(model, fqn).detach())).sum())
        if bad:
            raise ValueError(f"oneshot: layer {fqn}: the weight holds {bad:,} NaN/inf values; fix the model first")
    with shared_factors():  # q, k, v (gate, up) share their input's statistics: one SparseGPT factor
        for fqn in tqdm(names, desc=f"oneshot {method} {pattern}", disable=not progress, leave=False):
            param = _weight_of(model, fqn)
            if pattern in ("2:4", "tiles") and param.shape[-1] % 4 and not explicit:
                skipped.append(fqn)
                continue
            stats = calib[fqn] if method in NEEDS_CALIB else None
            out = prune_weight(
                param, method, pattern, stats, sparsity, tile, update_weights, blocksize, percdamp, name=fqn
            )
            if update_weights:
                mask, new = out
                with torch.no_grad():
                    param.copy_(new.to(param.dtype))
            else:
                mask = out
            masks[fqn] = mask
    if skipped:
        warnings.warn(f"oneshot: skipped layers whose in_features is not a multiple of 4: {skipped}", stacklevel=2)
    return masks


__all__ = [
    "apply_masks",
    "oneshot",
    "prune_weight",
    "calibrate",
    "Calibration",
    "InputStats",
    "METHODS",
    "PATTERNS",
]

