"""The matmul forms the dynamo backend finds in a Torch-IR graph, and which of them it can rewrite.

Dynamo hands the backend torch-level calls whose weights are placeholders. A "read" is one call that
multiplies an activation x (..., K) by a weight placeholder W:

    F.linear(x, W, b) / torch._C._nn.linear        x @ W^T + b       W stored (N, K)
    x @ W.T, torch.matmul / mm(x, W.t())           x @ W^T           W stored (N, K)
    torch.addmm(b, x, W), x @ W                    b + x @ W         W stored (K, N) (GPT-2's Conv1D)
    torch.einsum("...k,nk->...n", x, W)            the einsum forms of `patchc.passes.einsum_forms`

`W.T`, `.t()`, `.transpose(0, 1)`, `.permute(1, 0)`, `torch.t` / `torch.transpose` and casts on the way
are looked through. Each read says whether W is stored (K, N) (`transposed`), so the plan's (N, K) layer
is matched in the right orientation. A read that `tile_linear` cannot serve (an einsum whose output is
not x's layout with n last, addmm with alpha / beta, a 3-D weight, W on the left) carries the reason
instead, so the backend can list the layer as left dense.

Example:
    >>> reads = find_reads(gm, {placeholder: tensor, ...})      # doctest: +SKIP
    >>> [(r.fqn, r.form, r.transposed, r.reason) for r in reads]  # doctest: +SKIP
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from patchc.passes.einsum_forms import ELLIPSIS, parse_einsum, split_equation

LINEAR = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)
MATMUL = (operator.matmul, torch.matmul, torch.mm, torch.ops.aten.mm.default, torch.ops.aten.matmul.default)
MATMUL_METHODS = ("matmul", "mm", "__matmul__")
ADDMM = (torch.addmm, torch.ops.aten.addmm.default)
EINSUM = (torch.einsum, torch.functional.einsum, torch.ops.aten.einsum.default)
_CASTS = ("to", "type_as", "detach", "contiguous", "float", "half", "bfloat16")
# dynamo records `W.T` / `W.mT` as getattr up to torch 2.13, as these aten ops from torch 2.14
_ATTRIBUTE_OPS = {"T": torch.ops.aten.numpy_T, "mT": torch.ops.aten.mT}


@dataclass
class Read:
    """One matmul call reading weight placeholder `weight` (FQN `fqn`); `reason` is None when the
    backend can serve it as `tile_linear(x) (+ bias)`."""

    node: fx.Node
    x: Any
    weight: fx.Node
    bias: Any
    form: str
    transposed: bool
    reason: str | None = None


def _arg(node: fx.Node, i: int, name: str) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name)


def reads_attribute(node: fx.Node, *attributes: str) -> bool:
    """Whether `node` reads one of the tensor `attributes` ("T", "mT") of its first argument, in either of the
    forms dynamo records it in."""
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return node.args[1] in attributes
    packet = getattr(node.target, "overloadpacket", node.target)
    return any(packet is _ATTRIBUTE_OPS[a] for a in attributes)


def _flip(node: fx.Node) -> bool | None:
    """True for a 2-D transpose of its first argument, False for a cast, None for anything else."""
    if reads_attribute(node, "T", "mT"):
        return True
    if node.op == "call_function" and node.target is torch.t:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    dims = [d for d in node.args[1:] if isinstance(d, int)]
    if name == "t" and node.op == "call_method":
        return True
    if name == "transpose" and sorted(d % 2 for d in dims) == [0, 1]:
        return True
    if name == "permute" and (dims == [1, 0] or list(node.args[1:2]) in ([[1, 0]], [(1, 0)])):
        return True
    if node.op == "call_method" and name in _CASTS:
        return False
    return None


def trace_weight(node: Any, examples: dict[fx.Node, Any]) -> tuple[fx.Node, int] | None:
    """(weight placeholder, number of transposes) behind a matmul operand, or None for an activation."""
    flips = 0
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method"):
        flip = _flip(node)
        if flip is None:
            return None
        flips += int(flip)
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return None
    value = examples.get(node)
    if not isinstance(value, torch.nn.Parameter) or not value.is_floating_point():
        return None
    return node, flips


def _einsum_read(node: fx.Node, examples: dict[fx.Node, Any]) -> Read | None:
    eq = node.args[0]
    ops = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else list(node.args[1:])
    if not isinstance(eq, str) or len(ops) != 2:
        return None
    traced = [trace_weight(op, examples) for op in ops]
    if sum(t is not None for t in traced) != 1:
        return None
    i = 0 if traced[0] is not None else 1
    w, flips = traced[i]
    form = parse_einsum(eq, i, examples[w].dim())
    if isinstance(form, str):
        return Read(node, ops[1 - i], w, None, "einsum", False, f"einsum {eq!r}: {form}")
    transposed = form.transposed != bool(flips % 2)
    inputs, out = split_equation(eq)
    x_subs = inputs[1 - i]
    n = next(c for c in inputs[i] if c in out and c not in x_subs)
    reason = None
    if form.expert_axis is not None:
        reason = f"einsum {eq!r} over experts (3-D weight): use patchc.compile on a fused-experts module"
    elif not (form.k_axis == -1 or (ELLIPSIS not in x_subs and form.k_axis == len(x_subs) - 1)) or out != x_subs[:-1] + n:
        reason = f"einsum {eq!r}: the output is not x's layout with the weight's output letter last"
    return Read(node, ops[1 - i], w, None, "einsum", transposed, reason)


def match_read(node: fx.Node, examples: dict[fx.Node, Any]) -> Read | None:
    """The `Read` of a call node, or None when it multiplies no weight placeholder."""
    if node.op == "call_function" and node.target in EINSUM:
        return _einsum_read(node, examples)
    if node.op == "call_function" and node.target in LINEAR:
        x, w, b, form, flips_needed = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias"), "linear", 0
    elif (node.op == "call_function" and node.target in MATMUL) or (node.op == "call_method" and node.target in MATMUL_METHODS):
        x, w, b, form, flips_needed = node.args[0], node.args[1], None, "matmul", 1
    elif (node.op == "call_function" and node.target in ADDMM) or (node.op == "call_method" and node.target == "addmm"):
        b, x, w = (node.args + (None,) * 3)[:3]
        form, flips_needed = "addmm", 1
    else:
        return None
    traced = trace_weight(w, examples)
    if traced is None:
        left = trace_weight(x, examples)
        if left is not None and form != "linear":  # W @ x: the weight on the left
            return Read(node, w, left[0], None, form, False, f"{form} with the weight on the left (W @ x)")
        return None
    weight, flips = traced
    transposed = flips % 2 != flips_needed
    reason = None
    if examples[weight].dim() != 2:
        reason = f"{form} of a {examples[weight].dim()}-D weight"
    elif form == "addmm" and any(k in node.kwargs for k in ("alpha", "beta")):
        reason = "addmm with alpha / beta"
    return Read(node, x, weight, b, form, transposed, reason)


def find_reads(gm: fx.GraphModule, examples: dict[fx.Node, Any]) -> list[Read]:
    """Every matmul read of a weight placeholder in `gm`, in graph order."""
    reads = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            read = match_read(node, examples)
            if read is not None:
                reads.append(read)
    return reads


__all__ = ["Read", "find_reads", "match_read", "trace_weight"]
