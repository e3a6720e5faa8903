"""Weight recovery after hardening: with a plan's masks fixed, fine-tune the weights it keeps.

Hardening leaves the kept weights as they were in the dense model; recovery lets them absorb part of
what the pruned ones did. Two ways:

  * ``method="adam"`` (default): Adam on `batches` with the task loss, gradient clipping and a cosine or linear
    decay, in eval mode (no dropout). Only the plan's layers train; their gradients are masked to the trainable
    positions (``scope="all"``: every kept weight; ``scope="values"``: only the kept values of the 2:4 tiles, dense
    tiles frozen bit for bit) and pruned positions are set back to exactly 0 after each step. Nothing but the model
    (trained in place), its gradients and Adam's two moments is held. With `checkpoint=PATH` it saves those every
    `checkpoint_every` steps; `resume=True` goes on from there (`recover_checkpoint.py`).
  * ``method="sparsegpt"``: one OBS update per layer with the plan's mask fixed (`patchc.pruning`'s
    SparseGPT), from calibration Hessians (`patchc.calibrate`); seconds instead of minutes.

The returned plan has the same tile kinds and 2:4 metadata as the input plan and the recovered values.
Its ``meta["fingerprints"]`` still describe the *source* weights (the dense model the plan was made
from), so ``recovered.apply(dense_model)`` is accepted and writes the recovered values;
``meta["recovery"]`` records what was done.

Example:
    >>> plan = patchc.harden(prog)
    >>> model = bundle.reload()
    >>> rec = patchc.recover(plan, model, batch_fn(blocks, 8), patchc.lm_loss, steps=300, lr=3e-4)
    >>> rec.meta["recovery"]["loss_after"] < rec.meta["recovery"]["loss_before"]
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchc.ir import TILE_SPARSE24, LayerPlan, PlanError, TilePlan
from patchc.ir import targets as tg
from patchc.ir.provenance import check_weights, fingerprint
from patchc.ir.tiles import expand_tiles
from patchc.masking.cadence import Cadence
from patchc.masking.recover_checkpoint import checkpoint_key, is_sharded, load_recovery, save_recovery
from patchc.masking.ranks import agree, check_finite, first_bad_step, global_mean, stop_agreed
from patchc.masking.train import batch_getter
from patchc.utils.progress import progress as progress_bar
from patchc.utils.stopping import stop_now, stoppable

SCOPES = ("all", "values")
METHODS = ("adam", "sparsegpt")
SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class RecoverConfig:
    """How `recover` trains; validated on creation (every message names the argument to fix).

    Example: `RecoverConfig(steps=300, lr=3e-4, scope="values").schedule_factor(150)` -> 0.5.
    """

    steps: int = 300
    lr: float = 3e-4
    scope: str = "all"
    method: str = "adam"
    schedule: str = "cosine"
    warmup: int = 0
    grad_clip: float | None = 1.0
    score_batches: int = 4

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"recover: scope={self.scope!r}; use one of {SCOPES}")
        if self.method not in METHODS:
            raise ValueError(f"recover: method={self.method!r}; use one of {METHODS}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"recover: schedule={self.schedule!r}; use one of {SCHEDULES}")
        if self.method == "adam" and self.steps < 1:
            raise ValueError(f"recover: steps={self.steps} must be >= 1 (or use method='sparsegpt')")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"recover: lr={self.lr} must be a positive number")
        if not 0 <= self.warmup < max(self.steps, 1):
            raise ValueError(f"recover: warmup={self.warmup} must be in [0, steps={self.steps})")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"recover: grad_clip={self.grad_clip} must be > 0, or None for no clipping")
        if self.score_batches < 0:
            raise ValueError(f"recover: score_batches={self.score_batches} must be >= 0")
        if self.method == "sparsegpt" and self.scope != "all":
            raise ValueError("recover: method='sparsegpt' updates every kept weight (its OBS update spreads the "
                             "error over all of them); use scope='all', or method='adam' for scope='values'")

    def schedule_factor(self, step: int) -> float:
        """The learning-rate multiplier of optimizer step `step` (0-based): warmup, then the decay to 0."""
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.schedule == "constant":
            return 1.0
        done = (step - self.warmup) / max(self.steps - self.warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * done)) if self.schedule == "cosine" else 1.0 - done


@dataclass
class TrainedParam:
    """One model parameter that holds planned layers: which entries train, which must stay 0."""

    param: nn.Parameter
    train: torch.Tensor  # bool, the parameter's shape
    pruned: torch.Tensor  # bool, the parameter's shape


@dataclass(frozen=True)
class Saved:
    """Where and how often (`Cadence`) Adam recovery checkpoints, and the key a checkpoint must carry to be
    resumed."""

    path: str | os.PathLike | None = None
    every: int = 50
    resume: bool = False
    key: dict | None = None


def recover(
    plan: TilePlan,
    model: nn.Module,
    batches: Callable[[int], Any] | Sequence | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    steps: int = 300,
    lr: float = 3e-4,
    *,
    scope: str = "all",
    method: str = "adam",
    calib: Any = None,
    schedule: str = "cosine",
    warmup: int = 0,
    grad_clip: float | None = 1.0,
    score_batches: int = 4,
    progress: bool = True,
    force: bool = False,
    on_log: Callable[[dict[str, float]], None] | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 50,
    resume: bool = False,
    checkpoint_tag: dict | None = None,
) -> TilePlan:
    """Fine-tune the weights `plan` keeps in `model` with its masks fixed; returns the recovered plan.

    `model` is the plan's source (the dense model; checked as `plan.apply` does, `force=True` skips that)
    and is changed in place: it ends holding the recovered W * M. Other parameters stay frozen.

    Args:
        batches: `batches(step)` or a sequence indexed by `step % len` (as `patchc.train_masks`).
        loss_fn: `loss_fn(model, batch)` -> scalar loss, e.g. `patchc.lm_loss`.
        scope: "all" trains every kept weight; "values" only the kept values of 2:4 tiles.
        method: "adam", or "sparsegpt" (one OBS update per layer from `calib`, a `patchc.calibrate`
            result of the dense model; `batches`, `loss_fn` and `steps` are then optional).
        score_batches: the first this many batches are scored before and after (meta's loss_before/after).
        checkpoint: Adam recovery's state written here every `checkpoint_every` steps (further apart where
            saving is slow: `Cadence`) and at the end (`recover_checkpoint.py`); `resume=True` goes on from
            it when the same recovery wrote it (`checkpoint_tag`: what else must match, e.g. the loss and
            batch settings), else starts over.

    Example:
        >>> rec = recover(plan, model, blocks, patchc.lm_loss, steps=100, lr=3e-4, scope="values")
        >>> rec.save("plan-recovered.patch"); rec.apply(bundle.reload())
    """
    cfg = RecoverConfig(steps=steps, lr=lr, scope=scope, method=method, schedule=schedule, warmup=warmup,
                        grad_clip=grad_clip, score_batches=score_batches)
    if cfg.method == "adam" and (batches is None or loss_fn is None):
        raise ValueError("recover: method='adam' needs batches and loss_fn")
    if checkpoint is not None and cfg.method != "adam":
        raise ValueError("recover: only method='adam' checkpoints (method='sparsegpt' takes seconds); drop checkpoint")
    if checkpoint_every < 0:
        raise ValueError(f"recover: checkpoint_every={checkpoint_every} must be >= 0 (0: only at the end)")
    if cfg.method == "sparsegpt" and calib is None:
        raise ValueError("recover: method='sparsegpt' needs calib=patchc.calibrate(dense_model, batches)")
    where = plan.meta.get(tg.META_KEY)
    views = {fqn: tg.resolve(model, fqn, where) for fqn in plan.layers}
    if not force:
        check_weights(plan, model)
    prints = source_fingerprints(plan, model, views)
    get_batch = batch_getter(batches, 'recover') if batches is not None else None
    n_score = min(cfg.score_batches, len(batches)) if isinstance(batches, Sequence) else cfg.score_batches
    score = (lambda: mean_loss(model, loss_fn, get_batch, n_score)) if get_batch and loss_fn and n_score else None
    start = time.perf_counter()
    if cfg.method == "sparsegpt":
        dense = {fqn: tg.read(model, t).detach().clone() for fqn, t in views.items()}
        plan.apply(model, force=True)  # checked above; the loss before is that of the hardened plan
        before = score() if score else None
        update_sparsegpt(plan, model, views, dense, calib, progress)
        history: list[dict[str, float]] = []
    else:
        plan.apply(model, force=True)
        before = score() if score else None
        key = checkpoint_key(plan, cfg, prints, checkpoint_tag) if checkpoint is not None else None  # hashes the plan
        saved = Saved(checkpoint, checkpoint_every, resume, key)
        history = train_kept(plan, model, views, get_batch, loss_fn, cfg, progress, on_log, saved)
    after = score() if score else None
    layers = {fqn: rebuild(layer, tg.read(model, views[fqn]), cfg.scope) for fqn, layer in plan.layers.items()}
    return recovered_plan(plan, layers, prints, recovery_record(cfg, before, after, start, history))


def recovery_record(cfg: RecoverConfig, before: float | None, after: float | None, start: float,
                    history: list[dict[str, float]]) -> dict:
    """What a recovered plan's meta["recovery"] says was done (a method's own settings only)."""
    record = {**dataclasses.asdict(cfg), "loss_before": before, "loss_after": after,
              "seconds": round(time.perf_counter() - start, 3), "history": history[-20:],
              "fingerprints": "of the source weights the plan was made from, not of the recovered values"}
    if cfg.method == "sparsegpt":
        for key in ("steps", "lr", "schedule", "warmup", "grad_clip"):
            record.pop(key)
    return record


def recovered_plan(plan: TilePlan, layers: dict[str, LayerPlan], prints: dict[str, dict], record: dict) -> TilePlan:
    """`plan` with its layers' recovered values, still applying to its source (`prints`), `record` in its meta."""
    meta = dict(plan.meta) | {"fingerprints": prints, "recovery": record}
    return TilePlan(layers=layers, skipped=dict(plan.skipped), meta=meta)


def source_fingerprints(plan: TilePlan, model: nn.Module, views: dict[str, tg.Target]) -> dict[str, dict]:
    """The plan's fingerprints of its source weights, completed from `model` (still the source here)
    for layers that have none, so the recovered plan keeps applying to that source."""
    recorded = dict(plan.meta.get("fingerprints") or {})
    for fqn, target in views.items():
        if fqn not in recorded:
            recorded[fqn] = fingerprint(tg.read(model, target))
    return recorded


def rebuild(layer: LayerPlan, weight: torch.Tensor, scope: str = "all") -> LayerPlan:
    """`layer` with its kept values read from `weight` (N, K): same kinds, same 2:4 metadata, same bias.

    With scope="values" the dense tiles are the layer's own buffer (bit-identical, whatever the weight).
    """
    fresh = LayerPlan.from_mask(layer.name, weight.detach().to(layer.dense.device, layer.dtype), layer.kinds,
                                layer.mask(), bias=layer.bias, tile=layer.tile)
    if not torch.equal(fresh.meta, layer.meta):  # cannot happen for a verified layer: say so loudly if it does
        raise PlanError(f"layer {layer.name}: rebuilding the recovered values changed the 2:4 metadata")
    dense = layer.dense if scope == "values" else fresh.dense
    return dataclasses.replace(layer, dense=dense, values=fresh.values)


def trainable(plan: TilePlan, model: nn.Module, views: dict[str, tg.Target], scope: str) -> dict[str, TrainedParam]:
    """Per parameter holding planned layers: the entries that train and the pruned ones (both bool)."""
    found: dict[str, TrainedParam] = {}
    for name in dict.fromkeys(t.param for t in views.values()):
        p = model.get_parameter(name)
        found[name] = TrainedParam(p, *param_masks(plan, views, name, p.shape, scope, p.device))
    return found


def param_masks(plan: TilePlan, views: dict[str, tg.Target], param: str, shape: torch.Size, scope: str,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(entries that train, pruned entries) of parameter `param`, bool tensors of its `shape`."""
    train = torch.zeros(shape, dtype=torch.bool, device=device)
    pruned = train.clone()
    for fqn, target in views.items():
        if target.param != param:
            continue
        layer = plan.layers[fqn]
        keep = layer.mask().to(device)
        kept = keep
        if scope == "values":
            sparse = (layer.kinds == TILE_SPARSE24).to(keep.device)
            kept = keep & expand_tiles(sparse, layer.tile, layer.shape)
        tg.matrix(train, target).copy_(kept)
        tg.matrix(pruned, target).copy_(~keep)
    return train, pruned


def train_kept(plan: TilePlan, model: nn.Module, views: dict[str, tg.Target], get_batch: Callable[[int], Any],
               loss_fn: Callable[[nn.Module, Any], torch.Tensor], cfg: RecoverConfig, progress: bool,
               on_log: Callable[[dict[str, float]], None] | None = None,
               saved: Saved = Saved(), named: dict[str, TrainedParam] | None = None) -> list[dict[str, float]]:
    """The Adam loop of `recover`; returns its log records ({"step", "loss", "lr"} every 10 steps).

    `named`: `trainable`'s parameters and masks, given when they are sharded (`patchc.job.fsdp_recover`): every
    rank then runs this loop on its shards, and logs, stops and checkpoints at the same steps as the others."""
    named = trainable(plan, model, views, cfg.scope) if named is None else named
    params = list(named.values())
    tensors = {name: e.param for name, e in named.items()}
    sharded = is_sharded(tensors)
    grads_were = {name: p.requires_grad for name, p in model.named_parameters()}  # FSDP2 swaps the objects
    was_training = model.training
    for p in model.parameters():
        p.requires_grad_(False)
    for w in tensors.values():
        w.requires_grad_(True)
    optimizer = torch.optim.Adam(list(tensors.values()), lr=cfg.lr)
    history: list[dict[str, float]] = []
    start = 0
    if saved.resume and saved.path is not None:
        start, history = load_recovery(saved.path, saved.key, tensors, optimizer) or (0, [])
    cadence = Cadence(saved.every if saved.path is not None else 0, last=start)
    # Dropout off: the kept weights learn to reproduce a dropout-free teacher, so the student should be
    # the same function. With BERT's dropout on, MiniLM 35% recovered to 0.939 cosine instead of 0.949.
    model.eval()
    try:
        bar = progress_bar(range(start, cfg.steps), desc=f"weight recovery ({cfg.scope})", disable=not progress,
                           initial=start, total=cfg.steps)
        with stoppable() as handled:
            first_bad, finite = None, functools.partial(check_finite, what="weight recovery", ranks=sharded)
            for t in bar:
                loss = _step(model, loss_fn, get_batch(t), optimizer, params, cfg.lr * cfg.schedule_factor(t),
                             cfg.grad_clip)
                first_bad = first_bad_step(first_bad, loss, t + 1)
                if (t + 1) % 10 == 0 or t == 0 or t + 1 == cfg.steps:
                    finite(first_bad, t + 1)
                    history.append(_log(t + 1, global_mean(loss.detach()) if sharded else loss, optimizer, bar, on_log))
                # a signal: stop after this step, with its checkpoint written (sharded: the ranks agree on it)
                stop = stop_agreed(handled and sharded, t + 1, cfg.steps, loss.device)
                if cadence.due(t + 1) or (saved.path is not None and (t + 1 == cfg.steps or stop is not None)):
                    finite(first_bad, t + 1, "no checkpoint is written over the last one")  # never NaN weights
                    cadence.save(t + 1, lambda: save_recovery(saved.path, saved.key, tensors, optimizer, t + 1,
                                                              history), agree if sharded else (lambda x: x))
                if stop is not None:
                    stop_now(stop)
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        for name, p in model.named_parameters():
            p.requires_grad_(grads_were[name])
        model.train(was_training)
    return history


def _step(model: nn.Module, loss_fn: Callable, batch: Any, optimizer: torch.optim.Optimizer, params: list[TrainedParam],
          lr: float, grad_clip: float | None) -> torch.Tensor:
    """One Adam step of the kept weights at `lr`; pruned entries are exactly 0 after it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    for e in params:
        if e.param.grad is not None:  # a zero gradient keeps Adam's moments, hence the entry, unchanged
            e.param.grad.mul_(e.train)
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_([e.param for e in params], grad_clip)
    optimizer.step()
    with torch.no_grad():
        for e in params:
            e.param.masked_fill_(e.pruned, 0.0)  # exact zeros, whatever the optimizer did
    return loss


def _log(step: int, loss: torch.Tensor, optimizer: torch.optim.Optimizer, bar, on_log) -> dict[str, float]:
    """The log record of `step` (its loss checked finite just before), shown on the bar and passed to `on_log`."""
    record = {"step": step, "loss": float(loss.detach()), "lr": optimizer.param_groups[0]["lr"]}
    if hasattr(bar, "set_postfix"):
        bar.set_postfix(loss=f"{record['loss']:.3f}")
    if on_log is not None:
        on_log(record)
    return record


@torch.no_grad()
def update_sparsegpt(plan: TilePlan, model: nn.Module, views: dict[str, tg.Target], dense: dict[str, torch.Tensor],
                     calib: Any, progress: bool) -> None:
    """Write SparseGPT's OBS update of each planned layer (mask fixed to the plan's) into `model`.

    Layers the calibration has no Hessian for keep the hardened W * M, with a warning naming them.
    """
    from patchc.pruning.sparsegpt import factor_of, shared_factors, sparsegpt

    missing = []
    with shared_factors():  # layers reading one input factor its Hessian once
        for fqn in progress_bar(list(plan.layers), desc="recovery (sparsegpt)", disable=not progress):
            stats = calib[fqn] if fqn in calib else None
            if stats is None or not getattr(stats, "has_hessian", False):
                missing.append(fqn)
                continue
            mask = plan.layers[fqn].mask().to(dense[fqn].device)
            hessian = stats.hessian  # a fresh K x K tensor each read
            factor = factor_of(stats, hessian, dense[fqn].device, name=fqn)  # sparsegpt's default damping
            _, updated = sparsegpt(dense[fqn], hessian, mask=mask, name=fqn, factor=factor)
            tg.read(model, views[fqn]).copy_(updated.masked_fill(~mask, 0.0))
    if missing:
        warnings.warn(f"recover(method='sparsegpt'): no calibration Hessian for {len(missing)} layer(s), "
                      f"left as hardened: {missing[:5]}", stacklevel=3)


@torch.no_grad()
def mean_loss(model: nn.Module, loss_fn: Callable, get_batch: Callable[[int], Any], count: int) -> float:
    """Mean loss over batches 0..count-1 in eval mode (no dropout), as a plain float."""
    was_training = model.training
    model.eval()
    try:
        return sum(float(loss_fn(model, get_batch(i))) for i in range(count)) / count
    finally:
        model.train(was_training)


__all__ = ["recover", "RecoverConfig", "rebuild", "SCOPES", "METHODS", "SCHEDULES"]
