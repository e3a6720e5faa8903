"""Where a plan layer lives in a model: a whole 2-D parameter, its transpose, or one expert's slice.

A `LayerPlan` is always (N, K) = (out_features, in_features). Models store weights three ways:

    plain      nn.Linear weight (N, K)                 layer name = the parameter FQN
    transposed GPT-2 Conv1D weight (K, N), DBRX's w2   layer name = the parameter FQN
    expert     fused 3-D experts (E, N, K) or (E, K, N) layer name = "<parameter FQN>.<expert>",
                                                        e.g. "model.layers.0.mlp.experts.gate_up_proj.3"

Hardening records each non-plain layer in `plan.meta["targets"]` ({name: {"param", "expert",
"transposed"}}), so `TilePlan.apply` and the fingerprint check read and write the right slice in the
right orientation. A plan without that record (an older file, `from_weights`) is resolved from the
model: a parameter of that name, or "<3-D parameter>.<int>" for an expert, transposed when the owning
module is a `Conv1D`, an experts module with `is_transposed`, one that multiplies every expert's rows
at once (`bmm_experts`: Llama 4), or DBRX's flat w2 (`flat_experts`). A model wrapped by PEFT (LoRA
adapters beside the pruned weights) is resolved by the names of the model it wraps (`find_param`).

Example:
    >>> t = resolve(model, "model.layers.0.mlp.experts.down_proj.2")
    >>> read(model, t).shape            # (N, K) of expert 2
    torch.Size([32, 64])
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from patchc.ir.errors import PlanError

META_KEY = "targets"
PEFT_PREFIX = "base_model.model."  # where a PeftModel holds the model it wraps
EXPERT_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")  # as transformers names them
# class -> {weight: stored (K, N)} of experts held flat, (E * F, H), and sliced per expert (`flat_experts`)
FLAT_EXPERTS = {"DbrxExpertGLU": {"w1": False, "v1": False, "w2": True}}
# class -> what its own forward adds around transformers' decorated experts forward, which `TileExperts` does too.
# Ergo's gives each (token, expert) pair its expert's RMSNorm, post_expert_norm(y, expert_ids), before the routing
# weight. Any other class that wraps the decorated forward is left dense: the drop-in would skip its steps.
WRAPPED_EXPERTS = {"ErgoExperts": "per_expert"}


@dataclass(frozen=True)
class Target:
    """One (N, K) matrix inside a model parameter.

    `param` is the parameter FQN, `expert` the index along dim 0 of a 3-D parameter (None for 2-D),
    `transposed` True when the stored matrix is (K, N).
    """

    name: str
    param: str
    expert: int | None = None
    transposed: bool = False

    def to_json(self) -> dict:
        return {"param": self.param, "expert": self.expert, "transposed": self.transposed}


def layer_name(param: str, expert: int | None) -> str:
    """The plan layer name of a parameter, or of one expert slice of it ("<param>.<expert>")."""
    return param if expert is None else f"{param}.{expert}"


def expert_slice(name: str) -> tuple[str, int | None]:
    """`layer_name` read back, by its form alone: ("<param>", e) for "<param>.<e>", else (name, None).

    >>> expert_slice("mlp.experts.gate_up_proj.3"), expert_slice("layers.0.mlp.up_proj.weight")
    (('mlp.experts.gate_up_proj', 3), ('layers.0.mlp.up_proj.weight', None))
    """
    param, _, index = name.rpartition(".")
    return (param, int(index)) if param and index.isdigit() else (name, None)


def matrix(weight: torch.Tensor, target: Target) -> torch.Tensor:
    """The (N, K) view of `target` inside the tensor of its parameter."""
    w = weight if target.expert is None else weight[target.expert]
    return w.t() if target.transposed else w


def _owner(model: nn.Module, fqn: str) -> nn.Module | None:
    path = fqn.rpartition(".")[0]
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


def _param(model: nn.Module, fqn: str) -> torch.Tensor | None:
    try:
        return model.get_parameter(fqn)
    except AttributeError:
        return None


def find_param(model: nn.Module, fqn: str) -> str | None:
    """The FQN under which `model` holds the parameter a plan names `fqn`: `fqn` itself, or where PEFT moved
    it (a LoRA-wrapped linear keeps its weight as "<linear>.base_layer.weight"; a `PeftModel` holds the model
    under "base_model.model."); None when it holds none of them."""
    head, _, leaf = fqn.rpartition(".")
    for prefix in ("", PEFT_PREFIX):  # base_layer first: a LoRA layer's `weight` property forwards to it
        for name in (f"{head}.base_layer.{leaf}" if head else None, fqn):
            if name is not None and _param(model, prefix + name) is not None:
                return prefix + name
    return None


def peft_free(fqn: str) -> str:
    """The name a parameter PEFT holds as `fqn` has in the model PEFT wrapped (`find_param`'s inverse).

    A name relative to a LoRA layer ("base_layer.weight", read in a graph that starts inside its forward) is
    relative to the linear it wraps ("weight").

    Example:
        >>> peft_free("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        'model.layers.0.self_attn.q_proj.weight'
    """
    fqn = fqn[len(PEFT_PREFIX):] if fqn.startswith(PEFT_PREFIX) else fqn
    return ("." + fqn).replace(".base_layer.", ".")[1:]


def _guess(model: nn.Module, name: str) -> Target | None:
    """Resolve a layer name without a recorded target (see the module docstring)."""
    found = find_param(model, name)
    if found is not None:
        owner = _owner(model, found)
        stored = type(owner).__name__ == "Conv1D" or flat_experts(owner).get(found.rpartition(".")[2], False)
        return Target(name, found, None, stored)
    param, index = expert_slice(name)
    found = find_param(model, param) if index is not None else None
    weight = _param(model, found) if found is not None else None
    if weight is None or weight.dim() != 3:
        return None
    if index >= weight.shape[0]:
        raise PlanError(f"layer {name}: expert {index} is out of range for {param} with {weight.shape[0]} experts")
    return Target(name, found, index, stored_kn(_owner(model, found)))


def flat_experts(module: nn.Module | None) -> dict[str, bool]:
    """{weight: stored (K, N)} of a module that holds its experts as flat 2-D weights (E * F, H) and slices them
    expert by expert in its forward (`FLAT_EXPERTS`: DBRX's), else {}. patchc traces such experts whole
    (`patchc.models.traceable`), so each flat weight is one plan layer."""
    return FLAT_EXPERTS.get(type(module).__name__, {})


def is_conv1d(module: nn.Module | None) -> bool:
    """transformers' Conv1D (GPT-2): weight stored (K, N), y = x @ W + b."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def stored_kn(experts: nn.Module | None) -> bool:
    """Whether a fused-experts module stores its 3-D weights (E, K, N): it says so (`is_transposed`), or it
    multiplies every expert's rows at once (`bmm_experts`)."""
    return bool(getattr(experts, "is_transposed", False)) or bmm_experts(experts)


def bmm_experts(module: nn.Module | None) -> bool:
    """An experts module whose forward takes the rows alone, grouped by expert, and multiplies them all
    at once (`torch.bmm(x (E, T, K), W (E, K, N))`, Llama 4's): its 3-D weights are stored (E, K, N).
    Routed experts take (hidden_states, top_k_index, top_k_weights)."""
    forward = getattr(module, "forward", None)
    try:
        return forward is not None and len(inspect.signature(forward).parameters) == 1
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def expert_projections(module: nn.Module) -> list[str]:
    """The 3-D weights of a transformers fused-experts module in the form the runtime serves (`TileExperts`:
    gate_up_proj or up_proj, and down_proj, holding the same experts; called routed, (hidden_states,
    top_k_index, top_k_weights), or Llama 4's way), else [] (`why_experts_unserved` says why)."""
    return [] if why_experts_unserved(module) else _expert_weights(module)


def why_experts_unserved(module: nn.Module) -> str | None:
    """Why the runtime's fused-experts drop-ins cannot serve `module`'s 3-D weights, or None when they can."""
    names = _expert_weights(module)
    if "down_proj" not in names or len(names) != 2:
        return (f"3-D weight of a {type(module).__name__}, not a fused-experts module with gate_up_proj/up_proj "
                f"+ down_proj (has {names})")
    if not served_call(module):
        return (f"{type(module).__name__}.forward{inspect.signature(module.forward)} is neither the routed "
                "(hidden_states, top_k_index, top_k_weights) nor Llama 4's (hidden_states) form")
    wrapper = _wrapping_class(module)
    if wrapper is not None and (wrapper.__name__ not in WRAPPED_EXPERTS or post_expert_norm(module) is None):
        return (f"{wrapper.__name__}.forward wraps transformers' experts forward with steps of its own, which "
                "the runtime's drop-in would skip")
    counts = {p: getattr(module, p).shape[0] for p in names}
    if len(set(counts.values())) > 1 and not zero_computation_experts(module):
        held = ", ".join(f"{p}: {n}" for p, n in counts.items())
        return f"its projections hold different numbers of experts ({held}): the runtime serves experts every one holds"
    return None


def held_experts(module: nn.Module) -> int:
    """How many experts every 3-D projection of a fused-experts module holds: the ones it computes. LongCat-Flash's
    gate_up_proj also holds rows for its zero-computation experts, which no token reads (`zero_computation_experts`).

    Example:
        >>> held_experts(longcat.model.layers[0].mlp.experts)      # gate_up_proj (8, ...), down_proj (4, ...)
        4
    """
    return min(getattr(module, p).shape[0] for p in _expert_weights(module))


def zero_computation_experts(module: nn.Module) -> int:
    """How many routing ids past the held experts give their token back unchanged (LongCat-Flash's
    `zero_expert_num`, ids num_routed_experts.. of its router), else 0. Only a module that says so, with the
    routed experts exactly the ones every projection holds, counts."""
    extra, routed = getattr(module, "zero_expert_num", None), getattr(module, "num_routed_experts", None)
    if not (isinstance(extra, int) and isinstance(routed, int) and extra > 0 and _expert_weights(module)):
        return 0
    return extra if held_experts(module) == routed else 0


def post_expert_norm(module: nn.Module) -> str | None:
    """How a fused-experts module norms each expert's output before the routing weight: "plain" (transformers'
    `has_post_expert_norm`: post_expert_norm(y)), "per_expert" (a `WRAPPED_EXPERTS` class's own forward:
    post_expert_norm(y, expert_ids)), or None."""
    norm = getattr(module, "post_expert_norm", None)
    if not isinstance(norm, nn.Module):
        return None
    if getattr(module, "has_post_expert_norm", False):
        return "plain"
    wrapper = _wrapping_class(module)
    kind = WRAPPED_EXPERTS.get(wrapper.__name__) if wrapper is not None else None
    if kind == "per_expert" and len(inspect.signature(norm.forward).parameters) == 2:
        return kind
    return None


def _wrapping_class(module: nn.Module) -> type | None:
    """The class whose own forward `module` runs when that forward wraps transformers' decorated experts forward
    (`use_experts_implementation`) of a base class, calling it through `super()`; else None."""
    owners = [c for c in type(module).__mro__ if "forward" in vars(c)]
    decorated = [_decorated(vars(c)["forward"]) for c in owners]
    return owners[0] if owners and not decorated[0] and any(decorated) else None


def _decorated(forward: object) -> bool:
    """Whether `forward` is the decorator's dispatching forward: it wraps the class's own (functools.wraps copies
    that one's names) and is defined where the decorator is."""
    module = getattr(forward, "__globals__", {}).get("__name__")
    return hasattr(forward, "__wrapped__") and module == "transformers.integrations.moe"


def _expert_weights(module: nn.Module) -> list[str]:
    """The names of `EXPERT_PROJECTIONS` that `module` holds as 3-D tensors."""
    return [p for p in EXPERT_PROJECTIONS if isinstance(getattr(module, p, None), torch.Tensor)
            and getattr(module, p).dim() == 3]


def served_call(experts: nn.Module) -> bool:
    """Whether an experts module is called in a form the runtime's drop-ins take: Llama 4's forward(rows), or
    the routed forward(hidden_states, top_k_index, top_k_weights) under any parameter names."""
    try:
        routed = len(inspect.signature(experts.forward).parameters) == 3
    except (TypeError, ValueError):
        return False
    return routed or bmm_experts(experts)


def weight_names(module: nn.Module) -> dict[int, str]:
    """{id(parameter): its name}, a weight several modules share (Zamba's shared block) under its first name, as
    `named_parameters()` and state dicts give it: the name patchc plans, calibrates and serves it under."""
    return {id(p): name for name, p in module.named_parameters()}


def model_matrices(model: nn.Module) -> dict[str, Target]:
    """{layer name: Target} for every weight matrix of `model` the runtime serves: `nn.Linear` weights, GPT-2
    `Conv1D` weights (stored (K, N)), each expert's slice of fused-experts weights (`expert_projections`), and
    flat experts weights whole (`flat_experts`: DBRX's w2 stored (K, N)).
    The output embedding (LM head, tied or not) is left out: it is never planned.

    Example:
        >>> sorted(model_matrices(qwen3_moe))[:2]
        ['model.layers.0.mlp.experts.down_proj.0', 'model.layers.0.mlp.experts.down_proj.1']
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}  # a tied head
    first = weight_names(model)
    out: dict[str, Target] = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        conv1d = is_conv1d(module)
        if (isinstance(module, nn.Linear) or conv1d) and module is not head and id(module.weight) not in embedded:
            name = first.get(id(module.weight), f"{prefix}weight")
            out.setdefault(name, Target(name, name, None, conv1d))
        for proj in expert_projections(module):
            param = prefix + proj
            for e in range(held_experts(module)):
                out[layer_name(param, e)] = Target(layer_name(param, e), param, e, stored_kn(module))
        for leaf, transposed in flat_experts(module).items():  # DBRX's: one matrix per flat weight
            if isinstance(getattr(module, leaf, None), torch.Tensor):
                out[prefix + leaf] = Target(prefix + leaf, prefix + leaf, None, transposed)
    return out


def resolve(model: nn.Module, name: str, recorded: Mapping | None = None, shape: tuple | None = None) -> Target:
    """The `Target` of plan layer `name` in `model` (`recorded`: the plan's `meta["targets"]`; `shape`: the
    layer's (N, K), which a parameter must have to be suggested as its submodule's).

    Raises `PlanError` naming the layer when the model has no such parameter or expert.
    """
    entry = (recorded or {}).get(name)
    if entry is not None:
        found = find_param(model, str(entry["param"]))
        if found is None:
            raise PlanError(f"layer {name}: the model has no parameter {entry['param']!r}")
        target = Target(name, found, entry.get("expert"), bool(entry.get("transposed", False)))
        weight = _param(model, found)
        if target.expert is not None and (weight.dim() != 3 or target.expert >= weight.shape[0]):
            raise PlanError(f"layer {name}: {target.param} of shape {tuple(weight.shape)} has no expert {target.expert}")
        return target
    target = _guess(model, name)
    if target is None:
        raise PlanError(f"layer {name}: the model has no parameter {name!r} (nor an expert slice of that name)"
                        + _submodule_hint(model, name, shape))
    return target


def _submodule_hint(model: nn.Module, name: str, shape: tuple | None = None) -> str:
    """Where a plan made on a submodule of `model` finds `name` ("" when no parameter ends with it, or none
    of `shape`: a plan of another model must not be told to compile a submodule)."""
    head = expert_slice(name)[0]
    fits = (lambda p: shape is None or tuple(p.shape[-2:]) in (tuple(shape), tuple(shape)[::-1]))
    found = next((n for n, p in model.named_parameters() if peft_free(n).endswith("." + head) and fits(p)), None)
    if found is None:
        return ""
    sub = peft_free(found)[: -len(head) - 1]
    how = (f"model.{sub} = patchc.compile(model.{sub}, plan)" if all(p.isidentifier() for p in sub.split("."))
           else f"patchc.compile(model.get_submodule({sub!r}), plan)")
    return (f"; the model's {found!r} ends with it: the plan names layers from submodule {sub!r} (compile that: "
            f"{how}; torch.compile(model, backend='patch') matches such names by their values)")


def resolve_layers(plan, model: nn.Module) -> dict[str, Target]:
    """{layer: Target} for every layer of `plan` in `model`, each checked to read as the layer's (N, K);
    `PlanError` naming the first layer the model lacks or holds in another shape."""
    recorded = plan.meta.get(META_KEY)
    out = {}
    for fqn, layer in plan.layers.items():
        target = resolve(model, fqn, recorded, layer.shape)  # a parameter, its transpose or an expert slice
        shape = tuple(read(model, target).shape)
        if shape != layer.shape:
            raise PlanError(f"layer {fqn}: the model's parameter has shape {shape}, the plan {layer.shape}")
        out[fqn] = target
    return out


def read(model: nn.Module, target: Target) -> torch.Tensor:
    """The (N, K) matrix of `target` in `model` (a view: writing to it writes the model)."""
    return matrix(model.get_parameter(target.param), target)


def recorded_targets(targets: Mapping[str, Target]) -> dict[str, dict]:
    """The JSON for `plan.meta["targets"]`: only the non-plain targets (plain ones resolve by name)."""
    return {name: t.to_json() for name, t in targets.items() if t.expert is not None or t.transposed}


def recorded_meta(targets: Mapping[str, Target]) -> dict[str, dict]:
    """{"targets": `recorded_targets`} to merge into a plan's meta, or {} when every target is plain. The backend
    serves a graph's read of an expert slice or a transposed weight only in the orientation recorded."""
    recorded = recorded_targets(targets)
    return {META_KEY: recorded} if recorded else {}


def row_ends(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The row ends grouped matmuls take (`offs`: transformers' grouped mm, patchc's grouped kernels) for rows
    sorted by expert id: each expert's cumulative row end (int32), on the ids' device with no host read (histc,
    not bincount: CUDA's bincount reads the ids' range back). Ids >= `num_experts` (skipped pairs, sorted
    last) are not counted, so their rows lie past the last end.

    Example:
        >>> row_ends(torch.tensor([0, 0, 2, 4]), 3).tolist()
        [2, 2, 3]
    """
    counts = torch.histc(ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    return counts.cumsum(0).to(torch.int32)


__all__ = ["EXPERT_PROJECTIONS", "META_KEY", "PEFT_PREFIX", "WRAPPED_EXPERTS", "Target", "bmm_experts",
           "expert_projections", "find_param", "held_experts", "is_conv1d", "layer_name", "matrix", "model_matrices",
           "peft_free", "post_expert_norm", "read", "recorded_meta", "recorded_targets", "resolve", "resolve_layers",
           "row_ends", "served_call", "stored_kn", "weight_names", "why_experts_unserved", "zero_computation_experts"]
