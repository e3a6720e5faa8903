"""`ShardedCheckpointIO`: mask training's checkpoint as a folder every FSDP2 rank writes its shards into.

Example (under `torchrun`, the program sharded by `patchc.job.fsdp.shard_program`):
    >>> patchc.train_masks(prog, batches, loss_fn, checkpoint="run/masks.ckpt", checkpoint_io=ShardedCheckpointIO())
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from patchc.masking.train import CHECKPOINT_FORMAT, CheckpointIO, TrainResult, _config_diff, _config_tag, optimizer_kind
from patchc.job.runs import PREVIOUS, STAGING
from patchc.passes.program import MaskedProgram
from patchc.utils.files import write_bytes_atomic

SHARDED_VERSION = 1
META = "patchc.json"


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _joined():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _joined() else 0


class ShardedCheckpointIO(CheckpointIO):
    """`train_masks`'s checkpoint as a folder written by every rank with torch.distributed.checkpoint.

    Each rank writes its shards of the logits and of the Adam state (DCP), rank 0 the history and
    settings (`patchc.json`). A save goes to `<path>.next` and replaces `<path>` only when complete
    (the previous one waits in `<path>.prev` meanwhile), so a crash never leaves half a checkpoint.
    Pass the same path on every rank. DCP reshards on load: a run may resume on another number of
    ranks, or in one process without FSDP.

    Example:
        >>> patchc.train_masks(prog, batches, loss_fn, checkpoint=out / "masks.ckpt", resume=True,
        ...                    checkpoint_io=ShardedCheckpointIO())
    """

    def _complete(self, path: str | os.PathLike) -> Path | None:
        for folder in (Path(path), Path(f"{path}{PREVIOUS}")):
            if (folder / META).is_file():
                return folder
        return None

    def exists(self, path: str | os.PathLike) -> bool:
        return self._complete(path) is not None

    def save(self, path: str | os.PathLike, prog: MaskedProgram, optimizer: torch.optim.Optimizer,
             result: TrainResult) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = Path(path)
        staging, previous = Path(f"{path}{STAGING}"), Path(f"{path}{PREVIOUS}")
        if path.exists() and not path.is_dir():
            raise ValueError(f"{path}: a file is in the way of the sharded checkpoint folder; move it away")
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a save that died half way
        _barrier()
        model_state, optim_state = get_state_dict(prog, optimizer)
        with warnings.catch_warnings():  # DCP warns that one process saves alone: intended here (`--fsdp` alone)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"program": model_state, "optimizer": optim_state}, checkpoint_id=str(staging),
                     no_dist=not _joined())
        if _rank() == 0:
            meta = {"format": CHECKPOINT_FORMAT, "sharded": SHARDED_VERSION, "config": _config_tag(prog),
                    "settings": prog.cfg.to_dict(), "optimizer_kind": optimizer_kind(optimizer),
                    "history": result.history, "step": result.step}
            write_bytes_atomic(staging / META, json.dumps(meta).encode())
            if path.exists():
                shutil.rmtree(previous, ignore_errors=True)
                os.replace(path, previous)
            os.replace(staging, path)
            shutil.rmtree(previous, ignore_errors=True)
        _barrier()

    def load(self, path: str | os.PathLike, prog: MaskedProgram, optimizer: torch.optim.Optimizer) -> TrainResult:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        folder = self._complete(path)
        if folder is None:
            raise FileNotFoundError(f"{path}: no complete sharded checkpoint ({META} missing)")
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{folder / META}: not a readable patchc checkpoint ({exc})") from exc
        if meta.get("format") != CHECKPOINT_FORMAT or meta.get("sharded") != SHARDED_VERSION:
            raise ValueError(f"{folder}: not a patchc sharded checkpoint of version {SHARDED_VERSION}")
        if meta["config"] != _config_tag(prog):
            raise ValueError(f"{folder}: checkpoint was made with another PatchConfig: {_config_diff(meta, prog)}")
        if meta.get("optimizer_kind") != optimizer_kind(optimizer):
            raise ValueError(f"{folder}: checkpoint was trained with optimizer {meta.get('optimizer_kind')} (now "
                             f"{optimizer_kind(optimizer)}): resume with the same MaskOptimConfig (memory mode)")
        model_state, optim_state = get_state_dict(prog, optimizer)
        state = {"program": model_state, "optimizer": optim_state}
        with warnings.catch_warnings():  # DCP warns that one process loads alone: intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), no_dist=not _joined())
        set_state_dict(prog, optimizer, model_state_dict=state["program"], optim_state_dict=state["optimizer"])
        return TrainResult(history=list(meta["history"]), step=int(meta["step"]))


__all__ = ["ShardedCheckpointIO"]
