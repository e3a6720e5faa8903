"""Weight recovery's checkpoint: the weights it trains, Adam's state and the step, so a recovery that dies
(out of memory, a machine taken back, Ctrl-C) goes on where it stopped instead of from its first step.

Recovery has no randomness of its own (dropout is off, batches are looked up by step), so a resumed
recovery ends with the weights a straight one ends with. A checkpoint is reused only by the recovery
that wrote it: the same plan (tile kinds and 2:4 metadata of every layer, source fingerprints), the same
`RecoverConfig` but for `score_batches`, and the same caller `tag` (what `recover` cannot see: the loss
and the batches, e.g. the job's options). Any other checkpoint, or one that cannot be read, is stale:
`recover(resume=True)` warns, names what differs and recovers from the start, writing over it. Nothing is
lost that way but time; the plan and the dense model stay as they were.

    {"format": "patchc.recover-checkpoint", "version": 1, "key": {...}, "step": 150, "history": [...],
     "params": {parameter name: tensor}, "optimizer": Adam's state_dict}

Size: each trained parameter whole, plus Adam's two moments in its dtype: 6 bytes per weight of the
planned layers' parameters in bf16 (39 GB for LLaMA-2-7B), 12 in fp32.

A recovery sharded by FSDP2 (`patchc.job.fsdp_recover`) writes the same file: each tensor is gathered whole
in turn (a collective: every rank saves) and rank 0 writes it; on resume every rank reads the file and keeps
its own shard. So a checkpoint goes on in one process or on any number of ranks.

Example:
    >>> rec = patchc.recover(plan, model, batches, loss, steps=300, checkpoint="recover.ckpt", resume=True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from patchc.masking.train import atomic_torch_save
from patchc.utils.files import read_state

FORMAT, VERSION = "patchc.recover-checkpoint", 1


def checkpoint_key(plan: Any, cfg: Any, fingerprints: dict, tag: dict | None = None) -> dict:
    """What a recovery must share with the one that wrote a checkpoint for it to go on from it (JSON-ready)."""
    digest = hashlib.sha256(json.dumps(fingerprints, sort_keys=True, default=str).encode())
    for name in sorted(plan.layers):
        layer = plan.layers[name]
        digest.update(f"{name}:{tuple(layer.shape)}:{tuple(layer.tile)}".encode())
        for tensor in (layer.kinds, layer.meta):
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "score_batches"}  # scoring only
    return json.loads(json.dumps({"plan": digest.hexdigest(), "config": config, "tag": tag or {}}))


def save_recovery(path: str | os.PathLike, key: dict, params: dict[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer, step: int, history: list[dict]) -> None:
    """Write the checkpoint atomically (a crash while saving leaves the previous one). Sharded tensors are
    gathered one at a time and rank 0 writes; every rank calls it then, and leaves once the file is written."""
    sharded = is_sharded(params)
    whole = {name: _whole(p.detach()) for name, p in params.items()}
    state = optimizer.state_dict()
    state["state"] = {i: {k: _whole(v) for k, v in entry.items()} for i, entry in state["state"].items()}
    if not sharded or dist.get_rank() == 0:  # unsharded, whichever process recovers alone writes its own
        atomic_torch_save({"format": FORMAT, "version": VERSION, "key": key, "step": step, "history": history,
                           "params": whole, "optimizer": state}, path)
    if sharded:
        dist.barrier()  # no rank returns (and maybe exits on a signal) before the file is complete


def load_recovery(path: str | os.PathLike, key: dict, params: dict[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer) -> tuple[int, list[dict]] | None:
    """Restore the weights and Adam's state from `path`; returns (step, history), or None (with a warning
    saying why) when the file is missing, unreadable or made by another recovery."""
    path = Path(path)
    if not path.exists():
        return None
    state = _read(path)
    why = stale_reason(state, key, params) if isinstance(state, dict) else state
    if why is not None:
        warnings.warn(f"{path}: {why}; recovering from the first step (the file is replaced at the first save)",
                      stacklevel=3)
        return None
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_placed(state["params"][name], p))
    ordered = [p for group in optimizer.param_groups for p in group["params"]]  # the state dict's indices
    saved = state["optimizer"]
    saved["state"] = {i: {k: _placed(v, ordered[int(i)]) if k != "step" else v for k, v in entry.items()}
                      for i, entry in saved["state"].items()}
    optimizer.load_state_dict(saved)
    return int(state["step"]), list(state["history"])


def is_sharded(params: dict[str, torch.Tensor]) -> bool:
    """Whether any of `params` is an FSDP2 shard (a DTensor)."""
    return any(_is_dtensor(p) for p in params.values())


def _is_dtensor(t: Any) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _whole(t: Any) -> Any:
    """A sharded tensor gathered whole, on the CPU on rank 0 (a collective); anything else as it is."""
    if not _is_dtensor(t):
        return t
    full = t.full_tensor()
    return full.cpu() if dist.get_rank() == 0 else None  # a DTensor: its process group is there


def _placed(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` as `like` holds it: this rank's shard when `like` is sharded (no communication), else whole."""
    if not _is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def _read(path: Path) -> dict | str:
    try:
        state = read_state(path)
    except (OSError, ValueError) as exc:  # whatever is wrong with it, it is not ours to go on from
        return f"not a readable recovery checkpoint ({exc})"
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return "not a patchc recovery checkpoint"
    return state


def stale_reason(state: dict, key: dict, params: dict[str, torch.Tensor]) -> str | None:
    """Why `state` is not this recovery's to go on from (one line naming each difference), or None."""
    if state.get("version") != VERSION:
        return f"recovery checkpoint version {state.get('version')} (this patchc writes {VERSION})"
    saved = state.get("key") or {}
    if saved.get("plan") != key["plan"]:
        return "made by the recovery of another plan"
    differ = [f"{k} {saved.get(part, {}).get(k)!r} (now {v!r})" for part in ("config", "tag")
              for k, v in key[part].items() if saved.get(part, {}).get(k) != v]
    differ += [f"{k} {v!r} (now absent)" for part in ("config", "tag")
               for k, v in saved.get(part, {}).items() if k not in key[part]]
    if differ:
        return "made by another recovery: " + "; ".join(differ)
    tensors = state.get("params") or {}
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in params.items()}
    if {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} != shapes:
        return "its weights are not this model's (other names, shapes or dtypes)"
    return None


__all__ = ["checkpoint_key", "is_sharded", "save_recovery", "load_recovery", "stale_reason"]
