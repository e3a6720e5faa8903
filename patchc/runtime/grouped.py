"""Fused MoE experts under the dynamo backend: `patchc::tile_grouped_mm` and the grouped reads it replaces.

transformers 5 runs fused experts (`gate_up_proj` / `down_proj`, 3-D) as one grouped matmul over the
tokens sorted by expert: ``grouped_mm(x (S, K), W (E, K, N), offs=ends)``, where W is the stored
(E, N, K) weight transposed (or the weight itself for experts stored (E, K, N)) and ``ends`` the
cumulative row count of each expert. Dynamo shows that call as ``torch.nn.functional.grouped_mm``,
``torch._grouped_mm`` or transformers' own ``transformers::grouped_mm_fallback``. The backend swaps it
for ``patchc::tile_grouped_mm``, which runs each expert's rows through that expert's hybrid kernel
(`patchc::tile_linear` on its packed slice) and the experts without a 2:4 tile through a dense mm.

The op reads the offsets once on the host (one synchronisation per call, as transformers' fallback
does), so it cannot run inside a CUDA graph: it carries torch's ``cudagraph_unsafe`` tag, and inductor
keeps it out of the graphs it captures. `patchc.compile` (TileExperts) reads the routing on the host too.

Example:
    >>> reads = find_grouped_reads(gm, examples)          # doctest: +SKIP
    >>> [(r.fqn, r.transposed, r.reason) for r in reads]  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from patchc.runtime import op as _op  # noqa: F401  (registers torch.ops.patchc.tile_linear)

N_BUFFERS = 7  # dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols
_GROUPED_FUNCTIONS = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)
_GROUPED_OPS = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")
_CASTS = ("to", "type_as", "detach", "contiguous", "float", "half", "bfloat16")


# The host read of the offsets cannot be captured: tagged, inductor leaves this op out of its CUDA graphs
# (mode="reduce-overhead") instead of failing in capture. The tag is missing from older torch builds.
_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@torch.library.custom_op("patchc::tile_grouped_mm", mutates_args=(), tags=_TAGS)
def tile_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    buffers: list[torch.Tensor],
    experts: list[int],
    name: str,
    block: list[int],
    per_row: list[int],
    decode_cfg: list[int],
    prefill_cfg: list[int],
    threshold: int,
) -> torch.Tensor:
    """y (S, N): rows ``offs[e-1]:offs[e]`` of x (S, K) times expert e's weight, ``weight[e]`` (K, N).

    Expert ``experts[j]`` is served by `patchc::tile_linear` on ``buffers[7j:7j+7]`` (``per_row[2j:2j+2]``);
    the others by ``x_e @ weight[e]``. One launch config (`block`, `decode_cfg`, `prefill_cfg`,
    `threshold`) serves every expert of the weight: the slices share their shape.

    Example:
        >>> y = torch.ops.patchc.tile_grouped_mm(x, w_t, offs, bufs, [0, 2], "experts.down_proj", [16, 16],
        ...                                      per_row, decode_cfg, prefill_cfg, 64)     # doctest: +SKIP
    """
    n, k = _check(x, weight, offs, buffers, experts, per_row, name)
    out = x.new_zeros((x.shape[0], n))
    served = {e: j for j, e in enumerate(experts)}
    for e, start, end in _segments(offs):
        j = served.get(e)
        if j is None:
            out[start:end] = x[start:end] @ weight[e].to(x.dtype)
        else:
            out[start:end] = torch.ops.patchc.tile_linear(
                x[start:end], *buffers[N_BUFFERS * j : N_BUFFERS * (j + 1)], None, f"{name}.{e}", [n, k], block,
                per_row[2 * j : 2 * j + 2], decode_cfg, prefill_cfg, threshold)
    return out


def _segments(offs: torch.Tensor):
    """(expert, start, end) of every expert with rows: the op's one host read of the offsets."""
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            yield e, start, end
        start = max(start, end)


@tile_grouped_mm.register_fake
def _(x, weight, offs, buffers, experts, name, block, per_row, decode_cfg, prefill_cfg, threshold):
    n, _ = _check(x, weight, offs, buffers, experts, per_row, name)
    return x.new_empty((x.shape[0], n))


@torch.library.custom_op("patchc::tile_grouped_mm_grad_x", mutates_args=(), tags=_TAGS)
def tile_grouped_mm_grad_x(grad: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, buffers: list[torch.Tensor],
                           experts: list[int], block: list[int]) -> torch.Tensor:
    """dL/dx (S, K): each expert's rows of dL/dy times its W_hat (served) or ``weight[e]^T`` (the others)."""
    from patchc.codegen.layout import dense_from_buffers

    _, k, n = weight.shape
    out = grad.new_zeros((grad.shape[0], k))
    served = {e: j for j, e in enumerate(experts)}
    for e, start, end in _segments(offs):
        j = served.get(e)
        w = (weight[e].t() if j is None else
             dense_from_buffers(tuple(buffers[N_BUFFERS * j : N_BUFFERS * (j + 1)]), (n, k), (block[0], block[1])))
        out[start:end] = grad[start:end] @ w.to(grad.dtype)
    return out


@tile_grouped_mm_grad_x.register_fake
def _(grad, weight, offs, buffers, experts, block):
    return grad.new_empty((grad.shape[0], weight.shape[1]))


def _save(ctx, inputs, output) -> None:
    _, weight, offs, buffers, experts, _, block = inputs[:7]
    ctx.save_for_backward(weight, offs, *buffers)
    ctx.experts, ctx.block = experts, block


def _backward(ctx, grad: torch.Tensor):
    """Gradients reach x; the experts' weights are frozen (served slices are packed copies)."""
    weight, offs, *buffers = ctx.saved_tensors
    grad_x = torch.ops.patchc.tile_grouped_mm_grad_x(grad.contiguous(), weight, offs, buffers, ctx.experts, ctx.block)
    return (grad_x, None, None, [None] * len(buffers), *(None,) * 7)  # the list of buffers: one None each


tile_grouped_mm.register_autograd(_backward, setup_context=_save)  # compiled calls with gradients on


def _check(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, buffers: list[torch.Tensor],
           experts: list[int], per_row: list[int], name: str) -> tuple[int, int]:
    """Shape checks that need no tensor values (also run by the fake kernel); returns (N, K)."""
    where = f"patchc::tile_grouped_mm({name!r})"
    if x.dim() != 2 or weight.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"{where}: needs x (S, K), weight (E, K, N) and offs (E,); got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(offs.shape)}")
    e, k, n = weight.shape
    if x.shape[1] != k or offs.shape[0] != e:
        raise ValueError(f"{where}: x has {x.shape[1]} features and offs {offs.shape[0]} experts; the weight "
                         f"{tuple(weight.shape)} expects K={k} and E={e}")
    if len(buffers) != N_BUFFERS * len(experts) or len(per_row) != 2 * len(experts):
        raise ValueError(f"{where}: {len(experts)} served experts need {N_BUFFERS * len(experts)} buffers and "
                         f"{2 * len(experts)} per-row counts, got {len(buffers)} and {len(per_row)}")
    if any(not 0 <= j < e for j in experts):
        raise ValueError(f"{where}: served experts {experts} must lie in [0, {e})")
    return n, k


@dataclass
class GroupedRead:
    """One grouped matmul over the experts of 3-D weight placeholder `weight`: `transposed` when the
    weight is stored (E, K, N) (its slices are planned as their transposes); `reason` is None when
    `tile_grouped_mm` can serve it."""

    node: fx.Node
    x: Any
    operand: Any  # the (E, K, N) operand the call multiplies by, as the graph builds it
    offs: Any
    weight: fx.Node
    transposed: bool
    reason: str | None = None


def _target_name(target: Any) -> str | None:
    """"ns::op" for a torch.ops packet or overload, None for anything else."""
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_schema", None), "name", None)
    return name if isinstance(name, str) else None


def is_grouped_mm(node: fx.Node) -> bool:
    """Whether the node is a grouped matmul call (functional, torch._grouped_mm, aten or transformers' op)."""
    return node.op == "call_function" and (node.target in _GROUPED_FUNCTIONS or _target_name(node.target) in _GROUPED_OPS)


def _trace_expert_weight(node: Any, examples: dict[fx.Node, Any]) -> tuple[fx.Node, int] | None:
    """(3-D weight placeholder, number of swaps of its last two dims) behind an operand, or None."""
    swaps = 0
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method"):
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
        dims = sorted(d % 3 for d in node.args[1:] if isinstance(d, int))
        if name == "transpose" and dims == [1, 2]:
            swaps += 1
        elif node.target is getattr and node.args[1] == "mT":
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
                               "a grouped mm, but the plan records the other orientation")
        elif tuple(plan.layers[f"{fqn}.{planned[0]}"].shape) != expect:
            raise ValueError(f"patch backend: expert slices of {fqn!r} are read as {expect} (N, K) matrices but the "
                             f"plan has {tuple(plan.layers[f'{fqn}.{planned[0]}'].shape)}")
        else:
            served.append(read)
    return served, why


def planned_experts(plan: Any, fqn: str, num_experts: int) -> list[int]:
    """The experts of 3-D weight `fqn` whose plan slice has at least one 2:4 tile."""
    layers = (plan.layers.get(f"{fqn}.{e}") for e in range(num_experts))
    return [e for e, layer in enumerate(layers) if layer is not None and bool((layer.kinds == 1).any())]


def expert_modules(plan: Any, fqn: str, experts: list[int], weight: torch.Tensor, tuning: Any, batch_size: int,
                   prefill_len: int) -> list[tuple[int, Any]]:
    """[(expert, TileLinear)] for `experts` (`planned_experts` of `fqn`), all on one launch config: `tuning`
    (the tuner's, for the first of them) or the first one's default."""
    from patchc.runtime.dispatch import TileLinear

    out = []
    for e in experts:
        mod = TileLinear.from_plan(plan.layers[f"{fqn}.{e}"], tuning, dtype=weight.dtype, device=weight.device,
                                   batch_size=batch_size, prefill_len=prefill_len)
        tuning = mod.tuning
        out.append((e, mod))
    return out


def grouped_args(read: GroupedRead, fqn: str, mods: list[tuple[int, Any]], buffers: list[Any]) -> tuple[Any, ...]:
    """The `tile_grouped_mm` arguments replacing `read` (`buffers`: the experts' packed tensors, in order)."""
    first = mods[0][1]
    per_row = [v for _, mod in mods for v in mod.per_row]
    return (read.x, read.operand, read.offs, buffers, [e for e, _ in mods], fqn, list(first.block), per_row,
            list(first.decode_buckets), list(first.prefill_cfg), first.threshold)


__all__ = ["GroupedRead", "N_BUFFERS", "expert_modules", "find_grouped_reads", "grouped_args", "is_grouped_mm",
           "planned_experts", "servable_grouped", "tile_grouped_mm"]
