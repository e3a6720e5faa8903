"""The dynamo backend: ``torch.compile(model, backend="patch", options={"plan": plan})``.

Registered through the ``torch_dynamo_backends`` entry point (``patch =
"patchc.runtime.backend:patch_backend"``), never with ``register_backend`` at import (that would clash
with the entry point's name).

Dynamo hands the backend a Torch-IR graph whose weights are placeholders, and the example inputs of
those placeholders are the real parameters. Each placeholder's source
(``L['self']._modules['layers']._modules['0']..._parameters['weight']``) gives the weight's FQN. Every
matmul that reads a planned weight (a plan layer with at least one 2:4 tile) becomes a call of
``torch.ops.patchc.tile_linear`` on packed tensors: ``F.linear``, ``x @ W.T`` / matmul / mm, GPT-2
Conv1D's ``addmm(b, x, W)`` (W stored (K, N), planned as its (N, K) transpose) and linear-layout einsums
(`patchc.runtime.matmul_reads`). Fused MoE experts (a 3-D weight read by one grouped mm: transformers 5's
``F.grouped_mm`` / ``torch._grouped_mm`` / ``transformers::grouped_mm_fallback``) become
``torch.ops.patchc.tile_grouped_mm``: every expert slice of the weight stacked into one packed layout,
one launch for all experts, the routing offsets read on the device (`patchc.runtime.grouped`); so does
Llama 4's ``bmm`` over every expert (x (E, T, K): row ends T, 2T, ...), and transformers' ``batched_mm``
experts, which gather a weight per token (``bmm(W[ids], x)``: the rows sorted by expert on the device). A
planned weight read in a form neither op can serve (``W @ x``, an einsum with another output layout,
``F.linear(x, W * s)``) is left dense and listed in a warning; with ``options={"strict": True}`` that is a
ValueError. The rest of the graph goes to inductor (CUDA) or aot_eager (CPU, or when inductor cannot be
imported).

Each planned weight is packed once for all the graphs dynamo compiles for a model (a ``generate``'s prompt,
first decode step and dynamic graph; graph breaks): `patchc.runtime.packs`. After a graph break inside a
submodule's forward, dynamo names its weights relative to that submodule and reuses its graph for every
sibling: names are matched to the plan by their ending and kept values (`patchc.runtime.graph_names`), and
each sibling runs a graph compiled for its own weights (`patchc.runtime.weight_graphs`). A frame dynamo runs
eagerly never reaches the backend: `patchc.runtime.unserved(plan)` (`patchc.runtime.coverage`) lists, after
a run, every planned layer no graph served (`unserved(model)` for a model compiled without a plan). Past
`torch._dynamo.config.recompile_limit` graphs of one function (8; torch warns when it is hit) dynamo runs
that frame eagerly from then on, so a weight some graph served can still be read there, dense when the plan
was passed in the options (Kolibri 1.1's decoding): the backend warns when dynamo says it hit the limit. Raise
the limit, or compile the plan-applied model.

Without a plan, one is inferred from the zero pattern of the weights (as `TilePlan.from_weights`, tile from
``options["tile"]``, default (16, 16)), each expert slice of a grouped read on its own: tiles with <= 2
nonzeros per group of 4 are 2:4, the rest dense; layers with no 2:4 tile are left to F.linear. Each weight's
zeros are read once per version, and its layer packed only where no earlier graph packed it
(`patchc.runtime.inferred`).

Options (all optional): plan (a TilePlan or its file), tile, batch_size (16), prefill_len (128), tune (True: tune
on CUDA, cache-backed; "cached"; False), cache, inner ("inductor" / "aot_eager" / "eager" / any backend name),
mode (inductor's, e.g. "reduce-overhead": torch.compile takes ``mode=`` or ``options=``, not both),
strict (False), force (False: a plan made for other weights is refused), graph_callback (called with the
rewritten GraphModule and the number of replaced matmuls; for tests). A tied weight is matched under the
name dynamo saw first (e.g. the embedding's), as `patchc.transform` names it; a plan naming it otherwise
needs `patchc.compile`.

Example:
    >>> cm = torch.compile(model, backend="patch", options={"plan": plan})   # doctest: +SKIP
    >>> cm = torch.compile(pruned_model, backend="patch")                    # doctest: +SKIP
    >>> cm = torch.compile(model, backend="patch", options={"plan": plan, "mode": "reduce-overhead"})  # doctest: +SKIP
    >>> cm = torch.compile(model, backend=patchc.backend(plan), mode="reduce-overhead")  # the same  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import operator
import warnings
from typing import Any, Callable

import torch
from torch import fx

from patchc.ir.targets import peft_free
from patchc.runtime import coverage
from patchc.runtime.dispatch import BUFFER_NAMES, TileLinear, report_unreplaced
from patchc.runtime.grouped import (GroupedRead, bmm_operands, bmm_result, find_grouped_reads, gathered_operands,
                                    gathered_result, grouped_args, grouped_module, servable_grouped)
from patchc.runtime.graph_names import parameter_names, source_fqn, source_name, source_root
from patchc.runtime.matmul_reads import LINEAR, Read, find_reads
from patchc.runtime.op import tile_linear as _op  # noqa: F401  (registers the op)
from patchc.runtime.packs import (check_sources, expert_modules, infer_plan, linear_modules, plan_option,
                                  served_sources)
from patchc.runtime.weight_graphs import PerWeights

log = logging.getLogger(__name__)

OPTION_KEYS = ("plan", "tile", "batch_size", "prefill_len", "tune", "cache", "inner", "mode", "graph_callback",
               "time_fn", "strict", "force")
DEFAULT_TILE = coverage.DEFAULT_TILE
LINEAR_TARGETS = LINEAR


def patch_backend(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
    """Dynamo backend: planned linears -> `patchc::tile_linear`, the rest -> inductor / aot_eager.

    Example:
        >>> cm = torch.compile(model, backend=patch_backend, options={"plan": plan})   # doctest: +SKIP
    """
    coverage.watch_recompile_limit()
    options = dict(kwargs.get("options") or {})
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"patch backend: unknown option(s) {unknown}; known: {list(OPTION_KEYS)}")
    options["plan"] = plan_option(options.get("plan"))  # a TilePlan, or a plan file's path
    # torch.compile refuses mode= beside options=: with a plan, the mode comes in the options
    mode = options.get("mode", kwargs.get("mode"))
    packed: list[int] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fqns = [source_fqn(n) for n in placeholders]  # read now: compiling drops the sources
    roots = [source_root(source_name(n)) for n in placeholders]
    traced = [n.meta.get("example_value", x) for n, x in zip(placeholders, example_inputs)]

    def build(inputs: list[Any], examples: list[Any]) -> Callable[..., Any]:
        """dynamo's graph rewritten for the weights in `inputs` and compiled for `examples`; it takes the packed
        tensors after dynamo's inputs, and keeps the packed modules (shared by `patchc.runtime.packs`) alive."""
        rewritten, extra, keep, weights = rewrite_linears(gm, inputs, options, fqns)
        packed[:] = weights
        if options.get("graph_callback") is not None:
            ops = sum(1 for n in rewritten.graph.nodes if n.target is torch.ops.patchc.tile_linear.default)
            options["graph_callback"](rewritten, ops)
        compiled = _inner_compile(rewritten, [*examples, *extra], options.get("inner"), mode)
        if not extra:
            return compiled

        def run(*args: Any) -> Any:
            return compiled(*args, *extra)

        run.patchc_keep = keep
        return run

    first = build(list(example_inputs), list(example_inputs))
    if not packed:
        return first
    # a graph that starts inside a submodule's forward is reused for its siblings, which pass their own weights:
    # checked on the first packed weight of each frame local they come from (a sibling passes all its own).
    # Compiled from what dynamo traced (fake tensors, sizes symbolic where dynamic): from the sibling call's
    # own tensors, every size would be fixed at that call's
    checked = sorted({roots[i]: i for i in reversed(packed)}.values())
    return PerWeights(lambda inputs: build(inputs, traced), checked, (example_inputs, first))


def rewrite_linears(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any],
                    fqns: list[str | None] | None = None) -> tuple[fx.GraphModule, list[torch.Tensor], Any, list[int]]:
    """A copy of `gm` whose planned matmul reads call `patchc::tile_linear`, the packed tensors, the packed
    modules, which the compiled graph keeps alive (`patchc.runtime.packs` shares them with the model's other
    graphs), and the positions among `gm`'s inputs of the weights they were packed from. `fqns`: the
    placeholders' source FQNs, read before an earlier compile of `gm` dropped them.

    Every form of `patchc.runtime.matmul_reads` is rewritten: linear, `x @ W.T` / matmul / mm, Conv1D's
    `addmm(b, x, W)`, linear-layout einsums. A planned layer (with a 2:4 tile) whose weight this graph
    reads in a form `tile_linear` cannot serve is left dense and listed in a warning (`strict`: ValueError).
    The packed tensors become new trailing placeholders (marked static, like parameters), returned in
    placeholder order for the caller to pass after dynamo's own inputs. (Buffers attached to the graph
    module would need dynamo sources for aot_autograd; plain tensor constants would meet fake tensors.)
    The graph is copied because dynamo keeps using its own graph (its placeholders) after the backend.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = dict(zip(placeholders, example_inputs))
    reads, grouped = find_reads(gm, examples), find_grouped_reads(gm, examples)
    plan, inferred = options.get("plan"), options.get("plan") is None
    fqns = fqns if fqns is not None else [source_fqn(n) for n in placeholders]
    params, unmatched = parameter_names(examples, plan, dict(zip(placeholders, fqns)))
    names = {r.weight: params.get(r.weight) or f"patchc_weight_{i}" for i, r in enumerate([*reads, *grouped])}
    if inferred:
        plan = infer_plan(reads, grouped, names, examples, options.get("tile", DEFAULT_TILE))
    served, left = _servable(plan, reads, names, examples)
    served_grouped, left_grouped = servable_grouped(plan, grouped, names, examples)
    left.update(_unserved(plan, examples, params, {r.weight for r in reads}, {names[r.weight] for r in served_grouped}))
    left.update(left_grouped)
    if not inferred:
        coverage.record(plan, [names[r.weight] for r in [*served, *served_grouped]], left,
                        {c: why for why, ends in unmatched.values() for c in ends})
    else:
        by_name = {names[r.weight]: examples[r.weight] for r in [*reads, *grouped]}  # left names 3-D ones "<w>.*"
        coverage.record_weights([v for v in examples.values() if isinstance(v, torch.nn.Parameter)],
                                [examples[r.weight] for r in [*served, *served_grouped]],
                                [(by_name[n.removesuffix(".*")], why) for n, why in left.items()
                                 if n.removesuffix(".*") in by_name])
    report_unreplaced("patch backend", "left dense in this graph", left, bool(options.get("strict", False)))
    _report_unmatched(unmatched)
    owner_bias = {r.node for r in served if _adds_owner_bias(r, params)}
    checked = not inferred and not options.get("force")
    if checked:  # then a planned layer's bias is the model's own: served from the graph, gradients and all
        biases = {names[r.weight]: examples[r.bias] for r in served if r.node in owner_bias and r.bias in examples}
        check_sources(plan, served_sources(plan, [*served, *served_grouped], names, examples), biases)
    modules = linear_modules(plan, {r.weight: (names[r.weight], examples[r.weight]) for r in served}, options)
    experts = expert_modules(plan, served_grouped, names, examples, options)
    if not modules and not experts:
        return gm, [], None, []
    gm, node_map = _copy_graph_module(gm)
    placeholders = [node_map[n] for n in placeholders]
    modules = {node_map[n]: v for n, v in modules.items()}
    extra, attrs = _attach(gm, [*modules.values(), *experts.values()], placeholders)
    for read in served:
        _replace(gm, read, node_map, *modules[node_map[read.weight]], attrs, not checked and read.node in owner_bias)
    sorts: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # batched_mm: one sort by expert per routing
    for read in served_grouped:
        _replace_grouped(gm, read, node_map, *experts[read.weight], attrs, sorts)
    gm.graph.lint()
    gm.recompile()
    log.info("patch backend: %d matmul call(s) -> patchc::tile_linear, %d grouped -> patchc::tile_grouped_mm",
             len(served), len(served_grouped))
    weights = sorted({placeholders.index(node_map[r.weight]) for r in [*served, *served_grouped]})
    return gm, extra, [mod for _, mod in (*modules.values(), *experts.values())], weights


def _report_unmatched(unmatched: dict[str, tuple[str, list[str]]]) -> None:
    """Warn of weights named like planned ones (after a graph break) that hold none of their values: most
    often an unplanned weight of the same name (a vision tower's fc1 beside the text model's), so not an error
    even with `strict`; `patchc.runtime.unserved(plan)` tells after a run whether a planned one stayed dense."""
    if unmatched:
        warnings.warn(f"patch backend: {len(unmatched)} weight(s) named like planned ones left dense in this graph "
                      "(unplanned weights, or a plan made from other values: after a run, "
                      "patchc.runtime.unserved(plan) names any planned layer no graph served): "
                      + "; ".join(f"{name} ({why})" for name, (why, _) in unmatched.items()), stacklevel=3)


def _adds_owner_bias(read: Read, params: dict[fx.Node, str]) -> bool:
    """Whether `read` adds the bias of its weight's own module, which the plan's bias stands for (plan.apply
    writes it there). A tied weight read by another module (Zamba's shared block) adds that module's bias."""
    if not isinstance(read.bias, fx.Node):
        return False
    weight, bias = params.get(read.weight), params.get(read.bias)
    if weight is None or bias is None:
        return True
    owner, module = weight.rpartition(".")[0], peft_free(bias).rpartition(".")[0]
    return owner == module or owner.endswith("." + module) or module.endswith("." + owner)


def _replace(gm: fx.GraphModule, read: Read, node_map: dict[fx.Node, fx.Node], name: str, mod: TileLinear,
             attrs: dict[str, fx.Node], plan_bias: bool) -> None:
    """Swap one read (in the copied graph) for tile_linear(x) plus the bias it adds: the plan's where it adds
    its weight owner's and that was not checked to be the plan's (`plan_bias`: force), else its own."""
    node = node_map[read.node]
    x = node_map.get(read.x, read.x)
    bias = node_map.get(read.bias, read.bias) if isinstance(read.bias, fx.Node) else read.bias
    add_after = None
    if mod.bias is not None and plan_bias:
        bias = attrs[f"{name}_bias"]
    elif isinstance(bias, fx.Node) and read.form == "addmm":
        add_after, bias = bias, None  # addmm broadcasts its bias: added after the op, any shape
    with gm.graph.inserting_before(node):
        args = list(mod.op_args())
        for j, bname in enumerate(BUFFER_NAMES):
            args[j] = attrs[f"{name}_{bname}"]
        args[7] = bias
        new = gm.graph.call_function(torch.ops.patchc.tile_linear.default, (x, *args))
        if add_after is not None:
            new = gm.graph.call_function(torch.add, (new, add_after))
    _swap(gm, node, new)
    node_map[read.node] = new  # a later read of this result (b(a(x)), LoRA's lora_B(lora_A(x))) takes the new node


def _replace_grouped(gm: fx.GraphModule, read: GroupedRead, node_map: dict[fx.Node, fx.Node], name: str,
                     mod: Any, attrs: dict[str, fx.Node], sorts: dict[fx.Node, tuple[fx.Node, fx.Node]]) -> None:
    """Swap one grouped matmul (in the copied graph) for tile_grouped_mm over every expert of its weight."""
    node = node_map[read.node]
    remap = lambda a: node_map.get(a, a) if isinstance(a, fx.Node) else a  # noqa: E731
    x, offs, buffers = remap(read.x), remap(read.offs), [attrs[f"{name}_{b}"] for b in BUFFER_NAMES]
    with gm.graph.inserting_before(node):
        if read.form == "bmm":  # x (E, T, K): every expert over T rows, those not all zero when no gradient
            # is taken (dynamo guards on grad mode: a call with gradients on traces its own graph)
            x, offs, order = bmm_operands(gm.graph, x, mod.num_experts, mod.in_features, mod.values.device,
                                          skip_zero_rows=not torch.is_grad_enabled())
        elif read.form == "gathered":  # row s of x times expert ids[s]: sorted by expert, then put back
            x, offs, order = gathered_operands(gm.graph, x, remap(read.ids), mod.num_experts, mod.in_features, sorts)
        new = gm.graph.call_function(torch.ops.patchc.tile_grouped_mm.default, grouped_args(x, offs, mod, buffers))
        if read.form == "bmm":
            new = bmm_result(gm.graph, new, mod.num_experts, mod.out_features, order)
        elif read.form == "gathered":
            new = gathered_result(gm.graph, new, order, read.transposed)
    _swap(gm, node, new)
    node_map[read.node] = new
    gather = node_map.get(read.operand)
    if read.form == "gathered" and gather is not None and not gather.users:
        gm.graph.erase_node(gather)  # W[ids], S expert matrices, would still be gathered for nothing


def _swap(gm: fx.GraphModule, node: fx.Node, new: fx.Node) -> None:
    """`new` takes `node`'s uses, its value and its source line (what later passes and errors read)."""
    new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "example_value", "stack_trace")})
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _planned(plan: Any, fqn: str) -> bool:
    layer = plan.layers.get(fqn)
    return layer is not None and layer.n_sparse > 0


def _servable(plan: Any, reads: list[Read], names: dict[fx.Node, str],
              examples: dict[fx.Node, Any]) -> tuple[list[Read], dict[str, str]]:
    """(reads to rewrite, {planned layer left dense: why}); a layer is served only if all its reads are."""
    recorded = (getattr(plan, "meta", None) or {}).get("targets", {})
    why: dict[str, str] = {}
    for read in reads:
        fqn = names[read.weight]
        if not _planned(plan, fqn):
            continue
        entry = recorded.get(fqn)
        if read.reason is not None:
            why.setdefault(fqn, read.reason)
        elif entry is not None and bool(entry.get("transposed")) != read.transposed:
            why.setdefault(fqn, f"read {'as stored (K, N)' if read.transposed else 'as x @ W^T'} by {read.form}, "
                                "but the plan records the other orientation")
    served = [r for r in reads if _planned(plan, names[r.weight]) and names[r.weight] not in why]
    for read in served:
        w = examples[read.weight]
        expect = tuple(w.shape[::-1]) if read.transposed else tuple(w.shape)
        if expect != tuple(plan.layers[names[read.weight]].shape):
            raise ValueError(f"patch backend: layer {names[read.weight]!r} is read as a {expect} (N, K) matrix by "
                             f"{read.form} but the plan has {plan.layers[names[read.weight]].shape}")
    return served, why


def _unserved(plan: Any, examples: dict[fx.Node, Any], params: dict[fx.Node, str], read: set[fx.Node],
              grouped: set[str]) -> dict[str, str]:
    """{layer: why} for every planned weight this graph takes that no read serves: a 2-D weight in no matmul
    form (`F.linear(x, W * s)`), or a fused-experts weight ("<3-D weight>.*") that no grouped mm or bmm of
    `grouped` reads (e.g. an eager loop over the experts)."""
    out = {}
    for node, value in examples.items():
        fqn = params.get(node)
        if fqn is None:
            continue
        if value.dim() == 2 and node not in read and _planned(plan, fqn):
            ops = sorted({str(getattr(u.target, "__name__", u.target)) for u in node.users if u.op != "output"})
            out[fqn] = f"read only by {', '.join(ops) or 'nothing'}, not by a matmul form the backend rewrites"
        elif value.dim() == 3 and fqn not in grouped and any(_planned(plan, f"{fqn}.{e}") for e in range(len(value))):
            out[f"{fqn}.*"] = _why_unserved(node)
    return out


def _why_unserved(weight: fx.Node) -> str:
    """Why a planned 3-D weight is not served. A weight indexed by a tensor (gathered per token) that no bmm
    multiplies is served after switching transformers' experts to `grouped_mm`."""
    gathered = any(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], fx.Node)
                   for u in weight.users)
    if gathered:
        return ("fused expert slices (3-D weight) gathered per token (W[ids]) and multiplied other than by a bmm: "
                "call model.set_experts_implementation(\"grouped_mm\") before torch.compile, or use patchc.compile")
    return "fused expert slices (3-D weight) read other than by a grouped mm: patchc.compile serves them (TileExperts)"


def _copy_graph_module(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A new GraphModule over a copied graph, keeping what aot_autograd reads from dynamo's module."""
    graph = fx.Graph()
    node_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, node_map)
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(out).meta.update(old_output.meta)
    for old, new in node_map.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new_gm._param_name_to_source = gm._param_name_to_source
    return new_gm, node_map


def _attach(gm: fx.GraphModule, modules: list[tuple[str, TileLinear]],
            placeholders: list[fx.Node]) -> tuple[list[torch.Tensor], dict[str, fx.Node]]:
    """New trailing placeholders for the packed tensors: (tensors, {name: placeholder})."""
    tensors: list[torch.Tensor] = []
    nodes: dict[str, fx.Node] = {}
    last = placeholders[-1] if placeholders else None
    for name, mod in modules:
        for bname in (*BUFFER_NAMES, "bias"):
            t = getattr(mod, bname)
            if t is None:
                continue
            if last is None:
                with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
                    node = gm.graph.placeholder(f"{name}_{bname}")
            else:
                with gm.graph.inserting_after(last):
                    node = gm.graph.placeholder(f"{name}_{bname}")
            node._dynamo_source = None  # read by aot_autograd's dynamo metadata; None = no user source
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}  # static, like a parameter
            node.meta["val"] = t
            last = node
            tensors.append(t)
            nodes[f"{name}_{bname}"] = node
    return tensors, nodes


def _inner_compile(gm: fx.GraphModule, example_inputs: list[Any], inner: str | None, mode: str | None) -> Callable:
    """Hand the rewritten graph to inductor (CUDA) or aot_eager (CPU / inductor unavailable)."""
    if inner is None:
        on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
        inner = "inductor" if on_cuda else "aot_eager"
    if inner == "inductor":
        try:
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx
        except Exception as e:  # inductor missing or broken on this install
            log.warning("patch backend: inductor unavailable (%s); using aot_eager", e)
            inner = "aot_eager"
        else:
            patches = list_mode_options(mode) if mode else {}
            return compile_fx(gm, example_inputs, config_patches=patches)
    from torch._dynamo import lookup_backend

    return lookup_backend(inner)(gm, example_inputs)
