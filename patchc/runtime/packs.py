"""The packed modules the dynamo backend gives a graph's planned weights, shared between the model's graphs.

Dynamo hands the backend one graph per shape regime and per graph break: `model.generate()` under
``torch.compile(model.forward, backend="patch")`` compiles the prompt, the first decode step, then a
graph dynamic in the length. Packing every planned weight anew for each would hold one packed copy of
the model per graph (and tune it again). Instead a packed module is recorded beside the weight Parameter
it replaces, for the plan layers it was packed from (matched by identity: another plan packs again), and
later graphs reuse it. A plan the backend infers from the zeros is new in every graph, so there the
weight's version counter and the tile stand for the layers (an in-place edit of the weight packs anew).
Weights, plan layers and modules are held weakly: the compiled graphs keep their modules alive, and an
entry goes when its module, plan or model does.

Example:
    >>> modules = linear_modules(plan, {node: ("layers.0.mlp.up_proj.weight", weight)}, {})  # doctest: +SKIP
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence, TypeVar

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from patchc.ir.provenance import bias_mismatch, weight_mismatch
from patchc.runtime.dispatch import TileLinear
from patchc.runtime.grouped import GroupedRead, grouped_module, planned_experts
from patchc.runtime.inferred import InferredPlan, built, packed_plan
from patchc.runtime.matmul_reads import Read

T = TypeVar("T")

# weight Parameter -> {(key, id of each source object): (weak refs to those objects, stamp, weak ref to the value)}
_SHARED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def shared(weight: torch.Tensor, sources: Sequence[Any], key: Hashable, build: Callable[[], T],
           stamp: Hashable = None) -> T:
    """`build()`'s value for (`weight`, `sources`, `key`), built once while it and they live.

    `sources` are the objects the value is built from (plan layers), matched by identity; `key` holds
    everything else the value depends on (dtype, batch size, ...); a value stored under another `stamp`
    (the weight's version) is built again. Sources and value are held weakly: whoever uses the value (the
    compiled graph) keeps it alive, and a value or source that is gone frees its entry.
    """
    entries = _SHARED.get(weight)
    if entries is None:
        entries = _SHARED[weight] = {}
    for slot in [s for s, entry in entries.items() if _dead(entry)]:
        del entries[slot]
    slot = (key, *map(id, sources))
    hit = entries.get(slot)
    if hit is not None and hit[1] == stamp and all(ref() is src for ref, src in zip(hit[0], sources)):
        return hit[2]() if isinstance(hit[2], weakref.ref) else hit[2]
    value = build()
    entries[slot] = (tuple(weakref.ref(src) for src in sources), stamp, value if value is None else weakref.ref(value))
    return value


def _dead(entry: tuple[tuple[weakref.ref, ...], Any, Any]) -> bool:
    refs, _, value = entry
    return any(ref() is None for ref in refs) or (isinstance(value, weakref.ref) and value() is None)


def infer_plan(reads: list[Read], grouped: list[GroupedRead], names: dict[fx.Node, str],
               examples: dict[fx.Node, Any], tile: Any) -> InferredPlan:
    """A plan from the zero pattern of the weights the graph reads as (N, K) (layers with a 2:4 tile only),
    one layer per expert slice of a grouped read's 3-D weight; a weight read as stored (K, N) is planned as
    its transpose and recorded so. Surveyed only: layers are packed when a module is built (`InferredPlan`)."""
    tile = tuple(tile) if not isinstance(tile, int) else (tile, tile)
    linear, experts = {}, {}
    for read in reads:
        if read.reason is None:
            linear.setdefault(names[read.weight], (examples[read.weight], read.transposed))
    for read in grouped:  # expert slices: named "<3-D weight>.<expert>", not "*.weight"
        if read.reason is None:
            experts.setdefault(names[read.weight], (examples[read.weight], read.transposed))
    return InferredPlan.survey(linear, experts, tile)


def linear_modules(plan: Any, weights: dict[fx.Node, tuple[str, torch.Tensor]],
                   options: dict[str, Any]) -> dict[fx.Node, tuple[str, TileLinear]]:
    """One TileLinear per planned weight placeholder ({placeholder: (fqn, weight)}), tuned, attached to
    nothing yet; each packed once for every graph of the model (`shared`)."""
    if not weights:
        return {}
    bs, pl = _sizes(options)
    tuned = _lazy_tunings(plan, sorted({f for f, _ in weights.values()}), next(iter(weights.values()))[1], options)
    out = {}
    for i, (node, (fqn, w)) in enumerate(weights.items()):
        build = lambda: built(plan, [fqn], TileLinear.from_plan(  # noqa: E731
            packed_plan(plan, [fqn]).layers[fqn], tuned().get(fqn), dtype=w.dtype, device=w.device, batch_size=bs,
            prefill_len=pl))
        sources, stamp = _identity(plan, [fqn], w)
        out[node] = (f"_patchc_{i}", shared(w, sources, ("linear", *_key(w, options)), build, stamp))
    return out


def expert_modules(plan: Any, reads: list[GroupedRead], names: dict[fx.Node, str], examples: dict[fx.Node, Any],
                   options: dict[str, Any]) -> dict[fx.Node, tuple[str, Any]]:
    """One `TileGroupedLinear` per served 3-D weight (every expert slice stacked), on one tuning: the tuner
    runs on its first planned slice only, since every slice has the same shape. Shared like `linear_modules`."""
    reads = list({r.weight: r for r in reads}.values())
    if not reads:
        return {}
    bs, pl = _sizes(options)
    experts = {r.weight: [f"{names[r.weight]}.{e}" for e in planned_experts(plan, names[r.weight],
                                                                             examples[r.weight].shape[0])]
               for r in reads}
    tuned = _lazy_tunings(plan, [experts[r.weight][0] for r in reads], examples[reads[0].weight], options)
    out = {}
    for i, r in enumerate(reads):
        w, first = examples[r.weight], experts[r.weight][0]
        build = lambda: built(plan, experts[r.weight], grouped_module(  # noqa: E731
            packed_plan(plan, experts[r.weight]), names[r.weight], r, w, tuned().get(first), bs, pl))
        sources, stamp = _identity(plan, experts[r.weight], w)
        key = ("grouped", r.transposed, *_key(w, options))
        out[r.weight] = (f"_patchc_x{i}", shared(w, sources, key, build, stamp))
    return out


def _identity(plan: Any, layers: list[str], w: torch.Tensor) -> tuple[tuple[Any, ...], Any]:
    """(sources, stamp) a packed module is matched by: its plan layers, or for an inferred plan (new in every
    graph) the weight's version, the tile and each layer's recorded orientation."""
    if not isinstance(plan, InferredPlan):
        return tuple(plan.layers[name] for name in layers), None
    targets = plan.meta.get("targets", {})
    return (), (w._version, tuple(plan.meta.get("tile", ())),
                tuple(bool(targets.get(name, {}).get("transposed")) for name in layers), tuple(layers))


def _key(w: torch.Tensor, options: dict[str, Any]) -> tuple[Any, ...]:
    """What a packed module depends on besides its plan layers."""
    return (w.dtype, w.device, *_sizes(options), repr(options.get("tune", True)), id(options.get("cache")),
            id(options.get("time_fn")))


def _sizes(options: dict[str, Any]) -> tuple[int, int]:
    """The (batch size, prefill length) the backend's options tune and pack for."""
    return int(options.get("batch_size", 16)), int(options.get("prefill_len", 128))


def _lazy_tunings(plan: Any, names: list[str], example: torch.Tensor, options: dict[str, Any]) -> Callable[[], dict]:
    """The tunings of `names`, computed (in one tuner call: one cache read) the first time a module is packed;
    of an inferred plan's layers, the tuner packs only the first of each tuning class."""
    from patchc.runtime.compile import _tunings

    done: list[dict] = []
    pack = (lambda fqn: plan.packed([fqn]).layers[fqn]) if isinstance(plan, InferredPlan) else None

    def get() -> dict:
        if not done:
            done.append(_tunings(plan, names, *_sizes(options), options.get("tune", True), example.dtype,
                                 example.device, options.get("cache"), options.get("time_fn"), False, pack))
        return done[0]

    return get


def held(weight: torch.Tensor) -> int:
    """How many live packed values are recorded for `weight` (for tests and memory checks)."""
    return sum(not _dead(entry) for entry in (_SHARED.get(weight) or {}).values())


# plans loaded from a path, by (path, mtime, size): held only while a compiled graph's options hold them
_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# weights already checked against a plan layer: {weight: {(id(layer), weight version)}}; a model's every graph
# reads the same weights, and the check reads each whole (a plan-applied one is compared value by value)
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def plan_option(plan: Any) -> Any:
    """The backend's `plan` option: a TilePlan, or a plan file's path (loaded once per file version while a
    compiled graph holds it, so the model's graphs share one plan and its packs)."""
    if not isinstance(plan, (str, os.PathLike)):
        return plan
    path = Path(plan).resolve()
    stat = path.stat()  # FileNotFoundError names the path
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    loaded = _LOADED.get(key)
    if loaded is None:
        from patchc.ir import TilePlan

        loaded = _LOADED[key] = TilePlan.load(path)
    return loaded


def served_sources(plan: Any, reads: list[Any], names: dict[Any, str],
                   examples: dict[Any, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{planned layer: (its graph parameter, the (N, K) matrix the plan has)} of the served reads: a 2-D
    read's weight, and each planned expert slice of a grouped read's 3-D weight."""
    out = {}
    for read in reads:
        value, name = examples[read.weight], names[read.weight]
        if not isinstance(read, GroupedRead):
            out[name] = (value, value.mT if read.transposed else value)
            continue
        out |= {f"{name}.{e}": (value, value[e].mT if read.transposed else value[e])
                for e in range(value.shape[0]) if f"{name}.{e}" in plan.layers}
    return out


def check_sources(plan: Any, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  biases: dict[str, torch.Tensor] | None = None) -> None:
    """ValueError naming the first planned layer whose graph weight ({fqn: (parameter, its (N, K) view)}) is
    neither the weight the plan was made from nor its W * M, or whose bias (`biases`: {fqn: the bias its read
    adds}) is not the plan's: the packed layer would serve the plan's weights beside this model's."""
    why = next(filter(None, (bias_mismatch(fqn, plan.layers[fqn], b) for fqn, b in (biases or {}).items())), None)
    for fqn, (param, w) in weights.items() if why is None else ():
        seen = _CHECKED.setdefault(param, set())
        key = (id(plan.layers[fqn]), param._version)
        if key not in seen:
            why = weight_mismatch(plan, fqn, w.detach())
            if why:
                break
            seen.add(key)
    if why:
        raise ValueError(f"patch backend: {why}: the plan was made for other weights (another checkpoint or "
                         "model); options={'force': True} serves the plan's weights anyway")


__all__ = ["check_sources", "expert_modules", "held", "infer_plan", "linear_modules", "plan_option", "served_sources",
           "shared"]
