"""Weight recovery under FSDP2 (`patchc prune --fsdp --recover` under torchrun): every rank holds 1/N of the
model being recovered, of its dense teacher, of Adam's state and of the masks.

    rank 0's plan -> the parameters holding planned layers (told to every rank) -> the student and the teacher
        sharded one transformer block per unit -> each parameter's masks scattered like its shards -> W * M
        -> `recover`'s Adam loop on the shards -> each parameter gathered in turn, rank 0 rebuilds the plan

In one process `patchc.recover` holds the whole model, its gradient and Adam's two moments on one device beside
the dense teacher: for LLaMA-2-7B in bf16 the copy, the teacher, the gradient, m and v and the two masks take
13 + 13 + 13 + 26 + 13 GB, all of an 80 GB GPU before any activation. Here each rank holds its share of those,
and one block gathered at a time. Each rank trains on its share of
every global batch and FSDP2 averages the gradients, so N ranks recover what one process recovers (up to
rounding); the checkpoint is `recover`'s own file (`recover_checkpoint.py`), resumable on any number of ranks.

Example (every rank of `torchrun --nproc_per_node=2`; `plan` is rank 0's):
    >>> rec = recover_sharded(plan if rank == 0 else None, student, teacher, my_batches, loss_fn,
    ...                       RecoverConfig(steps=300))
    >>> rec.save("plan-recovered.patch") if rank == 0 else None
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from patchc.ir import TilePlan
from patchc.ir import targets as tg
from patchc.ir.provenance import check_weights
from patchc.masking.recover import (RecoverConfig, Saved, TrainedParam, mean_loss, param_masks, rebuild,
                                    recovered_plan, recovery_record, source_fingerprints, train_kept)
from patchc.masking.recover_checkpoint import checkpoint_key
from patchc.masking.ranks import agree, global_mean
from patchc.masking.train import batch_getter
from patchc.utils.names import block_path


def recover_sharded(plan: TilePlan | None, model: nn.Module, teacher: nn.Module | None,
                    batches: Callable[[int], Any] | Sequence, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                    cfg: RecoverConfig, *, progress: bool = True, force: bool = False,
                    checkpoint: str | os.PathLike | None = None, checkpoint_every: int = 50, resume: bool = False,
                    checkpoint_tag: dict | None = None, mesh: Any = None) -> TilePlan | None:
    """`patchc.recover(plan, model, ...)` with Adam, every rank holding shards; returns the plan on rank 0.

    Every rank calls it with its own whole copies of the dense model (`model`, trained in place, and `teacher`,
    read by `loss_fn`; None when the loss needs none; sharded already by `shard_teacher`, or whole), in host
    memory best: FSDP2 moves one block at a time to the mesh's device and keeps this rank's shard of it.
    `plan` is rank 0's (None elsewhere), `batches(step)` this rank's share of the step's batch. Both models end
    sharded.
    """
    if cfg.method != "adam":
        raise ValueError("recover_sharded: only method='adam' trains sharded; run method='sparsegpt' in one process")
    rank = dist.get_rank()
    views, prints, key = {}, {}, None
    if rank == 0:
        views = {fqn: tg.resolve(model, fqn, plan.meta.get(tg.META_KEY)) for fqn in plan.layers}
        if not force:
            check_weights(plan, model)
        prints = source_fingerprints(plan, model, views)
        key = checkpoint_key(plan, cfg, prints, checkpoint_tag) if checkpoint is not None else None
    names, key = agree((list(dict.fromkeys(t.param for t in views.values())), key))
    blocks = sorted({block_path(n) for n in names} - {None})
    model.requires_grad_(False)  # before sharding: FSDP2 reads it once, when it first gathers a block
    for name in names:
        model.get_parameter(name).requires_grad_(True)
    shard_model(model, blocks, mesh)
    if teacher is not None and not isinstance(teacher, FSDPModule):
        shard_teacher(teacher, mesh)
    named = scatter_masks(plan, model, views, names, cfg.scope)
    with torch.no_grad():
        for entry in named.values():
            entry.param.masked_fill_(entry.pruned, 0.0)  # W * M: the hardened plan's weights
    get_batch = batch_getter(batches, "recover")
    n_score = min(cfg.score_batches, len(batches)) if isinstance(batches, Sequence) else cfg.score_batches
    start = time.perf_counter()
    before = _global_loss(model, loss_fn, get_batch, n_score)
    history = train_kept(plan, model, views, get_batch, loss_fn, cfg, progress and rank == 0,
                         saved=Saved(checkpoint, checkpoint_every, resume, key), named=named)
    after = _global_loss(model, loss_fn, get_batch, n_score)
    model.reshard()  # the root keeps its gathered weights after a forward
    layers = gather_layers(plan, model, views, names, cfg.scope)
    if rank != 0:
        return None
    record = recovery_record(cfg, before, after, start, history) | {"ranks": dist.get_world_size()}
    return recovered_plan(plan, layers, prints, record)


def shard_model(model: nn.Module, blocks: list[str], mesh: Any = None, frozen: bool = False) -> nn.Module:
    """FSDP2 over `model`: one unit per block in `blocks` (module paths), the rest in the root's; returns it.
    `frozen` (a teacher, never backpropagated): the root's weights are freed after each forward too."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from patchc.job.fsdp import default_mesh

    mesh = mesh if mesh is not None else default_mesh(_device())
    for path in blocks:
        fully_shard(model.get_submodule(path), mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if frozen else None)
    if callable(getattr(model, "layer_states", None)):  # an encoder's layerwise distillation calls it, not forward
        register_fsdp_forward_method(model, "layer_states")
    return model


def shard_teacher(teacher: nn.Module, mesh: Any = None) -> nn.Module:
    """`teacher` frozen and sharded, one unit per transformer block; returns it. Sharding it before the student is
    copied keeps one whole copy of the model at a time in a rank's host memory (FSDP2 frees each block's)."""
    teacher.requires_grad_(False)
    return shard_model(teacher, sorted({block_path(n) for n, _ in teacher.named_parameters()} - {None}), mesh,
                       frozen=True)


def scatter_masks(plan: TilePlan | None, model: nn.Module, views: dict[str, tg.Target], names: list[str],
                  scope: str) -> dict[str, TrainedParam]:
    """`trainable`'s masks of each sharded parameter in `names`, built whole on rank 0 one parameter at a time
    and scattered: every rank keeps the shards that match its shards of the parameter."""
    from torch.distributed.tensor import distribute_tensor

    found = {}
    for name in names:
        param = model.get_parameter(name)
        if dist.get_rank() == 0:
            masks = param_masks(plan, views, name, param.shape, scope)
        else:
            masks = (torch.empty(param.shape, dtype=torch.bool),) * 2  # filled by the scatter
        # as bytes: gloo scatters no bool tensors
        found[name] = TrainedParam(param, *(distribute_tensor(m.to(param.device, torch.uint8), param.device_mesh,
                                                             param.placements, src_data_rank=0).to(torch.bool)
                                            for m in masks))
    return found


@torch.no_grad()
def gather_layers(plan: TilePlan | None, model: nn.Module, views: dict[str, tg.Target], names: list[str],
                  scope: str) -> dict:
    """The plan's layers rebuilt from the recovered weights on rank 0 ({} elsewhere): each parameter is gathered
    whole in turn (a collective), so no rank holds more than one beside its shards."""
    rank = dist.get_rank()
    layers = {}
    for name in names:
        whole = model.get_parameter(name).full_tensor()
        if rank == 0:
            layers |= {fqn: rebuild(plan.layers[fqn], tg.matrix(whole, t), scope)
                       for fqn, t in views.items() if t.param == name}
        del whole
    return {fqn: layers[fqn] for fqn in plan.layers} if rank == 0 else {}


def _global_loss(model: nn.Module, loss_fn: Callable, get_batch: Callable[[int], Any], count: int) -> float | None:
    """The mean loss of batches 0..count-1 over every rank's share (each rank scores its own)."""
    if not count:
        return None
    local = mean_loss(model, loss_fn, get_batch, count)
    return float(global_mean(torch.tensor([local], dtype=torch.float64, device=_device())))


def _device() -> torch.device:
    """Where this process group's collectives run: NCCL on this rank's GPU, gloo on the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


__all__ = ["recover_sharded", "shard_model", "shard_teacher", "scatter_masks", "gather_layers"]
