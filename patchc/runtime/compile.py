"""`patchc.compile(model, plan)`: swap every planned nn.Linear for a tuned `TileLinear`.

Steps: check the model holds the plan's source weights, copy it (unless `inplace`; the weights the swap
removes are not copied), write the plan's pruned
weights into every planned weight the model keeps (`plan.apply`, so tied weights and all-dense layers match
the pruned dense model exactly; a weight only the replaced modules read is skipped, as it leaves with
them), tune (see `tune`), then replace each
nn.Linear / Conv1D whose weight is planned (every user of a tied weight) with a `TileLinear`, and each
fused-experts module with planned expert slices with a `TileExperts` (`TileBmmExperts` for Llama 4's,
which multiply every expert's rows at once, their block becoming a `TileLlama4Moe` that hands them the
router's picks only; `TileFlatExperts` for DBRX's, whose flat plans are cut per expert). Layers without a
2:4 tile stay nn.Linear (cuBLAS); other planned weights only get the pruned values, and a warning lists them.

Fused experts get one tuning per projection, that of its first planned slice (the slices share a shape).

`tune`: True -> tune here on a CUDA model (cache-backed: a tuned setup is read, not re-timed); on a CPU
model nothing can be timed and the architecture-table defaults are used. "cached" -> only read the cache
(misses use the defaults). False -> the defaults.

Example:
    >>> fast = patchc.compile(model.cuda().half(), plan, batch_size=16, prefill_len=128)  # doctest: +SKIP
    >>> logits = fast(ids)                                                                 # doctest: +SKIP
"""

from __future__ import annotations

import copy
import logging
import os
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

from patchc.ir.targets import held_experts, is_conv1d, why_experts_unserved
from patchc.runtime.dispatch import TileLinear, report_unreplaced
from patchc.models.traceable_experts import _is_llama4_moe
from patchc.runtime.experts import TileBmmExperts, TileExperts, TileLlama4Moe, experts_module
from patchc.runtime.flat_experts import TileFlatExperts, flat_layers, flat_owner, flat_slices, is_flat, why_unserved
from patchc.runtime.saving import give_save_pretrained
from patchc.runtime.timing import TimeFn
from patchc.runtime.tuner import LayerTuning, tune_plan

log = logging.getLogger(__name__)
TUNE_MODES = (True, False, "cached")


def compile(  # noqa: A001  (the public name the API asks for: patchc.compile)
    model: nn.Module,
    plan: Any = None,
    batch_size: int = 16,
    prefill_len: int = 128,
    tune: bool | str = True,
    *,
    inplace: bool = False,
    cache: Any = None,
    time_fn: TimeFn | None = None,
    progress: bool = False,
    strict: bool = False,
    force: bool = False,
    device: Any = None,
    release_plan: bool = False,
) -> nn.Module:
    """The model with its planned linears replaced by `TileLinear` (on a copy unless `inplace`).

    `plan`: a TilePlan or a path to a saved plan; None: the model is already 2:4 or hybrid (pruned by
    any tool), and its linear weights' zeros are the plan (`TilePlan.from_linears`: 128 x 128 tiles for a model
    2:4 throughout, the widest square that keeps its 2:4 tiles for a hybrid one).
    `cache` / `time_fn`: passed to `tune_plan`.
    Replaced: nn.Linear (and subclasses, e.g. Falcon's `x @ W.T`), transformers' `Conv1D` (K x N
    storage), every module sharing a tied planned weight, and fused MoE experts (`TileExperts`,
    `TileBmmExperts`; Llama 4's block with them, `TileLlama4Moe`).
    Planned layers with a 2:4 tile that could not be replaced are listed in a warning
    (`strict=True`: a ValueError); they keep the plan's pruned values in place either way.
    A model whose weights are not the plan's source is refused (`plan.apply`); `force=True` writes anyway.
    `device`: where the replacements' packed buffers go and tuning runs (default: each replaced weight's own
    device, so a model split over GPUs stays split); the rest of the model stays where it is. A weight only
    replaced modules read is never written: on a CPU model with `device="cuda"`, the planned weights never
    take their dense size anywhere (`from_pretrained` loads so). `release_plan`: drop each replaced layer from
    `plan.layers` once it is packed, so its memory goes as the model fills (for a plan not used again; a
    plan read off the model's zeros is always released). A transformers model's `save_pretrained` then writes the
    pruned model it serves, W * M in each replaced weight's place (`patchc.runtime.saving`).

    Example:
        >>> fast = patchc.compile(model, plan, tune=False)   # CPU: reference kernels, default configs
        >>> fast = patchc.compile(wanda_2of4_model)            # the plan read off its zeros
        ... # doctest: +SKIP
    """
    from patchc.ir import TilePlan, targets
    from patchc.ir.errors import PlanError
    from patchc.ir.provenance import check_weights

    if tune not in TUNE_MODES:
        raise ValueError(f"patchc.compile: tune must be one of {TUNE_MODES}, got {tune!r}")
    if plan is None:
        plan = TilePlan.from_linears(model)
        force = release_plan = True  # packed from these very weights: nothing to check; nobody else holds it
        if not plan.layers:
            none = ValueError(f"patchc.compile: no linear weight (nn.Linear, Conv1D, fused experts) of the "
                              f"{type(model).__name__} holds a 2:4 tile (not even a 16 x 16 tile whose every "
                              "group of 4 keeps at most 2 weights); pass the plan, or prune the model first "
                              "(patchc.oneshot, patchc prune)")
            raise _already_compiled(model, ValueError("no plan layer: its weights are packed already")) or none
    elif isinstance(plan, (str, os.PathLike)):
        plan = TilePlan.load(plan)
    try:
        where = targets.resolve_layers(plan, model)  # every layer found, in its shape, before anything changes
    except PlanError as exc:
        raise _already_compiled(model, exc) or exc from None
    if not force:
        check_weights(plan, model)  # the model must hold the weights the plan was made from
    target = model if inplace else copy_keeping(model, plan)  # `where` names parameters: the copy's too
    swaps, experts, missed = plan_swaps(target, plan)
    leaving = _leaving(target, plan, swaps, experts)
    # W * M where the model keeps a planned weight (layers left dense, unreplaced ones, fused experts with an
    # unplanned slice); one that leaves with the replaced modules never gets it: its dense values are never built
    kept = {fqn: layer for fqn, layer in plan.layers.items() if fqn not in leaving}
    TilePlan(layers=kept, meta=plan.meta).apply(target, force=True)
    report_unreplaced("patchc.compile", "not replaced (kept dense with the plan's values)", missed, strict)
    if not swaps and not experts:
        log.warning("patchc.compile: no planned layer with a 2:4 tile can be replaced; the model only has the "
                    "plan's pruned weights")
        return target
    device = torch.device(device) if device is not None else None
    w = (next(iter(swaps.values()))[0][2].weight if swaps else next(target.parameters()))
    # one tuning per fused weight: its slices share the shape (flat experts: once cut, below)
    firsts = _first_expert_slices({p: f for p, f in experts.items() if not is_flat(target.get_submodule(p))})
    names = [*swaps, *firsts.values()]
    tunings = _tunings(plan, names, batch_size, prefill_len, tune, w.dtype, device or w.device, cache, time_fn,
                       progress)
    for fqn, users in swaps.items():
        layer, owner = plan.layers[fqn], where[fqn].param.rpartition(".")[0]
        owner = target.get_submodule(owner) if owner else target
        for parent, attr, module in users:
            on = device or module.weight.device  # a model split over devices keeps each layer on its own
            mod = TileLinear.from_plan(layer, tunings.get(fqn), dtype=module.weight.dtype, device=on,
                                       batch_size=batch_size, prefill_len=prefill_len)
            mod.stored_kn = is_conv1d(module)
            # the plan's bias goes to the weight's owner (as plan.apply writes it); tied users keep their own
            bias = getattr(module, "bias", None)
            if layer.bias is not None and module is owner and _same_shape(bias, layer.bias):
                bias = layer.bias
            own = bias.detach().to(on, mod.values.dtype, copy=True) if isinstance(bias, torch.Tensor) else None
            mod.register_buffer("bias", own)
            setattr(parent, attr, mod)
        if release_plan:
            del plan.layers[fqn], layer  # packed into its TileLinears: the IR copy is not needed again
    for path in experts:
        parent_path, _, attr = path.rpartition(".")
        parent = target.get_submodule(parent_path) if parent_path else target
        module = target.get_submodule(path)
        if is_flat(module):  # cut into expert slices here, and tuned as its first ones
            slices = flat_slices(module, plan, path)
            flat_firsts = _first_expert_slices({path: [f for f, lp in slices.layers.items() if lp.n_sparse]})
            tuned = _tunings(slices, list(flat_firsts.values()), batch_size, prefill_len, tune, w.dtype,
                             device or w.device, cache, time_fn, progress)
            mine = {weight.rpartition(".")[2]: tuned.get(fqn) for weight, fqn in flat_firsts.items()}
            setattr(parent, attr, TileFlatExperts(module, slices, path, mine, device=device))
            continue
        mine = {weight.rpartition(".")[2]: tunings.get(fqn) for weight, fqn in firsts.items()
                if weight.rpartition(".")[0] == path}
        top_k = getattr(parent, "top_k", None)  # the block's router picks (Llama 4's hands every expert every row)
        llama4_block = _is_llama4_moe(parent)  # read before the swap: it checks the experts' own weights
        served = experts_module(module, plan, path, mine, device=device,
                                top_k=top_k if isinstance(top_k, int) else None)
        setattr(parent, attr, served)
        if llama4_block and isinstance(served, TileBmmExperts):  # the router's picks only, not E x T rows
            owner_path, _, name = parent_path.rpartition(".")
            setattr(target.get_submodule(owner_path) if owner_path else target, name, TileLlama4Moe(parent, served))
    give_save_pretrained(target)  # save_pretrained writes W * M, not the packed buffers transformers cannot load
    return target


def _already_compiled(model: nn.Module, exc: Exception) -> Exception | None:
    """The error to raise when a plan's layers are missing because patchc already replaced them (else None)."""
    served = (TileLinear, TileExperts, TileLlama4Moe)
    name = next((n for n, m in model.named_modules() if isinstance(m, served)), None)
    if name is None:
        return None
    return type(exc)(f"patchc.compile: the model is already compiled ({name or 'the model'} is a "
                     f"{type(model.get_submodule(name)).__name__}); compile the model the plan was made from, or use "
                     f"this one as it is ({exc})")


def copy_keeping(model: nn.Module, plan: Any) -> nn.Module:
    """A deep copy of `model` without the weights that leave it with the replaced modules: each is a
    stand-in of the same shape, dtype and device holding one element (a zero-stride view), so copying a
    model to compile it takes the size of what stays (embeddings, norms, dense layers), not twice the model."""
    swaps, experts, _ = plan_swaps(model, plan)
    memo: dict[int, Any] = {}
    for w in {id(w): w for w in _leaving(model, plan, swaps, experts).values()}.values():
        stand_in = torch.empty((), dtype=w.dtype, device=w.device).expand(w.shape)
        memo[id(w)] = nn.Parameter(stand_in, requires_grad=w.requires_grad)
    return copy.deepcopy(model, memo)


def _leaving(model: nn.Module, plan: Any, swaps: dict[str, Users],
             experts: dict[str, list[str]]) -> dict[str, nn.Parameter]:
    """{planned layer: its weight} for the weights that leave the model with the replaced modules: a swapped
    layer's weight no other module registers, and a fused 3-D expert weight whose every slice is planned
    (the TileExperts is built from the plan alone; LongCat-Flash's rows for experts that compute nothing are never
    read) and that no other module registers."""
    registered = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    out = {fqn: users[0][2].weight for fqn, users in swaps.items() if registered[id(users[0][2].weight)] == len(users)}
    for path in experts:
        module = model.get_submodule(path)
        if is_flat(module):  # each planned flat weight: the drop-in is built from its plan
            flat = {name: getattr(module.mlp, w) for w, name in flat_layers(path).items()}
            out.update({f: w for f, w in flat.items() if f in plan.layers and registered[id(w)] == 1})
            continue
        held = held_experts(module)
        for proj in TileExperts.PROJECTIONS:
            w = getattr(module, proj, None)
            slices = [f"{path}.{proj}.{e}" for e in range(held)] if isinstance(w, nn.Parameter) else []
            if slices and all(f in plan.layers for f in slices) and registered[id(w)] == 1:
                out.update(dict.fromkeys(slices, w))
    return out


def _same_shape(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and tuple(a.shape) == tuple(b.shape)


def _first_expert_slices(experts: dict[str, list[str]]) -> dict[str, str]:
    """{"<experts module>.<projection>": its first planned expert slice with a 2:4 tile}."""
    firsts: dict[str, str] = {}
    for layers in experts.values():
        for fqn in sorted(layers, key=lambda f: int(f.rpartition(".")[2])):
            firsts.setdefault(fqn.rpartition(".")[0], fqn)
    return firsts


Users = list[tuple[nn.Module, str, nn.Module]]


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear (any subclass) or transformers' Conv1D (weight K x N, y = x @ W + b)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _users(model: nn.Module, param: torch.Tensor) -> Users:
    """Every (parent, attribute, module) whose `.weight` is `param` (tied weights have several)."""
    out = []
    for name, module in model.named_modules(remove_duplicate=False):
        if _is_linear(module) and module.weight is param:
            parent_path, _, attr = name.rpartition(".")
            out.append((model.get_submodule(parent_path) if parent_path else model, attr, module))
    return out


def plan_swaps(model: nn.Module, plan: Any) -> tuple[dict[str, Users], dict[str, list[str]], dict[str, str]]:
    """({layer: modules to replace}, {experts module path: its planned expert slices with a 2:4 tile, or its
    planned flat weights (DBRX's, `flat_experts`)}, {layer: why it is not replaced}).

    Layers without a 2:4 tile are left out on purpose (F.linear / cuBLAS is the fastest kernel for them).
    """
    from patchc.ir import targets

    swaps: dict[str, Users] = {}
    experts: dict[str, list[str]] = {}  # fused-experts module path -> its planned expert layers
    missed: dict[str, str] = {}
    for fqn, layer in plan.layers.items():
        if not layer.n_sparse:
            continue
        target = targets.resolve(model, fqn, plan.meta.get(targets.META_KEY))
        owner = target.param.rpartition(".")[0]
        if target.expert is not None:
            experts.setdefault(owner, []).append(fqn)
            continue
        users = _users(model, model.get_parameter(target.param))
        if users:
            swaps[fqn] = users
        elif (path := flat_owner(model, target.param)) is not None:
            experts.setdefault(path, []).append(fqn)
        else:
            kind = type(model.get_submodule(owner)).__name__ if owner else type(model).__name__
            missed[fqn] = f"read by a {kind} in its forward (e.g. torch.einsum / x @ W), not an nn.Linear / Conv1D"
    for path, layers in list(experts.items()):
        module = model.get_submodule(path)
        why = why_unserved(module, plan, path) if is_flat(module) else why_experts_unserved(module)
        if why is not None:
            del experts[path]
            missed.update({f: why for f in layers})
    return swaps, experts, missed


def _tunings(plan: Any, names: list[str], batch_size: int, prefill_len: int, tune: bool | str, dtype: torch.dtype,
             device: torch.device, cache: Any, time_fn: TimeFn | None, progress: bool,
             pack: Callable[[str], Any] | None = None) -> dict[str, LayerTuning | None]:
    """Tuning results per layer, or {} where the defaults apply (`pack`: as `tune_plan`'s)."""
    if tune is False:
        return {}
    kw = dict(dtype=dtype, device=device, cache=cache, progress=progress, layers=names, pack=pack)
    if tune == "cached":
        return tune_plan(plan, batch_size, prefill_len, time_fn=time_fn or _no_timing, cached_only=True, **kw)
    if device.type != "cuda" and time_fn is None:
        log.info("patchc.compile: the model is on %s; tuning needs a GPU, using the default configs", device)
        return {}
    return tune_plan(plan, batch_size, prefill_len, time_fn=time_fn, **kw)


def _no_timing(fn: Any) -> float:
    raise RuntimeError("tune='cached' never times a kernel")  # pragma: no cover
