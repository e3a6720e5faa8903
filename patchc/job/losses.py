"""The task losses of mask training: next-token LM, distillation from the dense model, or both.

Distillation (KD) scores the masked model by the KL divergence from the dense model's next-token
distribution at temperature T (Hinton et al.), times T^2 so its gradients keep their scale as T
changes. The dense teacher's logits come from a `torch.no_grad` forward of the frozen dense model on
the same inputs: nothing of it is kept for backward, so peak memory grows by one (B, T, V) logits
tensor, not by a second set of activations. KD gives every position a full distribution to match
instead of one sampled token, which is what keeps masks from fitting a small training set.

Example:
    >>> loss_fn = make_lm_loss(bundle, bundle.model, LossSpec("kd", temperature=2.0))
    >>> patchc.train_masks(prog, batches, loss_fn, steps=300)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from patchc.job.options import LOSSES, LossSpec  # specs live with the options: no torch to parse flags


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of T^2 * KL(softmax(teacher / T) || softmax(student / T)), in fp32.

    Example:
        >>> kd_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5))
        tensor(0.)
    """
    if student.shape != teacher.shape:
        raise ValueError(f"kd_loss: student logits {tuple(student.shape)} and teacher logits "
                         f"{tuple(teacher.shape)} differ in shape")
    s, t = student.float().flatten(0, -2), teacher.float().flatten(0, -2)
    if temperature != 1.0:  # at 1 a division would copy both (tokens, vocab) tensors, and the gradient once more
        s, t = s / temperature, t / temperature
    s, t = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def make_lm_loss(bundle: Any, teacher: torch.nn.Module, spec: LossSpec) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """`loss(model, ids)` on a (B, T+1) block of ids for a causal LM: LM, KD to `teacher`, or both."""

    def loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
        inputs = ids[:, :-1]
        logits = bundle.logits(model, inputs).float()  # once for both terms: a bf16 model's are upcast here
        total = logits.new_zeros(())
        if spec.kind in ("lm", "lm+kd"):
            total = total + F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        if spec.kind in ("kd", "lm+kd"):
            with torch.no_grad():
                target = bundle.logits(teacher, inputs)
            total = total + spec.kd_weight * kd_loss(logits, target, spec.temperature)
        return total

    return loss


__all__ = ["LOSSES", "LossSpec", "kd_loss", "make_lm_loss"]
