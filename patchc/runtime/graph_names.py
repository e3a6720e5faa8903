"""The FQNs of the parameters a dynamo graph takes, as the plan names them.

Dynamo names a graph's parameter placeholders by their source in the frame it traced: the compiled
module's forward (``L['self']._modules['model']..._parameters['weight']``). After a graph break inside a
parent's forward, the next graph starts in a submodule's forward, and its names are relative to that
submodule: CTRL's ``CTRLLMHeadModel.forward`` breaks before calling ``self.transformer``, whose graph reads
``h.0.multi_head_attention.Wq.weight`` where the plan says ``transformer.h.0.multi_head_attention.Wq.weight``.
`parameter_names` matches such a name to the planned weight it ends whose kept values the weight holds
(an encoder's and a decoder's ``layers.0.fc1.weight`` both end in the same name). The same goes the other
way, for a plan made on a submodule of the compiled model (``layers.0.mlp.up_proj.weight`` read as
``model.layers.0.mlp.up_proj.weight``), and for a graph that starts inside a LoRA layer (``base_layer.weight``).
A weight of a block several layers share is read under the path dynamo met it on first, which may not be the
plan's (`named_parameters()`'s) name: it is matched by its values to a planned weight the graph reads under no
name.

Example:
    >>> parameter_names({placeholder: weight}, plan, {placeholder: source_fqn(placeholder)})  # doctest: +SKIP
    ({placeholder: "transformer.h.0.multi_head_attention.Wq.weight"}, {})
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import fx

from patchc.ir.targets import expert_slice, peft_free

# one step of a source: ._modules['x'], .__dict__['_modules']['x'] (a module overriding __getattr__, e.g. PEFT's
# PeftModel / LoraModel), .x or ['x']
_KEY = re.compile(r"(?:\.__dict__\['_(?:modules|parameters|buffers)'\]|\._(?:modules|parameters|buffers))\['([^']*)'\]"
                  r"|\.([A-Za-z_][A-Za-z0-9_]*)|\['([^']*)'\]")


def source_name(node: fx.Node) -> str | None:
    """A placeholder's dynamo source, e.g. "L['self']._modules['lm_head']._parameters['weight']" (None once a
    compile has dropped it)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", None)
    return name if isinstance(name, str) else None


def source_root(name: str | None) -> str | None:
    """The frame local a source starts from: "L['self']", "L['args'][0]"; None for a global or no source."""
    match = re.match(r"L\['[^']*'\](?:\[\d+\])?", name or "")
    return match.group(0) if match else None


def source_fqn(node: fx.Node) -> str | None:
    """The module-relative FQN of a placeholder's source, e.g. "layers.0.mlp.up_proj.weight".

    Example:
        >>> # source L['self']._modules['lm_head']._parameters['weight'] -> "lm_head.weight"
    """
    name = source_name(node)
    if name is None:
        return None
    # the compiled callable is "self" for a module's forward (or whatever its first parameter is called, seen
    # through its ._modules / ._parameters), "fn" / "mod" when dynamo wraps it (nn.Sequential), and args[0]
    # when the forward is wrapped by a decorator taking (*args, **kwargs) (transformers >= 5.2x)
    name = re.sub(r"^L\['(?:self|fn|mod|model|module)'\](?=\.|\[|$)|^L\['args'\]\[0\](?=\.|$)"
                  r"|^L\['[A-Za-z_][A-Za-z0-9_]*'\](?=\._(?:modules|parameters|buffers)\[|\.__dict__\[)", "", name)
    if name == "" or name.startswith("L[") or name.startswith("G["):
        return None  # a plain input or a global, not a parameter of the compiled module
    parts = [next(g for g in m.groups() if g is not None) for m in _KEY.finditer(name)]
    return ".".join(parts) or None


def parameter_names(examples: dict[fx.Node, Any], plan: Any | None,
                    fqns: dict[fx.Node, str | None]) -> tuple[dict[fx.Node, str], dict[str, tuple[str, list[str]]]]:
    """({placeholder: FQN, named as `plan` names its weights} for every parameter placeholder with a source
    FQN in `fqns` (`source_fqn`); {name: (why, the planned weights it might be)} for submodule-relative names
    that end planned weights of their shape but hold none of their values, or the values of several).

    A name the plan lacks is matched to the planned weights it ends ("." + name) whose kept values it holds,
    if exactly one does: the values guard against a like-named weight of another submodule (a vision tower's
    `layers.0.mlp.fc1.weight` beside the text model's)."""
    planned = _planned_params(plan)
    names, unmatched = {}, {}
    for node, value in examples.items():
        fqn = fqns.get(node) if isinstance(value, torch.nn.Parameter) else None
        if fqn is None:
            continue
        if fqn not in planned and peft_free(fqn) in planned:  # a LoRA-wrapped model, planned before wrapping
            fqn = peft_free(fqn)
        stem = peft_free(fqn)  # a graph that starts inside a LoRA layer reads its base weight as "base_layer.weight"
        ends = [p for p in planned if _related(p, stem) and _fits(value, plan.layers[planned[p]])] \
            if fqn not in planned else []
        held = [p for p in ends if _holds(value, plan.layers[planned[p]])]
        if len(held) == 1:
            fqn = held[0]
        elif ends:
            unmatched[fqn] = (f"read as {fqn!r}, a name that ends planned ones (a graph that starts inside a "
                              f"submodule, after a graph break) or that they end (a plan made on a submodule): "
                              f"{'none' if not held else 'more than one'} of the planned weights {ends[:3]} "
                              f"{'holds' if not held else 'hold'} its values", held or ends)
        names[node] = fqn
    _match_aliases(names, examples, plan, planned, unmatched)
    return names, unmatched


def _match_aliases(names: dict[fx.Node, str], examples: dict[fx.Node, Any], plan: Any, planned: dict[str, str],
                   unmatched: dict[str, Any]) -> None:
    """Rename a weight read under another of its names than the plan's to the planned weight of its shape that
    no placeholder of this graph carries and whose kept values it holds, if exactly one does. A block shared by
    several layers has one name per layer; dynamo takes the path it first met the weight on (Zamba2's
    `layers.3.shared_transformer...adapter_list.1.0.weight`, where the plan, as `named_parameters()`, says
    `layers.1...`)."""
    carried = set(names.values())
    free = [p for p in planned if p not in carried]
    for node, fqn in list(names.items()) if free else []:
        if fqn in planned or fqn in unmatched:
            continue
        value = examples[node]
        held = [p for p in free if _fits(value, plan.layers[planned[p]]) and _holds(value, plan.layers[planned[p]])]
        if len(held) == 1:
            names[node] = held[0]
            free.remove(held[0])


def _planned_params(plan: Any | None) -> dict[str, str]:
    """{parameter FQN: one of its plan layers}: a 2-D weight's layer, or an expert slice ("<3-D weight>.<e>")."""
    if plan is None:
        return {}
    targets = (getattr(plan, "meta", None) or {}).get("targets", {})
    out = {}
    for name in plan.layers:
        param = targets.get(name, {}).get("param")
        if param is None:
            param = expert_slice(name)[0]
        out.setdefault(param, name)
    return out


def _related(planned: str, name: str) -> bool:
    """Whether a graph's parameter `name` may be the planned weight `planned`: one ends the other at a dot (the
    graph starts inside a submodule, or the plan was made on a submodule of the compiled model)."""
    return planned.endswith("." + name) or name.endswith("." + planned)


def _fits(value: torch.Tensor, layer: Any) -> bool:
    """Whether `value` has the shape of `layer`'s weight (N, K) or (K, N), or of a 3-D weight it slices."""
    shape = tuple(value.shape[-2:]) if value.dim() in (2, 3) else ()
    return shape in (tuple(layer.shape), tuple(layer.shape)[::-1])


def _holds(value: torch.Tensor, layer: Any) -> bool:
    """Whether `value` (a weight (N, K) or (K, N), or the 3-D weight of an expert slice) keeps `layer`'s values
    where the layer keeps any (either orientation of a square weight)."""
    w = value.detach()
    if w.dim() == 3:
        w = w[expert_slice(layer.name)[1] or 0]
    dense = layer.to_dense().to(w.device, torch.float32)
    kept = dense != 0
    shape = tuple(layer.shape)
    views = [v for v, s in ((w, tuple(w.shape)), (w.t(), tuple(w.shape[::-1]))) if s == shape]
    return any(bool(torch.allclose(v.to(torch.float32)[kept], dense[kept], rtol=1e-2, atol=1e-3)) for v in views)


__all__ = ["parameter_names", "source_fqn", "source_name", "source_root"]
