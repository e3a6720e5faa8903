"""Perplexity of a causal LM over a long token stream (fixed-context windows, HF-style striding).

Example:
    >>> from patchc.models import SHARED_DIR, STORIES260K_DIR, load_llama2c, load_tokenizer
    >>> from patchc.job.data import load_documents, tokenize_documents
    >>> model = load_llama2c(STORIES260K_DIR / "stories260K.bin")
    >>> tok = load_tokenizer(STORIES260K_DIR / "tok512.bin")
    >>> ids = tokenize_documents(load_documents(SHARED_DIR / "data/tinystories_sample.txt"), tok)
    >>> round(perplexity(model, ids, context=256), 2)
    5.59
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from patchc.models.outputs import device_of, logits_of
from patchc.utils.chunks import GPU_LOSS_ELEMENTS, rows_at_once


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) next-token NLL in fp32 of (B, T, V) logits of any float dtype at (B, T) targets, a few positions
    at a time, each upcast on its own (`rows_at_once`; on a GPU `GPU_LOSS_ELEMENTS`): the same numbers as one
    cross-entropy of the upcast batch, without its fp32 temporaries of the batch's size (a bf16 model's logits
    upcast, the log-softmax: 411 MB apiece for 8 windows of 256 of a 50K vocabulary, 5 GB at 8 x 1,024 of
    152K), which a CPU would also map and zero afresh every batch."""
    n = rows_at_once(logits[0], GPU_LOSS_ELEMENTS)
    return torch.stack([torch.cat([F.cross_entropy(row[i:i + n].float(), target[i:i + n], reduction="none")
                                   for i in range(0, len(target), n)]) for row, target in zip(logits, targets)])


def _windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) per window, as in HF's perplexity guide: each window scores its last
    `end - prev_end` targets, clipped to the end - begin - 1 predictions the window has."""
    out = []
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        scored = min(end - prev_end, end - begin - 1)
        if scored > 0:
            out.append((begin, end, scored))
        prev_end = end
        if end == n:
            break
    return out


@torch.no_grad()
def perplexity(
    model: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    context: int = 256,
    stride: int | None = None,
    batch_size: int = 8,
    device: torch.device | str | None = None,
) -> float:
    """exp(mean next-token NLL) of `model` over the 1-D token stream `ids`.

    Protocol (the Hugging Face "perplexity of fixed-length models" recipe):
      * windows start at 0, stride, 2*stride, ... and hold up to `context` tokens; the last window is
        cut at the end of the stream (and the loop stops there);
      * stride == context (the default, stride=None): non-overlapping windows, each scored on all its
        next-token predictions (context - 1 per full window: the first token of a window is context
        only, never a target);
      * stride < context: sliding windows; each window scores only its last `end - prev_end` targets
        (the ones no earlier window scored, at most `stride`), so every scored token sees up to
        `context - stride` tokens of history. The first window scores all of its predictions.
    The mean is over all scored targets (token weighted, float64 accumulation). The stream is scored
    as given: put BOS tokens in `ids` yourself (see `patchc.job.data.tokenize_documents`).

    `model` is any callable mapping a (B, T) long tensor to logits (B, T, V) (or an object with .logits),
    including an exported program's `.module()`; nn.Modules are switched to eval mode where they allow
    it and put back afterwards. `device` defaults to the model's parameter device.

    Example:
        >>> perplexity(model, ids, context=256)               # non-overlapping windows
        >>> perplexity(model, ids, context=256, stride=128)   # sliding window, HF style
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D token stream, got shape {tuple(ids.shape)}")
    stride = context if stride is None else stride
    if context < 2:
        raise ValueError(f"context must be >= 2 (one input and one target), got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    windows = _windows(ids.numel(), context, stride)
    if not windows:
        raise ValueError(f"need at least 2 tokens to score, got {ids.numel()}")
    device = torch.device(device) if device is not None else device_of(model)
    ids = ids.to(device=device, dtype=torch.long)

    was_training = None
    if isinstance(model, nn.Module):
        was_training = model.training
        try:
            model.eval()
        except (NotImplementedError, RuntimeError):  # e.g. exported programs' modules refuse .eval()
            was_training = None

    nll_sum = 0.0
    count = 0
    try:
        # Batch windows of equal length together (all but possibly the last have length `context`).
        groups: dict[int, list[tuple[int, int, int]]] = {}
        for w in windows:
            groups.setdefault(w[1] - w[0], []).append(w)
        for length, group in groups.items():
            for i in range(0, len(group), batch_size):
                chunk = group[i : i + batch_size]
                x = torch.stack([ids[b:e] for b, e, _ in chunk])
                nll = token_nll(logits_of(model(x))[:, :-1], x[:, 1:])
                for row, (_, _, scored) in enumerate(chunk):
                    nll_sum += nll[row, length - 1 - scored :].double().sum().item()
                    count += scored
    finally:
        if was_training:
            model.train()
    return math.exp(nll_sum / count)


__all__ = ["perplexity", "token_nll"]
