"""Annotate pass: find the matmuls whose weight is a parameter, decide which get a mask.

Matched forms (the weight W has shape (N, K) = (out_features, in_features)):

    aten.linear.default(x, W[, b])                              torch.export training IR
    aten.addmm.default(b, x, T(W)) / aten.mm.default(x, T(W))   after run_decompositions() or aot_autograd
    aten.matmul.default(x, T(W))

    aten._grouped_mm(x, T(W), offs) / transformers.grouped_mm_fallback(x, T(W), offs)   fused experts
    aten.bmm(x, W) with W (E, K, N), x (E, T, K)                 every expert at once (Llama 4)
    aten.einsum.default(eq, [x, W])   a (batched) matmul: W's subscripts are one contracted letter k
                                      and one output letter n ("bsk,nk->bsn", "...k,kn->...n"), or an
                                      expert letter first that x and the output share ("ebk,enk->ebn")

T(W) is one `aten.t` / `aten.permute(W, [1, 0])` / `aten.transpose(W, -2, -1)` of a parameter that a
`get_attr` node reads (the exported program's `module()` form). Casts and detaches on the way are
looked through. A weight read without that transpose is stored (K, N) (GPT-2's Conv1D, experts with
`is_transposed`): it is masked as its transpose, so 2:4 groups still run along in_features. A 3-D
weight (E, N, K) read by a grouped matmul, or by a bmm whose batch is the experts, is E experts: one
(N, K) mask per expert, named "<fqn>.<expert>" (`patchc.ir.targets`). A grouped read of its first R experts
(`W[:R]`: LongCat-Flash's gate_up_proj also holds rows for experts that compute nothing) is R experts; the
rows past them are never masked nor planned.

Which weights are masked: `PatchConfig.selects` (include / exclude globs over the weight's fully qualified name,
2-D, min_features) and two structural rules: a weight that a lookup also reads (an embedding, `W[ids]`,
index_select, gather: a tied LM head) is never masked, and K % 4 != 0 is skipped (no 2:4 groups). Every skipped
weight is kept in `skipped` with its reason, so summaries can say why; so is a parameter that some matmul reads in a
form not listed above (`W @ x`, a gathered expert slice, ...).

Regions torch.export keeps as a subgraph (`with torch.no_grad():`, `with torch.autocast(...)`: HRM runs its
early reasoning cycles without gradients) are searched too, nested or not. A matmul inside one reads its
weight through the region's operands: the mask goes on the weight before the region call, so every read,
inside and out, sees the same masked weight. A weight that some other subgraph op (`torch.cond`, ...) reads
is not masked at all, and is listed as skipped.

Each matched matmul node gets `node.meta["patchc_site"]`; the rewrite pass consumes that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from patchc.config import PatchConfig
from patchc.ir.targets import weight_names
from patchc.passes.einsum_forms import parse_einsum
from patchc.passes.regions import Regions, all_nodes, foreign_subgraph, readers, region_inputs

aten = torch.ops.aten

_LINEAR = {aten.linear.default}
_MATMUL = {aten.mm.default: 1, aten.addmm.default: 2, aten.matmul.default: 1, aten.bmm.default: 1}
_TRANSPOSE = {aten.t.default, aten.permute.default, aten.transpose.int, aten.numpy_T.default}
_PASS_THROUGH = {
    aten.detach.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.alias.default,
    aten.clone.default,
}
# Broadcasts a decomposed 3-D linear puts on the weight (expand(permute(W), [B, K, N]) -> bmm):
# looked through only while the last two dims stay the weight's.
_BROADCAST = {
    aten.expand.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
}
# Reads that gather a weight's rows (or entries) instead of multiplying it. The mask goes on the matmul's read
# only, so a lookup of a masked weight would train on W while the plan writes W * M into the one parameter.
_LOOKUPS = {aten.embedding.default, aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_select.default,
            aten.gather.default, aten.take.default, aten.take_along_dim.default, aten.embedding_bag.default,
            aten.embedding_bag.padding_idx, aten._embedding_bag.default, aten._embedding_bag_forward_only.default}
_EINSUM = {aten.einsum.default}
_VIEWS = _PASS_THROUGH | _BROADCAST | _TRANSPOSE | {
    aten.index.Tensor, aten.select.int, aten.slice.Tensor, aten.contiguous.default, aten.permute.default}
_GROUPED_NAMES = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")
# Ops that read a weight as a matmul operand: a parameter reaching one of them and not masked is skipped.
_MATMUL_NAMES = ("linear", "mm", "addmm", "bmm", "matmul", "einsum", "baddbmm", "_grouped_mm", "grouped_mm_fallback")
META_KEY = "patchc_site"


@dataclass
class LinearSite:
    """One matmul reading a masked weight.

    `weight_node` is the get_attr node, `consumer` the node on the path to the matmul that reads it
    (where the mask is spliced in), `input_node` the activation operand (the calibration observers
    hook it), `bias` the FQN of a parameter bias or None.
    """

    fqn: str
    shape: tuple[int, int]
    matmul: fx.Node
    weight_node: fx.Node
    consumer: fx.Node
    input_node: fx.Node
    bias: str | None
    form: str
    experts: int | None = None
    transposed: bool = False
    x_axes: tuple[int, int | None] | None = None  # einsum / bmm: (K axis, expert axis) of the activation

    @property
    def names(self) -> list[str]:
        """The plan layer names of this weight: its FQN, or "<fqn>.<e>" per expert."""
        if self.experts is None:
            return [self.fqn]
        return [f"{self.fqn}.{e}" for e in range(self.experts)]


def _is_transpose(node: fx.Node) -> bool:
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target is aten.transpose.int:
        src = getattr(node.args[0], "meta", {}).get("val")
        rank = src.dim() if src is not None else 2
        return sorted(int(d) % rank for d in node.args[1:3]) == [rank - 2, rank - 1]
    return node.target in _TRANSPOSE


def _keeps_matrix(node: fx.Node) -> bool:
    """A broadcast / view that keeps the trailing (rows, cols) matrix of its input.

    Leading dims only ever come from broadcasting the one weight matrix, so reshaping them keeps
    every slice equal to it.
    """
    out, src = node.meta.get("val"), getattr(node.args[0], "meta", {}).get("val")
    if out is None or src is None or out.dim() < 2 or src.dim() < 2:
        return False
    return tuple(out.shape[-2:]) == tuple(src.shape[-2:])


def _leading_experts(node: fx.Node) -> bool:
    """`W[:R]` of a 3-D weight: its first R experts, each whole."""
    if node.target is not aten.slice.Tensor:
        return False
    src = getattr(node.args[0], "meta", {}).get("val")
    args = dict(zip(("dim", "start", "end", "step"), node.args[1:]), **node.kwargs)
    return (src is not None and src.dim() == 3 and args.get("dim", 0) == 0 and args.get("start") in (None, 0)
            and args.get("step", 1) == 1)


def _trace_weight(node: fx.Node, outer: Regions | None = None) -> tuple[fx.Node, fx.Node, int] | None:
    """Follow transposes / casts (and a leading slice of experts) back to a get_attr: (get_attr, its consumer,
    #transposes).

    `outer` maps a region's placeholders to their operands: the trace crosses into the enclosing graph,
    where the region call is the consumer."""
    flips, consumer = 0, None
    while node.op == "call_function" or (outer and node in outer):
        if node.op == "placeholder":
            node, consumer = outer[node]
            continue
        if node.target in _PASS_THROUGH:
            pass
        elif node.target in _BROADCAST and _keeps_matrix(node):
            pass
        elif node.target in _TRANSPOSE and _is_transpose(node):
            flips += 1
        elif not _leading_experts(node):
            return None
        consumer, node = node, node.args[0]
        if not isinstance(node, fx.Node):
            return None
    if node.op != "get_attr":
        return None
    return node, consumer, flips


def _parameter(gm: fx.GraphModule, target: str) -> torch.Tensor | None:
    """The parameter or buffer `target` names (None for neither: a plain tensor attribute)."""
    for get in (gm.get_parameter, gm.get_buffer):
        try:
            return get(target)
        except AttributeError:
            pass
    return None


def name_tied_weights_first(gm: fx.GraphModule) -> None:
    """Make every get_attr of a tied weight read it under its first name, as `named_parameters()` and state
    dicts name it: `ep.module()` may read it under each of its names (Zamba's attention block, shared by layers
    1 and 3), and the pass would name the plan layer after one read and mask only the reads under that name."""
    first = weight_names(gm)
    renamed = False
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            name = first.get(id(_parameter(gm, node.target)), node.target)
            renamed |= name != node.target
            node.target = name
    if renamed:
        gm.recompile()


def _weight_of(gm: fx.GraphModule, node: fx.Node, outer: Regions | None = None) -> tuple[str, torch.Tensor] | None:
    """(FQN, tensor) of the floating parameter `node` reads through transposes / casts, or None."""
    traced = _trace_weight(node, outer)
    weight = _parameter(gm, traced[0].target) if traced is not None else None
    if weight is None or not weight.is_floating_point():
        return None
    return traced[0].target, weight


def _lookup_tensors(gm: fx.GraphModule, regions: Regions) -> dict[int, str]:
    """id(weight) -> the first lookup op (`_LOOKUPS`) that reads it, through transposes / casts."""
    ids: dict[int, str] = {}
    for node in all_nodes(gm):
        if node.op == "call_function" and node.target in _LOOKUPS:
            traced = _trace_weight(node.args[0], regions)
            tensor = _parameter(gm, traced[0].target) if traced is not None else None
            if tensor is not None:
                ids.setdefault(id(tensor), str(node.target))
    return ids


def _op_name(target) -> str:
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else ""


def _match(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, str, int] | None:
    """(activation, weight operand, bias operand, form, flips expected) of a matmul node."""
    if node.op != "call_function":
        return None
    if _op_name(node.target) in _GROUPED_NAMES:
        return node.args[0], node.args[1], None, "grouped_mm", 1
    if node.target in _LINEAR:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[0], node.args[1], bias, "linear", 0
    if node.target in _EINSUM:
        return None  # matched by `_einsum_site` (the weight may be either operand)
    if node.target in _MATMUL:
        w_pos = _MATMUL[node.target]
        bias = node.args[0] if node.target is aten.addmm.default else None
        return node.args[w_pos - 1], node.args[w_pos], bias, node.target._opname, 1
    return None


class AnnotateLinears(PassBase):
    """Annotate maskable matmuls with `meta["patchc_site"]`; collect what was skipped and why.

    Example:
        >>> p = AnnotateLinears(PatchConfig(tile=(16, 16)))
        >>> result = p(gm)          # PassResult; p.sites, p.skipped
    """

    def __init__(self, cfg: PatchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.sites: list[LinearSite] = []
        self.skipped: dict[str, str] = {}
        self.regions: Regions = {}

    def call(self, gm: fx.GraphModule) -> PassResult:
        self.sites, self.skipped = [], {}
        name_tied_weights_first(gm)
        self.regions = region_inputs(gm)
        embedded = _lookup_tensors(gm, self.regions)
        for node in all_nodes(gm):
            site = self._site(gm, node, embedded)
            if site is not None:
                node.meta[META_KEY] = site
                self.sites.append(site)
        self._skip_unhandled(gm, self.sites)
        return PassResult(gm, modified=bool(self.sites))

    def _skip(self, fqn: str, reason: str) -> None:
        self.skipped.setdefault(fqn, reason)

    def _einsum(self, gm: fx.GraphModule, node: fx.Node) -> tuple | None:
        """`_match`'s tuple for an einsum that reads a parameter as a matmul (+ its `EinsumMatmul`)."""
        if node.op != "call_function" or node.target not in _EINSUM or len(node.args[1]) != 2:
            return None
        operands = list(node.args[1])
        found = [i for i, op in enumerate(operands)
                 if isinstance(op, fx.Node) and _weight_of(gm, op, self.regions) is not None]
        if len(found) != 1:
            return None  # activations only (attention), or two weights: `_skip_unhandled` lists those
        i = found[0]
        fqn, weight = _weight_of(gm, operands[i], self.regions)
        form = parse_einsum(str(node.args[0]), i, weight.dim())
        if isinstance(form, str):
            self._skip(fqn, f"read by einsum {node.args[0]!r}: {form}")
            return None
        return operands[1 - i], operands[i], None, "einsum", int(form.transposed), form

    def _site(self, gm: fx.GraphModule, node: fx.Node, embedded: dict[int, str]) -> LinearSite | None:
        matched = _match(node) or self._einsum(gm, node)
        if matched is None or not isinstance(matched[1], fx.Node):
            return None
        x, w_arg, b_arg, form, flips_needed = matched[:5]
        einsum = matched[5] if form == "einsum" else None
        traced = _trace_weight(w_arg, self.regions)
        if traced is None:
            return None  # activation @ activation (attention scores) or a computed weight
        w_node, consumer, flips = traced
        weight = _parameter(gm, w_node.target)
        if weight is None or not weight.is_floating_point():
            return None
        fqn = w_node.target
        if not isinstance(weight, torch.nn.Parameter):  # masks, plans and apply hold parameters only
            self._skip(fqn, "a buffer (register_buffer), not a parameter: patchc masks parameters only")
            return None
        foreign = foreign_subgraph(w_node, self.regions)
        if foreign is not None:  # masking only the reads outside would train a model the plan does not describe
            self._skip(fqn, f"also read inside a {foreign} subgraph, which patchc does not rewrite")
            return None
        grouped = (form == "grouped_mm" or (einsum is not None and einsum.expert_axis is not None)
                   or (form == "bmm" and weight.dim() == 3))  # bmm over a 3-D weight: batch = experts
        if form == "bmm" and grouped and _batch(w_arg) not in (None, weight.shape[0]):
            self._skip(fqn, f"a 3-D weight {tuple(weight.shape)} broadcast to another batch by bmm")
            return None
        if weight.dim() != (3 if grouped else 2):
            self._skip(fqn, f"a {weight.dim()}-D weight {tuple(weight.shape)} read by {form}")
            return None
        transposed = flips % 2 != flips_needed  # stored (K, N): Conv1D, or experts with is_transposed
        if id(weight) in embedded:
            lookup = embedded[id(weight)]
            self._skip(fqn, "shared with an embedding lookup (tied LM head)" if lookup == "aten.embedding.default"
                       else f"also read by a lookup ({lookup}), like a tied LM head: the lookup would read it unmasked")
            return None
        shape = tuple(weight.shape[-2:])
        n, k = shape[::-1] if transposed else shape
        reason = self.cfg.selects(fqn, (n, k))
        if reason is not None:
            self._skip(fqn, reason)
            return None
        if k % 4:
            self._skip(fqn, f"in_features={k} is not a multiple of 4 (no 2:4 groups)")
            return None
        bias = None
        if isinstance(b_arg, fx.Node):
            traced_b = _trace_weight(b_arg, self.regions)
            if traced_b is not None and traced_b[2] == 0:
                bias = traced_b[0].target
        experts = _experts_read(w_arg, weight) if grouped else None
        x_axes = (einsum.k_axis, einsum.expert_axis) if einsum is not None else None
        if form == "bmm" and grouped:
            x_axes = (2, 0)  # x (E, T, K): expert e's rows are x[e]
        return LinearSite(fqn, (int(n), int(k)), node, w_node, consumer or node, x, bias, form, experts, transposed,
                          x_axes)

    def _skip_unhandled(self, gm: fx.GraphModule, sites: list[LinearSite]) -> None:
        """List every other parameter a matmul reads (never silently left dense)."""
        masked = {s.fqn for s in sites}
        for node in gm.graph.nodes:
            if node.op != "get_attr" or node.target in masked or node.target in self.skipped:
                continue
            weight = _parameter(gm, node.target)
            if weight is None or not weight.is_floating_point() or weight.dim() < 2:
                continue
            op = _matmul_reader(node, self.regions)
            if op is not None:
                self._skip(node.target, f"read by {op} in a form patchc does not mask (not x @ W^T)")


def _experts_read(w_arg: fx.Node, weight: torch.Tensor) -> int:
    """How many experts a grouped read takes: the weight's dim 0, or R of a leading slice `W[:R]`."""
    val = w_arg.meta.get("val")
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() == 3 else int(weight.shape[0])


def _batch(node: fx.Node) -> int | None:
    """Dim 0 of a node's traced value (None when the export recorded none)."""
    val = node.meta.get("val")
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() == 3 else None


def _matmul_reader(node: fx.Node, regions: Regions, depth: int = 6) -> str | None:
    """The name of a matmul op that reads `node` through at most `depth` other ops, or None."""
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for user in readers(n, regions):
                if user.op != "call_function":
                    continue
                name = _op_name(user.target).split("::")[-1] or getattr(user.target, "__name__", "")
                if name in _MATMUL_NAMES:
                    return name
                if user.target in _VIEWS:  # only views of the weight itself, never a norm's output
                    nxt.append(user)
        frontier = nxt
    return None


def find_linear_sites(gm: fx.GraphModule, cfg: PatchConfig) -> tuple[list[LinearSite], dict[str, str]]:
    """Run the annotate pass; return (sites, skipped weights with reasons)."""
    annotate = AnnotateLinears(cfg)
    annotate(gm)
    return annotate.sites, annotate.skipped


__all__ = ["AnnotateLinears", "LinearSite", "find_linear_sites", "META_KEY"]
