"""The dynamo backend: ``torch.compile(model, backend="patch", options={"plan": plan})``.

Registered through the ``torch_dynamo_backends`` entry point (``patch =
"patchc.runtime.backend:patch_backend"``), never with ``register_backend`` at import (that would clash
with the entry point's name).

Dynamo hands the backend a Torch-IR graph: builtin ``torch._C._nn.linear`` / ``F.linear`` calls whose
weights are placeholders, and the example inputs of those placeholders are the real parameters. Each
placeholder's source (``L['self']._modules['layers']._modules['0']..._parameters['weight']``) gives the
weight's FQN. Every linear whose weight has a plan layer with at least one 2:4 tile becomes a call of
``torch.ops.patchc.tile_linear`` on packed buffers attached to the graph module; the rest of the graph
goes to inductor (CUDA) or aot_eager (CPU, or when inductor cannot be imported).

Without a plan, one is inferred from the zero pattern of the weights (`TilePlan.from_weights`, tile from
``options["tile"]``, default (16, 16)): tiles with <= 2 nonzeros per group of 4 are 2:4, the rest dense;
layers with no 2:4 tile are left to F.linear.

Options (all optional): plan, tile, batch_size (16), prefill_len (128), tune (True: tune on CUDA,
cache-backed; "cached"; False), cache, inner ("inductor" / "aot_eager" / "eager" / any backend name),
graph_callback (called with the rewritten GraphModule and the number of replaced linears; for tests).
A tied weight is matched under the name dynamo saw first (e.g. the embedding's), so plan such layers
under that name or use `patchc.compile`.

Example:
    >>> cm = torch.compile(model, backend="patch", options={"plan": plan})   # doctest: +SKIP
    >>> cm = torch.compile(pruned_model, backend="patch")                    # doctest: +SKIP
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx

from patchc.runtime.dispatch import BUFFER_NAMES, TileLinear
from patchc.runtime.op import tile_linear as _op  # noqa: F401  (registers the op)

log = logging.getLogger(__name__)

OPTION_KEYS = ("plan", "tile", "batch_size", "prefill_len", "tune", "cache", "inner", "graph_callback", "time_fn")
DEFAULT_TILE = (16, 16)
LINEAR_TARGETS = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)
_KEY = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]|\.([A-Za-z_][A-Za-z0-9_]*)|\['([^']*)'\]")


def patch_backend(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
    """Dynamo backend: planned linears -> `patchc::tile_linear`, the rest -> inductor / aot_eager.

    Example:
        >>> cm = torch.compile(model, backend=patch_backend, options={"plan": plan})   # doctest: +SKIP
    """
    options = dict(kwargs.get("options") or {})
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"patch backend: unknown option(s) {unknown}; known: {list(OPTION_KEYS)}")
    gm, extra = rewrite_linears(gm, example_inputs, options)
    callback = options.get("graph_callback")
    if callback is not None:
        callback(gm, sum(1 for n in gm.graph.nodes if n.target is torch.ops.patchc.tile_linear.default))
    compiled = _inner_compile(gm, [*example_inputs, *extra], options.get("inner"), kwargs.get("mode"))
    return _append_inputs(compiled, extra)


def _append_inputs(compiled: Callable[..., Any], extra: list[torch.Tensor]) -> Callable[..., Any]:
    """The compiled graph takes the packed tensors as trailing inputs; dynamo calls it without them."""
    if not extra:
        return compiled
    def run(*args: Any) -> Any:
        return compiled(*args, *extra)

    return run


def source_fqn(node: fx.Node) -> str | None:
    """The module-relative FQN of a placeholder's source, e.g. "layers.0.mlp.up_proj.weight".

    Example:
        >>> # source L['self']._modules['lm_head']._parameters['weight'] -> "lm_head.weight"
    """
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", None)
    if not isinstance(name, str):
        return None
    # the compiled callable is "self" for a module's forward, "fn" / "mod" when dynamo wraps it (nn.Sequential)
    name = re.sub(r"^L\['(?:self|fn|mod|model|module)'\](?=\.|\[|$)", "", name)
    if name == "" or name.startswith("L[") or name.startswith("G["):
        return None  # a plain input or a global, not a parameter of the compiled module
    parts = [next(g for g in m.groups() if g is not None) for m in _KEY.finditer(name)]
    return ".".join(parts) or None


def rewrite_linears(gm: fx.GraphModule, example_inputs: list[Any],
                    options: dict[str, Any]) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A copy of `gm` whose planned linears call `patchc::tile_linear`, and the packed tensors.

    The packed tensors become new trailing placeholders (marked static, like parameters), returned in
    placeholder order for the caller to pass after dynamo's own inputs. (Buffers attached to the graph
    module would need dynamo sources for aot_autograd; plain tensor constants would meet fake tensors.)
    The graph is copied because dynamo keeps using its own graph (its placeholders) after the backend.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = dict(zip(placeholders, example_inputs))
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS]
    weights: dict[fx.Node, tuple[str, torch.Tensor]] = {}
    for i, node in enumerate(linears):
        w = _arg(node, 1, "weight")
        if isinstance(w, fx.Node) and w.op == "placeholder" and isinstance(examples.get(w), torch.Tensor):
            weights[w] = (source_fqn(w) or f"patchc_linear_{i}.weight", examples[w])
    plan = options.get("plan")
    if plan is None:
        plan = _infer_plan(weights.values(), options.get("tile", DEFAULT_TILE))
    modules = _modules(plan, weights, options)
    if not modules:
        return gm, []
    gm, node_map = _copy_graph_module(gm)
    placeholders = [node_map[n] for n in placeholders]
    linears = [node_map[n] for n in linears]
    modules = {node_map[n]: v for n, v in modules.items()}
    extra, attrs = _attach(gm, modules, placeholders)
    count = 0
    for node in linears:
        w = _arg(node, 1, "weight")
        if w not in modules:
            continue
        name, mod = modules[w]
        x, bias = _arg(node, 0, "input"), _arg(node, 2, "bias")
        with gm.graph.inserting_before(node):
            args = list(mod.op_args())
            for j, bname in enumerate(BUFFER_NAMES):
                args[j] = attrs[f"{name}_{bname}"]
            if mod.bias is not None:
                args[7] = attrs[f"{name}_bias"]
            else:
                args[7] = bias  # the plan has no bias: keep the model's (a placeholder or None)
            new = gm.graph.call_function(torch.ops.patchc.tile_linear.default, (x, *args))
        new.meta.update({k: v for k, v in node.meta.items() if k in ("val", "example_value", "stack_trace")})
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    gm.graph.lint()
    gm.recompile()
    log.info("patch backend: %d linear call(s) -> patchc::tile_linear", count)
    return gm, extra


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


def _arg(node: fx.Node, i: int, name: str) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name)


def _infer_plan(weights: Any, tile: Any) -> Any:
    """A plan from the zero pattern of the graph's linear weights (layers with a 2:4 tile only)."""
    from patchc.ir import TilePlan

    state = {fqn: w.detach() for fqn, w in weights}
    plan = TilePlan.from_weights(state, tile=tuple(tile) if not isinstance(tile, int) else (tile, tile))
    for fqn in [f for f, layer in plan.layers.items() if int((layer.kinds == 1).sum()) == 0]:
        del plan.layers[fqn]
    return plan


def _modules(plan: Any, weights: dict[fx.Node, tuple[str, torch.Tensor]],
             options: dict[str, Any]) -> dict[fx.Node, tuple[str, TileLinear]]:
    """Build (and tune) one TileLinear per planned weight placeholder; attach them to nothing yet."""
    from patchc.runtime.compile import _tunings

    planned = {node: (fqn, w) for node, (fqn, w) in weights.items()
               if fqn in plan.layers and int((plan.layers[fqn].kinds == 1).sum()) > 0}
    for node, (fqn, w) in planned.items():
        if tuple(w.shape) != tuple(plan.layers[fqn].shape):
            raise ValueError(f"patch backend: layer {fqn!r} has shape {tuple(w.shape)} in the model but "
                             f"{plan.layers[fqn].shape} in the plan")
    if not planned:
        return {}
    bs, pl = int(options.get("batch_size", 16)), int(options.get("prefill_len", 128))
    first = next(iter(planned.values()))[1]
    tunings = _tunings(plan, sorted({f for f, _ in planned.values()}), bs, pl, options.get("tune", True), first,
                       options.get("cache"), options.get("time_fn"), False)
    out = {}
    for i, (node, (fqn, w)) in enumerate(planned.items()):
        mod = TileLinear.from_plan(plan.layers[fqn], tunings.get(fqn), dtype=w.dtype, device=w.device,
                                   batch_size=bs, prefill_len=pl)
        out[node] = (f"_patchc_{i}", mod)
    return out


def _attach(gm: fx.GraphModule, modules: dict[fx.Node, tuple[str, TileLinear]],
            placeholders: list[fx.Node]) -> tuple[list[torch.Tensor], dict[str, fx.Node]]:
    """New trailing placeholders for the packed tensors: (tensors, {name: placeholder})."""
    tensors: list[torch.Tensor] = []
    nodes: dict[str, fx.Node] = {}
    last = placeholders[-1] if placeholders else None
    for name, mod in modules.values():
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
