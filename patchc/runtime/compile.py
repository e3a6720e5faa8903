"""`patchc.compile(model, plan)`: swap every planned nn.Linear for a tuned `TileLinear`.

Steps: copy the model (unless `inplace`), write the plan's pruned weights into it (`plan.apply`, so tied
weights and all-dense layers match the pruned dense model exactly), tune (see `tune`), then replace each
nn.Linear whose weight ``<module path>.weight`` is planned with a `TileLinear`. Layers without a 2:4 tile
stay nn.Linear (cuBLAS); planned weights that are not an nn.Linear's (e.g. a tied embedding) only get
the pruned values.

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
from typing import Any

import torch
from torch import nn

from patchc.runtime.dispatch import TileLinear
from patchc.runtime.timing import TimeFn
from patchc.runtime.tuner import LayerTuning, tune_plan

log = logging.getLogger(__name__)
TUNE_MODES = (True, False, "cached")


def compile(  # noqa: A001  (the public name the API asks for: patchc.compile)
    model: nn.Module,
    plan: Any,
    batch_size: int = 16,
    prefill_len: int = 128,
    tune: bool | str = True,
    *,
    inplace: bool = False,
    cache: Any = None,
    time_fn: TimeFn | None = None,
    progress: bool = False,
) -> nn.Module:
    """The model with its planned linears replaced by `TileLinear` (on a copy unless `inplace`).

    `plan`: a TilePlan or a path to a saved plan. `cache` / `time_fn`: passed to `tune_plan`.

    Example:
        >>> fast = patchc.compile(model, plan, tune=False)   # CPU: reference kernels, default configs
        ... # doctest: +SKIP
    """
    from patchc.ir import TilePlan

    if tune not in TUNE_MODES:
        raise ValueError(f"patchc.compile: tune must be one of {TUNE_MODES}, got {tune!r}")
    if isinstance(plan, (str, os.PathLike)):
        plan = TilePlan.load(plan)
    target = model if inplace else copy.deepcopy(model)
    plan.apply(target)
    swaps = _planned_linears(target, plan)
    if not swaps:
        log.warning("patchc.compile: no nn.Linear with a 2:4 tile is planned; the model is unchanged")
        return target
    first = next(iter(swaps.values()))[1].weight
    tunings = _tunings(plan, list(swaps), batch_size, prefill_len, tune, first, cache, time_fn, progress)
    for fqn, (parent_attr, linear) in swaps.items():
        parent, attr = parent_attr
        w = linear.weight
        mod = TileLinear.from_plan(plan.layers[fqn], tunings.get(fqn), dtype=w.dtype, device=w.device,
                                   batch_size=batch_size, prefill_len=prefill_len)
        if linear.bias is not None and mod.bias is None:
            mod.register_buffer("bias", linear.bias.detach().clone())  # the plan had none: keep the model's
        setattr(parent, attr, mod)
    return target


def _planned_linears(model: nn.Module, plan: Any) -> dict[str, tuple[tuple[nn.Module, str], nn.Linear]]:
    """{fqn: ((parent, attribute), linear)} for planned nn.Linear weights that hold a 2:4 tile."""
    out = {}
    skipped = []
    for fqn, layer in plan.layers.items():
        path, _, leaf = fqn.rpartition(".")
        if leaf != "weight":
            skipped.append(fqn)
            continue
        try:
            module = model.get_submodule(path)
        except AttributeError:
            skipped.append(fqn)
            continue
        if not isinstance(module, nn.Linear):
            skipped.append(fqn)
            continue
        if int((layer.kinds == 1).sum()) == 0:
            continue  # all dense: F.linear (cuBLAS) is the fastest kernel for it
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        out[fqn] = ((parent, attr), module)
    if skipped:
        log.info("patchc.compile: planned weights kept dense in place (not an nn.Linear weight): %s", skipped)
    return out


def _tunings(plan: Any, names: list[str], batch_size: int, prefill_len: int, tune: bool | str,
             weight: torch.Tensor, cache: Any, time_fn: TimeFn | None, progress: bool) -> dict[str, LayerTuning | None]:
    """Tuning results per layer, or {} where the defaults apply."""
    if tune is False:
        return {}
    kw = dict(dtype=weight.dtype, device=weight.device, cache=cache, progress=progress, layers=names)
    if tune == "cached":
        return tune_plan(plan, batch_size, prefill_len, time_fn=time_fn or _no_timing, cached_only=True, **kw)
    if weight.device.type != "cuda" and time_fn is None:
        log.info("patchc.compile: the model is on %s; tuning needs a GPU, using the default configs",
                 weight.device)
        return {}
    return tune_plan(plan, batch_size, prefill_len, time_fn=time_fn, **kw)


def _no_timing(fn: Any) -> float:
    raise RuntimeError("tune='cached' never times a kernel")  # pragma: no cover
