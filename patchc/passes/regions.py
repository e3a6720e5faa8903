"""The subgraphs torch.export keeps for `with torch.no_grad():` and `with torch.autocast(...)` regions.

torch.export turns such a region into one call of a higher-order op (`wrap_with_set_grad_enabled`,
`wrap_with_autocast`) whose subgraph reads its operands as placeholders: a weight used inside arrives as a
placeholder, not a get_attr. These helpers let the annotate pass see through that boundary (HRM runs its
early reasoning cycles under `torch.no_grad()`).

Example:
    >>> regions = region_inputs(gm)          # {placeholder: (operand outside, region call)}
    >>> [n for n in all_nodes(gm) if n.op == "call_function"]
"""

from __future__ import annotations

import torch
from torch import fx

# Region ops and the position of their subgraph argument; the operands follow it, one per placeholder.
_REGION_BODY = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}

# A region's placeholder -> (its operand in the enclosing graph, the region call there).
Regions = dict[fx.Node, tuple[fx.Node, fx.Node]]


def region_body(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The subgraph of a `with torch.no_grad()` / `torch.autocast` region call, else None."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    if name not in _REGION_BODY or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    body = node.args[_REGION_BODY[name]]
    return getattr(gm, body.target) if isinstance(body, fx.Node) and body.op == "get_attr" else None


def region_inputs(gm: fx.GraphModule, found: Regions | None = None) -> Regions:
    """Every region's placeholders (nested regions too) mapped to their operands."""
    found = {} if found is None else found
    for node in gm.graph.nodes:
        body = region_body(gm, node)
        if body is not None:
            operands = node.args[_REGION_BODY[node.target.__name__] + 1:]
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            found.update({p: (op, node) for p, op in zip(placeholders, operands) if isinstance(op, fx.Node)})
            region_inputs(body, found)
    return found


def all_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's nodes, then those of its regions' subgraphs (depth first)."""
    nodes = list(gm.graph.nodes)
    for node in list(nodes):
        body = region_body(gm, node)
        if body is not None:
            nodes += all_nodes(body)
    return nodes


def readers(node: fx.Node, regions: Regions) -> list[fx.Node]:
    """`node`'s users, a region call replaced by the users of its placeholders for `node`."""
    out = []
    for user in node.users:
        inside = [p for p, (op, call) in regions.items() if op is node and call is user]
        out += [r for p in inside for r in readers(p, regions)] if inside else [user]
    return out


def foreign_subgraph(node: fx.Node, regions: Regions) -> str | None:
    """The name of a subgraph op other than the regions above that reads `node` (`cond`, ...), or None."""
    for user in readers(node, regions):
        if user.op == "call_function" and isinstance(user.target, torch._ops.HigherOrderOperator):
            return str(user.target.__name__)
    return None


__all__ = ["Regions", "all_nodes", "foreign_subgraph", "readers", "region_body", "region_inputs"]
