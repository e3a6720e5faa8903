"""Which weights a plan belongs to: per-layer fingerprints of the dense weights, checked by `apply`.

A plan stores its kept weights, so `plan.apply(model)` on a model with the same shapes but other
weights would silently paste the plan's weights in. Two checks stop that, both robust to the model
being loaded in another dtype than the plan was made in:

  * a plan made from dense weights (hardening, `from_masks`) records in `meta["fingerprints"]` per
    layer the weight's norm and 64 values at positions fixed by the shape; the model's weight must
    match them to the coarser dtype's rounding;
  * a plan without fingerprints (older files, `from_weights`) is checked on its kept positions: the
    model's weights there must equal the plan's (a dense original or an already pruned copy both do);
  * a model the plan was already applied to (its weights are W * M) is accepted either way;
  * a planned layer's bias, which the plan carries unchanged from its source, must equal the model's: a bias
    changed after planning (fine-tuned) would otherwise be replaced by the stale one without a word.

Example:
    >>> plan.meta["fingerprints"] = fingerprints({"fc.weight": w})
    >>> check_weights(plan, model)          # raises PlanError naming the first layer that differs
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from patchc.ir import targets
from patchc.ir.errors import PlanError

SAMPLES = 64
_FORCE = "load the model it was made from, or pass force=True (`patchc eval --force`) to write its weights anyway"


def _positions(shape: tuple[int, ...], count: int = SAMPLES) -> torch.Tensor:
    """Flat indices fixed by the shape alone, so the same layer samples the same weights everywhere."""
    numel = 1
    for s in shape:
        numel *= int(s)
    gen = torch.Generator().manual_seed(hash_shape(shape))
    return torch.randint(0, max(numel, 1), (min(count, numel),), generator=gen)


def hash_shape(shape: tuple[int, ...]) -> int:
    value = 1469598103934665603  # FNV-1a: stable across processes, unlike hash()
    for s in shape:
        value = ((value ^ int(s)) * 1099511628211) % (1 << 63)
    return value


def fingerprint(weight: torch.Tensor, chunk: int = 1 << 22) -> dict:
    """{"dtype", "norm", "sample"} of one dense weight (a few hundred bytes of JSON).

    Computed where the weight lives, `chunk` elements at a time in fp64: never an fp64 copy of the whole
    weight (4 GB for a 128K-vocabulary head) nor, for a GPU weight, a copy to the host."""
    w = weight.detach()
    flat = w.reshape(-1)
    squares = torch.zeros((), dtype=torch.float64, device=w.device)
    for part in flat.split(chunk):
        wide = part.to(torch.float64)
        squares += torch.dot(wide, wide)
    sample = flat[_positions(tuple(w.shape)).to(w.device)].to("cpu", torch.float64)
    return {
        "dtype": str(weight.dtype).removeprefix("torch."),
        "norm": float(squares.sqrt()),
        "sample": [float(v) for v in sample],
    }


def fingerprints(weights: Mapping[str, torch.Tensor]) -> dict[str, dict]:
    """`fingerprint` of each named weight, for `plan.meta["fingerprints"]`."""
    return {name: fingerprint(w) for name, w in weights.items()}


def _eps(*dtypes: torch.dtype | str) -> float:
    eps = 0.0
    for d in dtypes:
        d = getattr(torch, d) if isinstance(d, str) else d
        eps = max(eps, torch.finfo(d).eps if d.is_floating_point else 0.0)
    return eps


def fingerprint_mismatch(fqn: str, recorded: Mapping, weight: torch.Tensor) -> str | None:
    """Why `weight` is not the weight `recorded` was taken from, or None if it is."""
    eps = _eps(recorded.get("dtype", "float32"), weight.dtype)
    now = fingerprint(weight)
    norm_a, norm_b = float(recorded["norm"]), now["norm"]
    if abs(norm_a - norm_b) > 4 * eps * max(abs(norm_a), abs(norm_b)) + 1e-30:
        return f"layer {fqn}: the model's weight has norm {norm_b:.6g}, the plan was made from one of norm {norm_a:.6g}"
    a = torch.tensor(recorded["sample"], dtype=torch.float64)
    b = torch.tensor(now["sample"], dtype=torch.float64)
    if a.shape != b.shape:
        return f"layer {fqn}: the fingerprint has {a.numel()} samples, the model's weight gives {b.numel()}"
    scale = max(float(a.abs().max()) if a.numel() else 0.0, 1e-30)
    bad = (a - b).abs() > 2 * eps * torch.maximum(a.abs(), b.abs()) + eps * scale * 1e-3
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        return (f"layer {fqn}: {int(bad.sum())} of {a.numel()} sampled weights differ from the weights the plan "
                f"was made from (e.g. {float(b[i]):.6g} vs {float(a[i]):.6g})")
    return None


def _rounding_apart(layer, weight: torch.Tensor, where: torch.Tensor | None = None):
    """(plan's W * M, model's weight, mask of entries further apart than the coarser dtype's rounding, within
    `where` (a bool mask) or the whole weight). In fp32 unless either is fp64: two fp32 values within a
    factor of 2 of each other subtract exactly, and any further apart are far beyond the tolerance."""
    wide = torch.float64 if torch.float64 in (layer.dtype, weight.dtype) else torch.float32
    ours = layer.to_dense().to(weight.device, wide)
    theirs = weight.detach().to(wide)
    eps = _eps(layer.dtype, weight.dtype)
    bad = (ours - theirs).abs() > 2 * eps * torch.maximum(ours.abs(), theirs.abs())
    return ours, theirs, bad if where is None else bad & where


def kept_mismatch(fqn: str, layer, weight: torch.Tensor) -> str | None:
    """Why `weight` disagrees with the plan's kept values (for plans without fingerprints), or None."""
    mask = layer.mask().to(weight.device)
    ours, theirs, bad = _rounding_apart(layer, weight, mask)
    if bool(bad.any()):
        worst = float(torch.where(mask, (ours - theirs).abs(), 0).max())
        return (f"layer {fqn}: {int(bad.sum()):,} of {int(mask.sum()):,} kept weights differ from the model's "
                f"(max |diff| {worst:.3g})")
    return None


def _is_applied(layer, weight: torch.Tensor) -> bool:
    """Whether `weight` is this layer's W * M (to the coarser dtype's rounding)."""
    return not bool(_rounding_apart(layer, weight)[2].any())


def weight_mismatch(plan, fqn: str, weight: torch.Tensor) -> str | None:
    """Why the (N, K) `weight` is neither plan layer `fqn`'s source weight nor its W * M, or None."""
    recorded = plan.meta.get("fingerprints") or {}
    layer = plan.layers[fqn]
    why = fingerprint_mismatch(fqn, recorded[fqn], weight) if fqn in recorded else kept_mismatch(fqn, layer, weight)
    if why and fqn in recorded and _is_applied(layer, weight):
        return None  # the plan was already applied to this model: W * M is its own weight
    return why


def model_bias(model: torch.nn.Module, target: targets.Target, layer) -> torch.Tensor | None:
    """The model's `<module>.bias` a layer's plan bias stands for, or None (none planned, or no match)."""
    if layer.bias is None or target.expert is not None:
        return None
    name = target.param.rsplit(".", 1)[0] + ".bias" if "." in target.param else "bias"
    try:
        bias = model.get_parameter(name)
    except AttributeError:
        return None
    return bias if tuple(bias.shape) == tuple(layer.bias.shape) else None


def bias_mismatch(fqn: str, layer, bias: torch.Tensor | None) -> str | None:
    """Why the model's `bias` is not plan layer `fqn`'s (to the coarser dtype's rounding), or None."""
    if layer.bias is None or bias is None:
        return None
    wide = torch.float64 if torch.float64 in (layer.bias.dtype, bias.dtype) else torch.float32
    ours, theirs = layer.bias.to(bias.device, wide), bias.detach().to(wide)
    bad = (ours - theirs).abs() > 2 * _eps(layer.bias.dtype, bias.dtype) * torch.maximum(ours.abs(), theirs.abs())
    if not bool(bad.any()):
        return None
    return (f"layer {fqn}: {int(bad.sum())} of {bad.numel()} bias values differ from the plan's (max |diff| "
            f"{float((ours - theirs).abs().max()):.3g}; a bias changed since the plan was made is not its source)")


def check_weights(plan, model: torch.nn.Module) -> None:
    """Raise `PlanError` naming the first planned layer whose model weight (or bias) is not the plan's source."""
    where = plan.meta.get(targets.META_KEY)
    for fqn in plan.layers:
        target = targets.resolve(model, fqn, where)
        weight = targets.read(model, target)  # (N, K), also for experts / Conv1D
        layer = plan.layers[fqn]
        why = weight_mismatch(plan, fqn, weight) or bias_mismatch(fqn, layer, model_bias(model, target, layer))
        if why:
            raise PlanError(f"{why}: this plan was made for other weights (another checkpoint or model); {_FORCE}")
