"""A compiled model written back as the pruned model it serves: `dense_state_dict`, and the `save_pretrained`
that `patchc.compile` gives a transformers model.

transformers' `save_pretrained` writes `model.state_dict()`. In a compiled model that holds each replaced
linear's packed buffers (`dense`, `values`, `meta`, ...), which transformers cannot load: it reports the
weights missing and initialises them at random, so the saved model is silently another one.
`dense_state_dict` is the state dict the model had before `patchc.compile`, with the plan's values (W * M:
zeros where the plan prunes), so the folder loads anywhere; `patchc.compile(loaded)` reads the plan back off
its zeros, and `patchc import` writes patchc's compressed folder from it. It holds every planned weight at
its dense size while the file is written (in host memory: each is moved there as it is unpacked);
`patchc.export.export_pretrained` writes the compressed folder without that.

Example:
    >>> fast = patchc.compile(model, plan)
    >>> fast.save_pretrained("pruned")           # the pruned model, loadable by transformers  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from patchc.runtime.dispatch import BUFFER_NAMES, TileLinear, packed_dense
from patchc.runtime.experts import TileExperts


def dense_state_dict(model: nn.Module, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every `TileLinear` and `TileExperts` written as the weights it replaced:
    W * M in the replaced parameter's name, shape (a Conv1D's (K, N), an experts' stored orientation) and dtype.
    `device`: where those weights go, each as soon as it is unpacked (None: the module's own device), so
    that a model on a GPU never holds more than one unpacked weight there.

    Example:
        >>> sd = dense_state_dict(patchc.compile(model, plan)); sd["model.layers.0.mlp.up_proj.weight"].shape
        ... # doctest: +SKIP
    """
    state = model.state_dict()
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, TileLinear):
            for name in BUFFER_NAMES:
                state.pop(prefix + name, None)
            w = packed_dense(module, (module.out_features, module.in_features)).to(device)
            state[prefix + "weight"] = w.t().contiguous() if module.stored_kn else w
        elif isinstance(module, TileExperts):
            dropped = {f"{prefix}{proj}_dense" for proj in module.names}
            for key in [k for k in state if k in dropped or k.startswith(f"{prefix}kernels.")]:
                del state[key]
            weights = {proj: _expert_weights(module, proj).to(device) for proj in module.names}  # (E, N, K)
            state.update({prefix + name: w for name, w in module.replaced_weights(weights).items()})
    return state


def save_pretrained(model: nn.Module, save_directory: Any, *args: Any, state_dict: dict | None = None,
                    **kwargs: Any) -> Any:
    """transformers' `save_pretrained` of `model`, of `dense_state_dict(model, "cpu")` unless a `state_dict` is
    given (the file is written from host memory anyway: the unpacked weights never gather on a GPU)."""
    state = dense_state_dict(model, "cpu") if state_dict is None else state_dict
    return type(model).save_pretrained(model, save_directory, *args, state_dict=state, **kwargs)


def give_save_pretrained(model: nn.Module) -> None:
    """Make `model.save_pretrained` (a transformers model's; `push_to_hub` calls it) write the dense state."""
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = functools.partial(save_pretrained, model)


def _expert_weights(experts: TileExperts, proj: str) -> torch.Tensor:
    """(E, N, K) W * M of one projection: the CPU fallback's stack, or the grouped kernel's stacked buffers,
    where each expert takes ceil(N / block rows) whole block rows."""
    dense = getattr(experts, f"{proj}_dense", None)
    if dense is not None:
        return dense.detach()  # a state dict holds the module's own tensors
    kernel = experts.kernels[proj]
    n, k, e = kernel.out_features, kernel.in_features, kernel.num_experts
    rows = math.ceil(n / kernel.block[0]) * kernel.block[0]
    return packed_dense(kernel, (e * rows, k)).reshape(e, rows, k)[:, :n].contiguous()


__all__ = ["dense_state_dict", "give_save_pretrained", "save_pretrained"]
