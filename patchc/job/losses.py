"""The task losses of mask training: next-token LM, distillation from the dense model, or both.

Distillation (KD) scores the masked model by the KL divergence from the dense model's next-token
distribution at temperature T (Hinton et al.), times T^2 so its gradients keep their scale as T
changes. The dense teacher's logits come from a `torch.no_grad` forward of the frozen dense model on
the same inputs: nothing of it is kept for backward, so peak memory grows by one (B, T, V) logits
tensor, not by a second set of activations. KD gives every position a full distribution to match
instead of one sampled token, which is what keeps masks from fitting a small training set.

Both terms are taken a few positions at a time (`patchc.utils.chunks.piecewise`), each position's gradient
the whole batch's to the bit: a step then holds three (B, T, V) tensors (the student's and teacher's logits
and the gradient) rather than a dozen (log-softmaxes, KL terms and their gradients; 1.2 GB apiece at
8 x 255 tokens of a 152K vocabulary), and a CPU reuses its pieces' memory rather than mapping them afresh.

Example:
    >>> loss_fn = make_lm_loss(bundle, bundle.model, LossSpec("kd", temperature=2.0))
    >>> patchc.train_masks(prog, batches, loss_fn, steps=300)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from patchc.job.options import LOSSES, LossSpec  # specs live with the options: no torch to parse flags
from patchc.utils.chunks import piecewise


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of T^2 * KL(softmax(teacher / T) || softmax(student / T)), in fp32, a few positions
    at a time (`patchc.utils.chunks.piecewise`).

    Example:
        >>> kd_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5))
        tensor(0.)
    """
    if student.shape != teacher.shape:
        raise ValueError(f"kd_loss: student logits {tuple(student.shape)} and teacher logits "
                         f"{tuple(teacher.shape)} differ in shape")
    s, t = student.flatten(0, -2), teacher.flatten(0, -2)
    return piecewise(functools.partial(_kd_share, temperature=temperature, count=len(s)), s, t)


def task_loss(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None,
              spec: LossSpec) -> torch.Tensor:
    """`spec`'s loss of (B, T, V) `logits`: cross-entropy at (B, T) `targets`, KD to (B, T, V) `teacher` logits,
    or both, in fp32, a few positions at a time: each position's gradient is the one of the whole batch's
    `F.cross_entropy` and `kd_loss`, bit for bit, with no temporary larger than a piece (`piecewise`)."""
    kd = spec.kind in ("kd", "lm+kd")
    if kd and (teacher is None or teacher.shape != logits.shape):
        raise ValueError(f"task_loss: --loss {spec.kind} needs teacher logits of the student's shape "
                         f"{tuple(logits.shape)}, got {None if teacher is None else tuple(teacher.shape)}")
    rows = logits.flatten(0, -2)
    share = functools.partial(_task_share, spec=spec, count=len(rows))
    return piecewise(share, rows, targets.flatten(), *([teacher.flatten(0, -2)] if kd else []))


def _kd_share(student: torch.Tensor, teacher: torch.Tensor, temperature: float, count: int) -> torch.Tensor:
    """A piece's share of `kd_loss` over `count` positions: F.kl_div's "batchmean" is this sum / count."""
    s, t = student.float(), teacher.float()
    if temperature != 1.0:  # at 1 a division would copy both (tokens, vocab) tensors, and the gradient once more
        s, t = s / temperature, t / temperature
    s, t = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="sum") / count * temperature**2


def _task_share(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None = None, *,
                spec: LossSpec, count: int) -> torch.Tensor:
    """A piece's share of `task_loss`: the operations of the whole batch's loss, in its order, so that each
    position's gradient is the same (F.cross_entropy's "mean" is this sum / count: no target is ignored)."""
    logits = logits.float()  # once for both terms: a bf16 model's are upcast here
    total = logits.new_zeros(())
    if spec.kind in ("lm", "lm+kd"):
        total = total + F.cross_entropy(logits, targets, reduction="sum") / count
    if teacher is not None:
        total = total + spec.kd_weight * _kd_share(logits, teacher, spec.temperature, count)
    return total


def make_lm_loss(bundle: Any, teacher: torch.nn.Module, spec: LossSpec) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """`loss(model, ids)` on a (B, T+1) block of ids for a causal LM: LM, KD to `teacher`, or both."""

    def loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
        inputs = ids[:, :-1]
        logits, target = bundle.logits(model, inputs), None  # the student first, as the noise was drawn
        if spec.kind in ("kd", "lm+kd"):
            with torch.no_grad():
                target = bundle.logits(teacher, inputs)
        return task_loss(logits, ids[:, 1:], target, spec)

    return loss


__all__ = ["LOSSES", "LossSpec", "kd_loss", "make_lm_loss", "task_loss"]
