"""What a model call returns, and where a model lives: helpers shared by the loaders, evaluation and training.

Example:
    >>> logits_of(hf_model(ids)).shape        # an HF ModelOutput, a tuple or a plain tensor
    torch.Size([1, 8, 32000])
    >>> device_of(model)
    device(type='cpu')
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def output_tensor(out: Any, field: str, what: str, caller: str = "model") -> torch.Tensor:
    """The tensor a model call returned: the call's value itself, its `field` (an HF ModelOutput), or the
    first element of a tuple; `TypeError` saying `what` was expected otherwise."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, field):
        return getattr(out, field)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"{caller} returned {type(out).__name__}; expected {what}")


def logits_of(out: Any) -> torch.Tensor:
    """The (B, T, V) logits of a model call: a plain tensor, an HF ModelOutput (.logits) or a tuple."""
    return output_tensor(out, "logits", "logits (B, T, V)")


def device_of(model: Any, fallback: str | torch.device = "cpu") -> torch.device:
    """Device of a module's first parameter (or buffer), or the device a streamed model runs on
    (`patchc.models.offload`); `fallback` for anything else."""
    if isinstance(model, nn.Module):
        from patchc.models.offload import streaming

        stream = streaming(model)
        if stream is not None:
            return stream.device
        for t in model.parameters():
            return t.device
        for t in model.buffers():
            return t.device
    return torch.device(fallback)
