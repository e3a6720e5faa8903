"""The suite's reuse of llama2c exports: one `torch.export` per structure and process, not one per job.

About twenty tests run whole `patchc prune` / `eval` jobs on stories260K in-process, and each job exports
the model afresh: 2.2-5 s each, a minute of the suite's CPU time for the same graph. The product has no
use for such a cache (a user runs one job per process). Within the suite the graph depends only on the
model's structure, so `reuse_llama2c_exports` hands a later job a copy of the first graph bound to *its
own* model's parameters and buffers, as a fresh export would be (a fresh export's state_dict holds the
module's own tensors, so the job's in-place edits of the model show in it).

A call is served from the cache only when nothing could make a fresh export differ: the same model class,
config, module tree (each class's `forward` function too), parameter and buffer names / shapes / dtypes /
devices and example shape, no hooks and no instance-level `forward`, and `torch.export.export` itself
not patched by a test.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Hashable

import torch
from torch import nn

_ORIGINAL_EXPORT = torch.export.export


def _structure(model: nn.Module, batch: int, seq: int) -> Hashable | None:
    """What the exported graph depends on; None when the model carries something that could change it."""
    if torch.export.export is not _ORIGINAL_EXPORT:
        return None
    tree = []
    for name, module in model.named_modules():
        if "forward" in vars(module) or module._forward_hooks or module._forward_pre_hooks:
            return None
        tree.append((name, type(module), type(module).forward, module.training))  # a patched class forward too
    tensors = tuple((k, tuple(t.shape), t.dtype, t.device, t.requires_grad)
                    for k, t in model.state_dict(keep_vars=True).items())
    buffers = tuple((k, tuple(b.shape), b.dtype, b.device) for k, b in model.named_buffers())
    return type(model), repr(getattr(model, "config", None)), tuple(tree), tensors, buffers, batch, seq


def _rebound(ep: torch.export.ExportedProgram, model: nn.Module) -> torch.export.ExportedProgram:
    """A deep copy of `ep` whose weights and buffers are `model`'s own tensors (not copies of the first's)."""
    live = {**dict(model.named_buffers()), **model.state_dict(keep_vars=True)}
    missing = [k for k in ep.state_dict if k not in live]
    if missing:
        raise KeyError(f"export cache: the model has no {missing[:3]}: its structure key is incomplete")
    memo = {id(t): live[k] for k, t in (*ep.state_dict.items(), *ep.constants.items()) if k in live}
    return _copy(ep, memo)


def _copy(ep: torch.export.ExportedProgram, memo: dict | None = None) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():  # torch's own pytree specs warn about themselves when deep-copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(ep, memo)


def reuse_llama2c_exports(export_llama: Callable) -> Callable:
    """`export_llama`, but a structure it exported before comes back as a rebound copy."""
    cache: dict[Hashable, torch.export.ExportedProgram] = {}

    def export(model: nn.Module, batch: int = 2, seq: int = 16) -> torch.export.ExportedProgram:
        key = _structure(model, batch, seq)
        if key is None:
            return export_llama(model, batch, seq)
        if key not in cache:
            ep = export_llama(model, batch, seq)
            cache[key] = _copy(ep)  # pristine: the job rewrites the graph it is handed
            return ep
        return _rebound(cache[key], model)

    export.cache = cache
    return export
