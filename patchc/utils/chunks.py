"""Work on a (rows, V) tensor of wide rows (a vocabulary's logits) a few rows at a time.

glibc maps every allocation past 32 MB afresh and the kernel zeroes it page by page, so a step that builds
(64 x 152K) temporaries pays their size in page faults every time (half of a sampling step, most of a
perplexity batch's cross-entropy). Pieces of at most `CPU_ROW_ELEMENTS` elements are served from glibc's
heap and reused. A GPU's caching allocator reuses its blocks anyway: there a loop takes all the rows, but a
loss (`piecewise`, `patchc.job.evaluate.token_nll`) takes pieces of `GPU_LOSS_ELEMENTS`, for memory: a whole
batch's log-softmaxes, KL terms and their gradients are about ten fp32 tensors of the logits' size (1.2 GB
apiece at 8 x 255 x 152K).

Example:
    >>> rows_at_once(torch.empty(64, 151936))   # on a CPU
    6
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The most elements a CPU works on at once: an int64 temporary of 8 MiB
CPU_ROW_ELEMENTS = 1 << 20
# The most elements a GPU takes the loss of at once: fp32 temporaries of 256 MiB, a few kernels per piece
GPU_LOSS_ELEMENTS = 1 << 26


def rows_at_once(t: torch.Tensor, gpu_elements: int | None = None) -> int:
    """Rows of (rows, V) `t` to work on together: on a CPU as many as keep a temporary to `CPU_ROW_ELEMENTS`,
    elsewhere as many as keep it to `gpu_elements` (all of them when None); at least one."""
    if t.device.type == "cpu":
        return max(1, CPU_ROW_ELEMENTS // t.shape[-1])
    return t.shape[0] if gpu_elements is None else max(1, gpu_elements // t.shape[-1])


def _pieces(loss_of: Callable[..., torch.Tensor], logits: torch.Tensor, rows: tuple[torch.Tensor, ...],
            want: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sum of `loss_of` over row pieces, and (`want`) its gradient with respect to `logits`."""
    n = rows_at_once(logits, GPU_LOSS_ELEMENTS)
    grad = torch.empty_like(logits) if want and n < len(logits) else None  # one piece: its own gradient
    total = None
    for i in range(0, len(logits), n):
        piece, others = logits[i:i + n].detach().requires_grad_(want), [r[i:i + n] for r in rows]
        with torch.enable_grad() if want else torch.no_grad():
            value = loss_of(piece, *others)
            if want and grad is None:  # contiguous: backward scales it in place
                grad = torch.autograd.grad(value, piece)[0].contiguous()
            elif want:
                grad[i:i + n] = torch.autograd.grad(value, piece)[0]
        total = value.detach() if total is None else total + value.detach()
    return total, grad


class _Piecewise(torch.autograd.Function):
    """Forward sums `loss_of` over row pieces and takes each piece's gradient at once, into one tensor the size
    of the logits; backward scales it. No temporary of the whole batch's size is ever alive."""

    @staticmethod
    def forward(ctx, loss_of: Callable[..., torch.Tensor], logits: torch.Tensor, *rows: torch.Tensor):
        total, ctx.grad = _pieces(loss_of, logits, rows, want=True)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.grad is None:
            raise RuntimeError("piecewise: backward ran twice through the same loss (retain_graph=True); "
                               "the gradient is freed after the first")
        grad, ctx.grad = ctx.grad, None
        return (None, grad.mul_(grad_output), *(None for _ in ctx.needs_input_grad[2:]))


def piecewise(loss_of: Callable[..., torch.Tensor], logits: torch.Tensor, *rows: torch.Tensor) -> torch.Tensor:
    """The scalar loss `sum over pieces of loss_of(logits[piece], *(r[piece] for r in rows))`, a few rows of
    (rows, V) `logits` at a time (`rows_at_once`; on a GPU `GPU_LOSS_ELEMENTS`), with its gradient.

    `loss_of` gives a piece's share of the loss (normalised by the whole batch's count, not the piece's) and
    must treat rows independently. Each row's gradient is then the one autograd gives on the whole batch, bit
    for bit; the value may differ in its last bits (a sum of piece sums). The gradient is taken in forward and
    kept, one tensor the size of `logits`, so backward may run once.

    Example:
        >>> logits, targets = torch.randn(6, 5, requires_grad=True), torch.tensor([0, 1, 2, 3, 4, 0])
        >>> loss = piecewise(lambda x, t: F.cross_entropy(x, t, reduction="sum") / 6, logits, targets)
        >>> loss.backward()   # logits.grad as from F.cross_entropy(logits, targets)
    """
    if logits.dim() != 2 or not len(logits) or any(len(r) != len(logits) for r in rows):
        raise ValueError(f"piecewise: logits must be (rows, V), rows > 0, and every other tensor have its rows, got "
                         f"{tuple(logits.shape)} and {[tuple(r.shape) for r in rows]}")
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Piecewise.apply(loss_of, logits, *rows)
    return _pieces(loss_of, logits, rows, want=False)[0]  # no gradient to take


__all__ = ["CPU_ROW_ELEMENTS", "GPU_LOSS_ELEMENTS", "piecewise", "rows_at_once"]
