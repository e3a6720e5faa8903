"""torchrun support for the job: who this process is, joining the group, this rank's share of a batch.

Under `torchrun --nproc_per_node=N -m patchc prune ...` each rank takes its slice of every global
batch, DDP averages the logits' gradients (gloo on CPU, NCCL on GPU), and rank 0 alone evaluates and
writes files; on --resume every rank reads back the checkpoint rank 0 wrote (`RankZeroCheckpointIO`).
With `--fsdp` FSDP2 shards each block's weights and logits over the ranks instead (`patchc.job.fsdp`)
and every rank writes its part of a sharded checkpoint folder; `prepare_training` picks the one or the
other. Outside torchrun everything here is the identity.

Example:
    >>> world()
    (0, 1)
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from patchc.masking.train import CheckpointIO


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# The other ranks wait in a collective while rank 0 alone scores the rows, recovers weights (without --fsdp)
# and runs the one-shot baselines: on a 7B model far longer than NCCL's default 10 minutes, after which its
# watchdog ends the whole job. PATCHC_DIST_TIMEOUT (seconds) sets another limit.
DIST_TIMEOUT = 6 * 3600


def dist_timeout() -> datetime.timedelta:
    """How long a collective may wait for the slowest rank: PATCHC_DIST_TIMEOUT seconds, else 6 hours."""
    raw = os.environ.get("PATCHC_DIST_TIMEOUT", "").strip()
    try:
        seconds = float(raw) if raw else DIST_TIMEOUT
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"PATCHC_DIST_TIMEOUT={raw!r}: give the seconds a rank may wait for the others, e.g. 21600")
    return datetime.timedelta(seconds=seconds)


def launched_size() -> int:
    """How many processes torchrun launched (WORLD_SIZE), before any process group is joined; 1 outside it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str) -> bool:
    """Join the torchrun process group when launched by torchrun (WORLD_SIZE > 1); True if this call joined it."""
    if launched_size() <= 1 or dist.is_initialized():
        return False
    timeout = dist_timeout()  # checked before anything else
    if device == "cuda":  # one GPU per rank: "cuda" then means this rank's GPU (model, mesh, NCCL)
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timeout)
    return True


@contextlib.contextmanager
def process_group(device: str) -> Iterator[None]:
    """Join torchrun's process group for a job (`init_distributed`) and leave it when the job ends normally.

    A gloo group left for the interpreter's exit to tear down can abort a rank whose work is done and written
    (SIGABRT, "terminate called without an active exception": its worker threads outlive Python), and torchrun
    then fails the whole job. After an exception the group is left as it is: another rank may still be in a
    collective, and torchrun ends them all. A group this process had already joined is not ours to leave.

    Example:
        >>> with process_group("cpu"):   # outside torchrun: nothing to join
        ...     world()
        (0, 1)
    """
    joined = init_distributed(device)
    yield
    if joined and dist.is_initialized():
        dist.destroy_process_group()


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


@dataclass(frozen=True)
class TrainSetup:
    """How this rank trains a program: what its loss calls, where and how it checkpoints.

    `checkpoint` is the path to pass to `train_masks` on every rank, `checkpoint_io` its `CheckpointIO`
    (None: the default single file; DDP: `RankZeroCheckpointIO`; FSDP: sharded); `teacher` the dense model a
    distillation loss reads when it is not the loaded model itself (FSDP: the sharded program with its masks
    off, `fsdp.DenseTeacher`).
    """

    forward_module: nn.Module
    checkpoint: Path | None
    checkpoint_io: Any = None
    teacher: nn.Module | None = None


class RankZeroCheckpointIO(CheckpointIO):
    """DDP's checkpoint: the one file rank 0 writes, read back by every rank on resume (each holds the whole
    program), so that all of them go on from the same logits and Adam state. Every rank must be able to read
    the run folder (one machine, or a filesystem the machines share); where some cannot, it says so."""

    def exists(self, path) -> bool:
        here = super().exists(path)
        seen = [None] * world()[1]
        dist.all_gather_object(seen, here)  # works under NCCL too (no CPU-tensor collective)
        if any(seen) and not all(seen):
            raise ValueError(f"{path}: only {sum(seen)} of the {len(seen)} processes can read this checkpoint; "
                             "resume with the run folder on a filesystem every process shares")
        return here

    def save(self, path, prog, optimizer, result) -> None:
        if world()[0] == 0:
            super().save(path, prog, optimizer, result)


def harden_program(prog, exact_budget: bool = False, rank: int | None = None):
    """`patchc.harden(prog)` after training, called on every rank; a sharded program is gathered one block at a
    time (a collective). `rank`: the one rank that builds and returns the plan, the others get None; None:
    every rank."""
    if getattr(prog, "fsdp_shards", None) is not None:
        from patchc.job.fsdp import harden_sharded

        return harden_sharded(prog, exact_budget, rank)
    if rank is not None and world()[0] != rank:
        return None
    import patchc

    return patchc.harden(prog, exact_budget=exact_budget)


def check_checkpoint_kind(checkpoint: Path | None, fsdp: bool) -> None:
    """Refuse to continue a single-file checkpoint with --fsdp (a folder) or a sharded folder without it."""
    if checkpoint is None or not Path(checkpoint).exists():
        return
    if Path(checkpoint).is_dir() and not (Path(checkpoint) / ".metadata").is_file():  # torch.distributed.checkpoint's
        raise ValueError(f"{checkpoint} is a folder that holds no sharded checkpoint (no .metadata): remove it, or "
                         "start again with --overwrite")
    if fsdp and not Path(checkpoint).is_dir():
        raise ValueError(f"{checkpoint} is a single-file checkpoint from a run without --fsdp: continue it without "
                         "--fsdp (or start again with --overwrite)")
    if not fsdp and Path(checkpoint).is_dir():
        raise ValueError(f"{checkpoint} is a sharded checkpoint from a --fsdp run: continue it with --fsdp "
                         "(any number of processes)")


def prepare_training(prog, checkpoint: Path | None, fsdp: bool = False) -> TrainSetup:
    """Wrap `prog` for this process: nothing alone, DDP under torchrun, FSDP2 shards with `fsdp=True`.

    With `fsdp` the checkpoint is a folder (torch.distributed.checkpoint) in one process too, so a run
    may resume on another number of ranks.

    Example:
        >>> setup = prepare_training(prog, out / "masks.ckpt", fsdp=True)
        >>> patchc.train_masks(prog, batches, lambda _p, b: loss_fn(setup.forward_module, b),
        ...                    checkpoint=setup.checkpoint, checkpoint_io=setup.checkpoint_io)
        >>> plan = harden_program(prog)
    """
    rank, size = world()
    check_checkpoint_kind(checkpoint, fsdp)
    if fsdp:
        from patchc.job.fsdp import DenseTeacher, shard_program
        from patchc.job.fsdp_checkpoint import ShardedCheckpointIO

        teacher = DenseTeacher(shard_program(prog)) if size > 1 else None
        return TrainSetup(prog, checkpoint, ShardedCheckpointIO(), teacher=teacher)
    if size == 1:
        return TrainSetup(prog, checkpoint)
    from torch.nn.parallel import DistributedDataParallel

    return TrainSetup(DistributedDataParallel(prog), checkpoint, RankZeroCheckpointIO())
