"""What the training loops (mask training, weight recovery) agree on across torchrun ranks: when to stop, rank 0's
timings, logged means, and whether a loss went NaN or inf since the last look (tracked on the device, read at log
and checkpoint steps only: a read per step would sync the GPU every step)."""

from __future__ import annotations

from typing import Any

import torch

from patchc.utils.stopping import stop_requested


def first_bad_step(first_bad: torch.Tensor | None, loss: torch.Tensor, step: int) -> torch.Tensor:
    """The first step so far whose loss was not finite, 0 if none: device ops only (no sync per step)."""
    bad = ~torch.isfinite(loss.detach())
    first_bad = torch.zeros((), dtype=torch.int64, device=loss.device) if first_bad is None else first_bad
    return torch.where((first_bad == 0) & bad, step, first_bad)


def check_finite(first_bad: torch.Tensor | None, step: int, then: str = "", what: str = "mask training",
                 ranks: bool = True) -> None:
    """FloatingPointError if a loss up to `step` was NaN or inf: its step went into the logits, NaN from then on.
    `ranks`: every torchrun rank calls this (a collective: the earliest step any saw); False where one trains
    alone (`prune --recover` without --fsdp: rank 0). Read at log and checkpoint steps only."""
    if first_bad is None:
        return
    at = first_bad.clone()
    if ranks and world_size() > 1:
        import torch.distributed as dist

        none = torch.iinfo(torch.int64).max
        at = torch.where(at > 0, at, none)
        dist.all_reduce(at, op=dist.ReduceOp.MIN)
        at = torch.where(at == none, 0, at)
    if int(at) > 0:
        raise FloatingPointError(f"{what}: loss is nan or inf at step {int(at)} (seen at step {step})"
                                 + (f"; {then}" if then else "") + "; lower the learning rate (--lr) or check the data")


def stop_agreed(handled: bool, step: int, steps: int, device: torch.device) -> int | None:
    """The signal that asks training to stop after `step`, the same on every torchrun rank: each checks its
    own every step alone, and under torchrun every 10 steps and at the last, the ranks agreeing (a sync, like
    a log step's)."""
    signum = stop_requested()
    if not handled or world_size() == 1:
        return signum
    if step % 10 and step != steps:
        return None
    import torch.distributed as dist

    flag = torch.tensor([signum or 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) or None


def agree(value: Any) -> Any:
    """Rank 0's `value` on every torchrun rank (each measured its own): a collective, so every rank calls it."""
    import torch.distributed as dist

    if world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_mean(values: torch.Tensor) -> torch.Tensor:
    """Average logged values over torchrun ranks (each saw its share of the global batch)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return values
