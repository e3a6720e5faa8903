"""The layers a plain model's calibration and one-shot pruning cover, and how their inputs are observed.

They are the layers `patchc.transform` masks, under the same plan layer names (`patchc.ir.targets`):

    nn.Linear            "<module>.weight"             forward pre-hook: x (..., K)
    GPT-2 Conv1D         "<module>.weight"  (K, N)     forward pre-hook: x (..., K)
    fused MoE experts    "<3-D parameter>.<expert>"    a TorchFunctionMode sees the grouped matmul
                                                       (x sorted by expert, `offs` = row ends), the
                                                       eager loop's F.linear on one expert's slice, or
                                                       a bmm over every expert (Llama 4: x[e])
    flat experts (DBRX)  "<2-D parameter>"              run in their traced form (every expert on every
                                                       token, `patchc.models.traceable`), the matmul
                                                       reading the whole flat weight

so an expert's statistics hold only the tokens routed to it (Llama 4's block runs in its traced form, the
picked pairs only, each row scaled by its router score; DBRX's traced form hands every expert every token,
scaled by its routing weight: 0 where not routed). Embeddings, tied LM heads and
anything matched by `exclude` (routers among them) are left out.

Example:
    >>> layers = plain_layers(model)                 # {"model.layers.0.mlp.experts.down_proj.3": 32, ...}
    >>> with observing_plain(model, set(layers), callback):
    ...     model(ids)                               # callback(name, x) per masked matmul input
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from patchc.config import DEFAULT_EXCLUDE
from patchc.ir import targets
from patchc.ir.targets import is_conv1d

_EXPERT_PROJECTIONS = ("gate_up_proj", "up_proj", "gate_proj", "down_proj")
_LINEAR = (F.linear, torch._C._nn.linear)
_MATMUL = (torch.matmul, torch.mm, torch.bmm)


def _matmul_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(layer name, module) of every nn.Linear / Conv1D, once per module. A weight several modules share (Zamba's
    shared block) is named as `named_parameters()` and `patchc.transform` name it, for each of them."""
    first = targets.weight_names(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or is_conv1d(module):
            yield first.get(id(module.weight), f"{name}.weight" if name else "weight"), module


def flat_expert_params(model: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """FQN -> (2-D parameter, stored (K, N)) of every flat experts weight (`targets.flat_experts`: DBRX's)."""
    return {f"{name}.{w}" if name else w: (getattr(module, w), stored)
            for name, module in model.named_modules() for w, stored in targets.flat_experts(module).items()}


def expert_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> 3-D parameter of every fused-experts module (one holding a 3-D `down_proj`)."""
    out = {}
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        if not (isinstance(down, nn.Parameter) and down.dim() == 3):
            continue
        for pname in _EXPERT_PROJECTIONS:
            p = getattr(module, pname, None)
            if isinstance(p, nn.Parameter) and p.dim() == 3 and p.is_floating_point():
                out[f"{name}.{pname}" if name else pname] = p
    return out


def plain_layers(model: nn.Module, exclude: Sequence[str] = DEFAULT_EXCLUDE, tied: bool = False) -> dict[str, int]:
    """Plan layer name -> in_features K of every layer `patchc.transform` masks by default
    (`tied`: also weights an nn.Embedding reads)."""
    embedded = set() if tied else {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out: dict[str, int] = {}
    for fqn, module in _matmul_modules(model):
        if id(module.weight) not in embedded and not any(fnmatch.fnmatchcase(fqn, g) for g in exclude):
            out[fqn] = int(module.weight.shape[0] if is_conv1d(module) else module.weight.shape[1])
    for fqn, (p, stored) in flat_expert_params(model).items():
        if not any(fnmatch.fnmatchcase(fqn, g) for g in exclude):
            out[fqn] = int(p.shape[0] if stored else p.shape[1])
    for fqn, p in expert_params(model).items():
        if not any(fnmatch.fnmatchcase(fqn, g) for g in exclude):
            for e in range(targets.held_experts(model.get_submodule(fqn.rpartition(".")[0]))):
                name = targets.layer_name(fqn, e)
                out[name] = int(targets.read(model, targets.resolve(model, name)).shape[1])
    return out


def known_layers(model: nn.Module) -> dict[str, int]:
    """Every layer a plain model's calibration can observe (nothing excluded, tied heads included)."""
    return plain_layers(model, exclude=(), tied=True)


def layer_matrix(model: nn.Module, name: str) -> torch.Tensor:
    """The (N, K) matrix of plan layer `name` in a plain model: a view, so writing it writes the model."""
    return targets.read(model, targets.resolve(model, name))


class _ExpertReads(TorchFunctionMode):
    """Routes the input of each grouped / per-expert matmul on a fused-experts weight to "<fqn>.<e>", and that of a
    matmul reading a whole flat experts weight (`flat`: DBRX's, in its traced form) to "<fqn>"."""

    def __init__(self, params: dict[str, torch.Tensor], callback: Callable[[str, torch.Tensor], None],
                 flat: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.by_storage = {p.untyped_storage().data_ptr(): (fqn, p) for fqn, p in params.items()}
        self.flat = {id(p): fqn for fqn, p in (flat or {}).items()}  # read whole in their traced form
        self.callback = callback

    def _param(self, w) -> tuple[str, torch.Tensor] | None:
        if not isinstance(w, torch.Tensor):
            return None
        return self.by_storage.get(w.untyped_storage().data_ptr())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if len(args) >= 2 and (name in ("_grouped_mm", "grouped_mm_fallback") or "grouped_mm" in str(func)):
            found = self._param(args[1])
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            if found is not None and isinstance(offs, torch.Tensor):
                start = 0
                for e, end in enumerate(int(v) for v in offs.tolist()):
                    self.callback(targets.layer_name(found[0], e), args[0][start:end].detach())
                    start = end
        elif len(args) >= 2 and (func in _LINEAR or func in _MATMUL) and id(args[1]) in self.flat:
            self.callback(self.flat[id(args[1])], args[0].detach())
        elif len(args) >= 2 and (func in _LINEAR or func in _MATMUL):
            found = self._param(args[1])
            w = args[1]
            if found is not None and w.dim() == 2:  # the eager loop: one expert's slice of the 3-D weight
                fqn, p = found
                e = (w.storage_offset() - p.storage_offset()) // p.stride(0)
                self.callback(targets.layer_name(fqn, int(e)), args[0].detach())
            elif found is not None and w.dim() == 3 and w.shape == found[1].shape and args[0].dim() == 3:
                for e, rows in enumerate(args[0].detach()):  # bmm over every expert: x (E, T, K)
                    self.callback(targets.layer_name(found[0], e), rows)
        return func(*args, **kwargs)


@contextlib.contextmanager
def observing_plain(model: nn.Module, names: set[str], callback: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call `callback(layer name, x)` with the input of every matmul of the named layers while inside."""
    handles = []
    for fqn, module in _matmul_modules(model):
        if fqn in names:
            def hook(mod, args, kwargs, _fqn=fqn):
                callback(_fqn, args[0] if args else kwargs["input"])

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    experts = {fqn: p for fqn, p in expert_params(model).items() if any(n.startswith(fqn + ".") for n in names)}
    flat = {fqn: p for fqn, (p, _) in flat_expert_params(model).items() if fqn in names}
    mode = _ExpertReads(experts, callback, flat) if experts or flat else contextlib.nullcontext()
    try:
        with mode, _traced_form(model):
            yield
    finally:
        for h in handles:
            h.remove()


def _traced_form(model: nn.Module):
    """Experts with a traced form run in it (`patchc.models.traceable`), reading what the program's matmuls read:
    DBRX's flat weights whole, by every token (their own loop reads one expert's slice); LongCat-Flash's routed
    experts and Llama 4's picked ones in grouped mms, so an expert no calibration token picks is seen with no
    rows (LongCat's own loop skips it; Llama 4's bmm would give it every token at weight 0)."""
    from patchc.models.traceable import EXPERTS, traceable_layers

    return traceable_layers(model, classes=EXPERTS)


__all__ = ["expert_params", "flat_expert_params", "is_conv1d", "known_layers", "layer_matrix", "observing_plain",
           "plain_layers"]
