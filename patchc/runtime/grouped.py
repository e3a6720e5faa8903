"""Fused MoE experts under the dynamo backend: the grouped reads `patchc::tile_grouped_mm` replaces.

transformers 5 runs fused experts (`gate_up_proj` / `down_proj`, 3-D) as one grouped matmul over the
tokens sorted by expert: ``grouped_mm(x (S, K), W (E, K, N), offs=ends)``, where W is the stored
(E, N, K) weight transposed (or the weight itself for experts stored (E, K, N)) and ``ends`` the
cumulative row count of each expert. Dynamo shows that call as ``torch.nn.functional.grouped_mm``,
``torch._grouped_mm`` or transformers' own ``transformers::grouped_mm_fallback``. The backend swaps it
for ``patchc::tile_grouped_mm`` (`patchc.runtime.grouped_op`): every expert's rows in one launch of the
hybrid kernels, the offsets read on the device, so the call can be captured in a CUDA graph.

Llama 4 multiplies every expert at once instead: ``bmm(x (E, T, K), W (E, K, N))``, each expert over the
same T rows (every token, scaled by its router score). That is a grouped mm whose row ends are T, 2T, ...:
the backend flattens x to (E * T, K), builds those offsets on the device from x's size, and views the
result back to (E, T, N) (`bmm_operands` / `bmm_result`). A graph traced without gradients sorts the rows
that are not all zero by expert first and leaves the zero ones past the last end: the rows of the experts a
token's router did not pick are scaled by 0, so only the picked experts' weights are read.

transformers' ``batched_mm`` experts gather a weight per (token, expert) pair instead:
``bmm(W[ids] (S, N, K), x (S, K, 1))``, or ``bmm(x (S, 1, K), W[ids] (S, K, N))`` for experts stored
(E, K, N). That moves S whole expert matrices per call. The backend sorts the S rows by expert on the
device, runs one grouped mm over them (row ends from a histogram of the ids) and puts the rows back in
their order (`gathered_operands` / `gathered_result`): each expert's weights are read once.

Example:
    >>> reads = find_grouped_reads(gm, examples)          # doctest: +SKIP
    >>> [(r.fqn, r.transposed, r.reason) for r in reads]  # doctest: +SKIP
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from patchc.ir.targets import row_ends
from patchc.runtime import grouped_op as _grouped_op  # noqa: F401  (registers torch.ops.patchc.tile_grouped_mm)
from patchc.runtime.matmul_reads import reads_attribute

_GROUPED_FUNCTIONS = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)
_GROUPED_OPS = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")
_CASTS = ("to", "type_as", "detach", "contiguous", "float", "half", "bfloat16")
_BMM_FUNCTIONS = (torch.bmm, torch.matmul, operator.matmul)


@dataclass
class GroupedRead:
    """One grouped matmul over the experts of 3-D weight placeholder `weight`: `transposed` when the
    weight is stored (E, K, N) (its slices are planned as their transposes); `reason` is None when
    `tile_grouped_mm` can serve it. `form` "bmm": x is (E, T, K), every expert over its own T rows, no offs;
    "gathered": x is (S, K, 1) or (S, 1, K), row s times expert ids[s]'s slice, no offs."""

    node: fx.Node
    x: Any
    operand: Any  # the (E, K, N) operand the call multiplies by, as the graph builds it
    offs: Any
    weight: fx.Node
    transposed: bool
    reason: str | None = None
    form: str = "grouped_mm"
    ids: Any = None  # form "gathered": each row's expert (S,), the index of W[ids]


def _target_name(target: Any) -> str | None:
    """"ns::op" for a torch.ops packet or overload, None for anything else."""
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_schema", None), "name", None)
    return name if isinstance(name, str) else None


def is_grouped_mm(node: fx.Node) -> bool:
    """Whether the node is a grouped matmul call (functional, torch._grouped_mm, aten or transformers' op)."""
    return node.op == "call_function" and (node.target in _GROUPED_FUNCTIONS or _target_name(node.target) in _GROUPED_OPS)


def is_expert_bmm(node: fx.Node) -> bool:
    """Whether the node is a batched matmul (bmm / matmul / @) that may multiply by a 3-D expert weight."""
    if node.op == "call_method":
        return node.target in ("bmm", "matmul", "__matmul__")
    return node.op == "call_function" and node.target in _BMM_FUNCTIONS


def _example(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _trace_expert_weight(node: Any, examples: dict[fx.Node, Any]) -> tuple[fx.Node, int] | None:
    """(3-D weight placeholder, number of swaps of its last two dims) behind an operand, or None."""
    swaps = 0
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method"):
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
        dims = sorted(d % 3 for d in node.args[1:] if isinstance(d, int))
        if name == "transpose" and dims == [1, 2]:
            swaps += 1
        elif reads_attribute(node, "mT"):
            swaps += 1
        elif not (node.op == "call_method" and name in _CASTS):
            return None
        node = node.args[0]
    value = examples.get(node) if isinstance(node, fx.Node) and node.op == "placeholder" else None
    if not isinstance(value, torch.nn.Parameter) or value.dim() != 3 or not value.is_floating_point():
        return None
    return node, swaps


def find_grouped_reads(gm: fx.GraphModule, examples: dict[fx.Node, Any]) -> list[GroupedRead]:
    """Every grouped matmul of `gm` whose weight operand is a 3-D weight placeholder, in graph order."""
    reads = []
    for node in gm.graph.nodes:
        if is_expert_bmm(node) and len(node.args) == 2:
            read = _gathered_read(node, examples) or _bmm_read(node, examples)
            if read is not None:
                reads.append(read)
            continue
        if not is_grouped_mm(node):
            continue
        operand = node.args[1] if len(node.args) > 1 else node.kwargs.get("mat_b", node.kwargs.get("mat2"))
        traced = _trace_expert_weight(operand, examples)
        if traced is None:
            continue
        weight, swaps = traced
        x = node.args[0] if node.args else node.kwargs.get("mat_a", node.kwargs.get("input"))
        offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
        extras = [k for k in ("bias", "out_dtype") if node.kwargs.get(k) is not None]
        reason = None
        if offs is None:
            reason = "grouped mm without offsets"
        elif extras:
            reason = f"grouped mm with {' and '.join(extras)}"
        reads.append(GroupedRead(node, x, operand, offs, weight, transposed=swaps % 2 == 0, reason=reason))
    return reads


def _bmm_read(node: fx.Node, examples: dict[fx.Node, Any]) -> GroupedRead | None:
    """The read of a bmm whose second operand is a 3-D weight (None for any other batched matmul)."""
    traced = _trace_expert_weight(node.args[1], examples)
    if traced is None:
        return None
    weight, swaps = traced
    x, experts = _example(node.args[0]), examples[weight].shape[0]
    reason = None
    if x is None or x.dim() != 3 or x.shape[0] != experts:
        got = "unknown" if x is None else tuple(x.shape)
        reason = f"batched matmul whose input is not (E={experts}, T, K) (got {got})"
    return GroupedRead(node, node.args[0], node.args[1], None, weight, transposed=swaps % 2 == 0, reason=reason,
                       form="bmm")


def _gathered_weight(node: Any, examples: dict[fx.Node, Any]) -> tuple[fx.Node, fx.Node] | None:
    """(3-D weight placeholder, ids) of an operand ``W[ids]`` indexed by a tensor, or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    weight, ids = node.args
    value = examples.get(weight) if isinstance(weight, fx.Node) and weight.op == "placeholder" else None
    if not isinstance(ids, fx.Node) or not isinstance(value, torch.nn.Parameter) or value.dim() != 3:
        return None
    return (weight, ids) if value.is_floating_point() else None


def _gathered_read(node: fx.Node, examples: dict[fx.Node, Any]) -> GroupedRead | None:
    """The read of ``bmm(W[ids], x)`` (W stored (E, N, K)) or ``bmm(x, W[ids])`` (stored (E, K, N))."""
    for side in (0, 1):
        gathered = _gathered_weight(node.args[side], examples)
        if gathered is not None:
            break
    else:
        return None
    (weight, ids), x = gathered, node.args[1 - side]
    _, a, b = examples[weight].shape
    k = b if side == 0 else a
    want = (k, 1) if side == 0 else (1, k)
    xv, idv = _example(x), _example(ids)
    reason = None
    if xv is None or xv.dim() != 3 or tuple(xv.shape[1:]) != want:
        got = "unknown" if xv is None else tuple(xv.shape)
        reason = f"per-token gathered experts (W[ids]) whose input is not (S, {want[0]}, {want[1]}) (got {got})"
    elif idv is None or idv.dim() != 1 or idv.is_floating_point():
        reason = "per-token gathered experts (W[ids]) indexed other than by one integer id per row"
    return GroupedRead(node, x, node.args[side], None, weight, transposed=side == 1, reason=reason, form="gathered",
                       ids=ids)


def gathered_operands(graph: fx.Graph, x: fx.Node, ids: fx.Node, num_experts: int, in_features: int,
                      sorts: dict[fx.Node, tuple[fx.Node, fx.Node]]) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Nodes (x (S, K) sorted by expert, row ends (int32), the sort order) for a gathered read's x (S, K, 1)
    or (S, 1, K) and ids (S,); call inside `graph.inserting_before(...)`. The ends come from a histogram on
    the device (`row_ends`). `sorts` keeps each ids node's
    (order, ends) for the graph's later reads of the same routing (gate_up_proj, then down_proj)."""
    if ids not in sorts:
        order = graph.call_function(torch.argsort, (ids,), {"stable": True})
        sorts[ids] = (order, graph.call_function(row_ends, (ids, num_experts)))
    order, ends = sorts[ids]
    rows = graph.call_method("reshape", (x, -1, in_features))
    return graph.call_function(operator.getitem, (rows, order)), ends, order


def gathered_result(graph: fx.Graph, y: fx.Node, order: fx.Node, transposed: bool) -> fx.Node:
    """The node putting tile_grouped_mm's rows (sorted by expert) back in order, shaped as the bmm's
    (S, N, 1), or (S, 1, N) for weights stored (E, K, N)."""
    unsorted = graph.call_method("index_copy", (graph.call_function(torch.empty_like, (y,)), 0, order, y))
    return graph.call_method("unsqueeze", (unsorted, 1 if transposed else -1))


def bmm_operands(graph: fx.Graph, x: fx.Node, num_experts: int, in_features: int, device: torch.device,
                 skip_zero_rows: bool = False) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """Nodes (x (E * T, K), row ends T, 2T, ..., E * T (int32, on `device`), None) for a bmm's x (E, T, K); call
    inside `graph.inserting_before(...)`. `skip_zero_rows`: the rows that are not all zero sorted by expert
    and the zero ones past the last end instead (ends from a histogram), with the sort order: a zero row's
    product is zero, so an expert whose rows are all zero is not read (Llama 4's block scales the rows of the
    experts a token's router did not pick by 0). Its input gradient is not zero, hence only for graphs that
    compute none."""
    flat = graph.call_method("reshape", (x, -1, in_features))
    rows = graph.call_method("size", (x, 1))
    if not skip_zero_rows:
        ends = graph.call_function(torch.arange, (1, num_experts + 1), {"dtype": torch.int32, "device": device})
        return flat, graph.call_function(operator.mul, (ends, rows)), None
    experts = graph.call_function(torch.arange, (num_experts,), {"device": device})
    expert = graph.call_method("repeat_interleave", (experts, rows))
    live = graph.call_method("any", (graph.call_method("ne", (flat, 0)), -1))
    key = graph.call_function(torch.where, (live, expert, num_experts))
    order = graph.call_function(torch.argsort, (key,), {"stable": True})
    ends = graph.call_function(row_ends, (key, num_experts))
    return graph.call_function(operator.getitem, (flat, order)), ends, order


def bmm_result(graph: fx.Graph, y: fx.Node, num_experts: int, out_features: int,
               order: fx.Node | None = None) -> fx.Node:
    """The node viewing tile_grouped_mm's (E * T, N) back to the bmm's (E, T, N), its rows first put back in
    their order where `bmm_operands` sorted them (every row is in `order`: the zero ones came out zero)."""
    if order is not None:
        y = graph.call_method("index_copy", (graph.call_function(torch.empty_like, (y,)), 0, order, y))
    return graph.call_method("view", (y, num_experts, -1, out_features))


def servable_grouped(plan: Any, reads: list[GroupedRead], names: dict[fx.Node, str],
                     examples: dict[fx.Node, Any]) -> tuple[list[GroupedRead], dict[str, str]]:
    """(grouped reads to rewrite, {"<3-D weight>.*": why} for planned ones left dense); a read is served when
    some expert slice of its weight is planned with a 2:4 tile, in the orientation the plan recorded."""
    recorded = (getattr(plan, "meta", None) or {}).get("targets", {})
    served, why = [], {}
    for read in reads:
        fqn, value = names[read.weight], examples[read.weight]
        planned = planned_experts(plan, fqn, value.shape[0])
        if not planned:
            continue
        entry = recorded.get(f"{fqn}.{planned[0]}") or {}
        expect = tuple(value.shape[1:][::-1] if read.transposed else value.shape[1:])
        if read.reason is not None:
            why[f"{fqn}.*"] = read.reason
        elif bool(entry.get("transposed")) != read.transposed:
            why[f"{fqn}.*"] = (f"read {'as stored (E, K, N)' if read.transposed else 'as (E, N, K) transposed'} by "
                               f"{'a bmm' if read.form == 'bmm' else 'a grouped mm'}, but the plan records the other orientation")
        elif tuple(plan.layers[f"{fqn}.{planned[0]}"].shape) != expect:
            raise ValueError(f"patch backend: expert slices of {fqn!r} are read as {expect} (N, K) matrices but the "
                             f"plan has {tuple(plan.layers[f'{fqn}.{planned[0]}'].shape)}")
        else:
            served.append(read)
    return served, why


def planned_experts(plan: Any, fqn: str, num_experts: int) -> list[int]:
    """The experts of 3-D weight `fqn` whose plan slice has at least one 2:4 tile."""
    layers = (plan.layers.get(f"{fqn}.{e}") for e in range(num_experts))
    return [e for e, layer in enumerate(layers) if layer is not None and layer.n_sparse]


def grouped_module(plan: Any, fqn: str, read: GroupedRead, weight: torch.Tensor, tuning: Any, batch_size: int,
                   prefill_len: int) -> Any:
    """The `TileGroupedLinear` of every expert slice of `weight` (the 3-D parameter `read` multiplies by), its
    slices (N, K) as the read multiplies them, on `tuning` (the tuner's, for its first planned slice)."""
    from patchc.runtime.grouped_op import TileGroupedLinear

    slices = weight.detach().transpose(1, 2) if read.transposed else weight.detach()
    return TileGroupedLinear.from_plan(plan, fqn, slices, tuning, dtype=weight.dtype, device=weight.device,
                                       batch_size=batch_size, prefill_len=prefill_len)


def grouped_args(x: Any, offs: Any, mod: Any, buffers: list[Any]) -> tuple[Any, ...]:
    """The `tile_grouped_mm` arguments of a grouped read's x and offsets (graph nodes) on `mod`'s experts
    (`buffers`: the graph's placeholders for its packed tensors, in order)."""
    return (x, offs, *buffers, *mod.op_args()[len(buffers):])


__all__ = ["GroupedRead", "bmm_operands", "bmm_result", "find_grouped_reads", "gathered_operands", "gathered_result",
           "grouped_args", "grouped_module", "is_expert_bmm", "is_grouped_mm", "planned_experts", "servable_grouped"]
