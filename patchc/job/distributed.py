"""torchrun support for the job: who this process is, joining the group, this rank's share of a batch.

Under `torchrun --nproc_per_node=N -m patchc prune ...` each rank takes its slice of every global
batch, DDP averages the logits' gradients (gloo on CPU, NCCL on GPU), and rank 0 alone evaluates and
writes files. Outside torchrun everything here is the identity.

Example:
    >>> world()
    (0, 1)
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(device: str) -> None:
    """Join the torchrun process group when launched by torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def rank_slice(batch: Any, rank: int, size: int) -> Any:
    """This rank's contiguous share of a global batch (a tensor or a dict of tensors)."""
    if size == 1:
        return batch
    if isinstance(batch, dict):
        return {k: rank_slice(v, rank, size) for k, v in batch.items()}
    if batch.shape[0] % size:
        raise ValueError(f"--batch-size {batch.shape[0]} must be divisible by the {size} processes")
    share = batch.shape[0] // size
    return batch[rank * share : (rank + 1) * share]


def say(message: str) -> None:
    """Print on rank 0 only (flushed, so it interleaves correctly with the progress bars)."""
    if world()[0] == 0:
        print(message, flush=True)
