"""Mask training: Adam over the logits, gradient clipping, schedules, logs, checkpoint and exact resume.

A step is: batch(t) -> task loss + prog.regularizer() -> backward -> clip -> Adam -> prog.step().
With `optim=MaskOptimConfig(memory="low")` clip and Adam run inside backward, per logit tensor, as
each gradient is accumulated (bf16 Adam state, no gradient persists; see `patchc.masking.optim`).
Batches are looked up by step index (a callable or a sequence, cycled), so a resumed run sees
exactly the batches the uninterrupted run would have; with the program's noise counters and the
optimizer state in the checkpoint, 50 + 50 resumed steps equal 100 straight steps bit for bit.

Example:
    >>> def lm_loss(prog, ids):
    ...     logits = prog(ids[:, :-1])
    ...     return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    >>> result = patchc.train_masks(prog, blocks, lm_loss, steps=300, lr=1e-3)
    >>> result.history[-1]["density"]
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from patchc.masking.cadence import Cadence
from patchc.masking.hybrid_mask import HybridMask
from patchc.masking.optim import MaskOptimConfig, StepInBackward, clip_each_, make_mask_optimizer
from patchc.masking.param_mask import hybrid_masks
from patchc.masking.recompute import recompute_masked_weights
from patchc.models.outputs import logits_of
from patchc.utils.chunks import piecewise
from patchc.utils.files import atomic_path, read_state
from patchc.masking.ranks import agree, check_finite, first_bad_step, global_mean, stop_agreed, world_size
from patchc.utils.stopping import stop_now, stoppable

if TYPE_CHECKING:  # the trainer takes the program passes/ builds; importing it here would be circular
    from patchc.passes.program import MaskedProgram

CHECKPOINT_FORMAT = "patchc.train-checkpoint"
CHECKPOINT_VERSION = 1


@dataclass
class TrainResult:
    """What `train_masks` did: per-logged-step records and the final step."""

    history: list[dict[str, float]] = field(default_factory=list)
    step: int = 0
    seconds: float = 0.0


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save into a temp file beside `path`, then rename: a crash never leaves half a file."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def batch_getter(batches: Callable[[int], Any] | Sequence, who: str = "train_masks") -> Callable[[int], Any]:
    """step -> batch from a callable, or from a sequence cycled by `step % len`."""
    if callable(batches):
        return batches
    if len(batches) == 0:
        raise ValueError(f"{who} got an empty batch sequence")
    return lambda step: batches[step % len(batches)]


def load_checkpoint(path: str | os.PathLike, prog: MaskedProgram, optimizer: torch.optim.Optimizer) -> TrainResult:
    """Restore program state (logits, noise counters, schedule step) and optimizer state."""
    try:
        state = read_state(path)
    except ValueError as exc:
        raise ValueError(f"{path}: not a readable patchc training checkpoint ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a patchc training checkpoint (format tag missing)")
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {state.get('version')} is not {CHECKPOINT_VERSION}")
    if state["config"] != _config_tag(prog):
        raise ValueError(f"{path}: checkpoint was made with another PatchConfig: {_config_diff(state, prog)}")
    saved_kind = state.get("optimizer_kind", optimizer_kind(optimizer))  # absent in older checkpoints
    if saved_kind != optimizer_kind(optimizer):
        raise ValueError(f"{path}: checkpoint was trained with optimizer {saved_kind} (now {optimizer_kind(optimizer)}): "
                         "resume with the same MaskOptimConfig (memory mode)")
    prog.load_state_dict(state["program"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except ValueError as exc:  # e.g. written before the tile logits had a param group of their own
        raise ValueError(f"{path}: the optimizer state does not fit this program's optimizer ({exc}); "
                         "start again without resuming") from exc
    return TrainResult(history=list(state["history"]), step=int(state["step"]))


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """"Adam", "LowMemAdam(bfloat16)" or "LowMemAdam(bfloat16, v per group)": what must match for an exact
    resume (fused / foreach need not)."""
    dtype = getattr(optimizer, "state_dtype", None)
    if dtype is None:
        return type(optimizer).__name__
    shared = any(g.get("v_per_group") for g in optimizer.param_groups)
    return f"{type(optimizer).__name__}({str(dtype).removeprefix('torch.')}{', v per group' if shared else ''})"


def _config_tag(prog: MaskedProgram) -> str:
    return repr(prog.cfg)


def _config_diff(state: dict, prog: MaskedProgram) -> str:
    """One line naming each setting that differs ("steps 100 (now 50)"), or both reprs for old checkpoints."""
    saved, now = state.get("settings"), prog.cfg.to_dict()
    if not isinstance(saved, dict):
        return f"{state['config']} (now {_config_tag(prog)})"
    return "; ".join(f"{k} {saved.get(k)!r} (now {v!r})" for k, v in now.items() if saved.get(k) != v)


def save_checkpoint(path: str | os.PathLike, prog: MaskedProgram, optimizer: torch.optim.Optimizer, result: TrainResult) -> None:
    atomic_torch_save(
        {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "config": _config_tag(prog),
            "settings": prog.cfg.to_dict(),
            "program": prog.state_dict(),
            "optimizer": optimizer.state_dict(),
            "optimizer_kind": optimizer_kind(optimizer),
            "history": result.history,
            "step": result.step,
        },
        path,
    )


class CheckpointIO:
    """How `train_masks` saves and restores its checkpoint: one torch.save'd file (the default).

    Replace it to checkpoint differently, e.g. sharded with torch.distributed.checkpoint under FSDP2
    (every rank then calls `save` and `load`, so pass the checkpoint path on every rank).
    """

    def exists(self, path: str | os.PathLike) -> bool:
        return Path(path).exists()

    def save(self, path: str | os.PathLike, prog: MaskedProgram, optimizer: torch.optim.Optimizer,
             result: TrainResult) -> None:
        save_checkpoint(path, prog, optimizer, result)

    def load(self, path: str | os.PathLike, prog: MaskedProgram, optimizer: torch.optim.Optimizer) -> TrainResult:
        return load_checkpoint(path, prog, optimizer)


def make_optimizer(prog: MaskedProgram, lr: float, optim: MaskOptimConfig | None = None,
                   tile_lr: float | None = None) -> torch.optim.Optimizer:
    """Adam over the mask logits: fused fp32 Adam by default, `LowMemAdam` for `memory="low"`.

    The tile logits form their own param group at `tile_lr` (default `lr`). The low-memory optimizer's
    stochastic rounding is seeded by the program's seed; the 2:4 logits (last dim = one group) are
    handed over as `grouped` for `MaskOptimConfig(v_per_group=True)`."""
    masks = [m for m in prog.modules() if isinstance(m, HybridMask)]
    grouped = [m.nm_logits for m in masks if m.nm_logits.requires_grad]
    tiles = [m.tile_logits for m in masks if m.tile_logits is not None]
    return make_mask_optimizer(prog.mask_parameters(), lr, optim, seed=prog.cfg.seed, grouped=grouped,
                               tiles=tiles, tile_lr=tile_lr)


def train_masks(
    prog: MaskedProgram,
    batches: Callable[[int], Any] | Sequence,
    loss_fn: Callable[[MaskedProgram, Any], torch.Tensor],
    steps: int | None = None,
    lr: float = 1e-3,
    *,
    tile_lr: float | None = None,
    grad_clip: float | None = 1.0,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    log_every: int = 10,
    progress: bool = True,
    on_log: Callable[[dict[str, float]], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    schedule_steps: int | None = None,
    desc: str = "mask training",
    checkpoint_io: CheckpointIO | None = None,
    optim: MaskOptimConfig | None = None,
) -> TrainResult:
    """Train the mask logits of `prog` for `steps` optimizer steps (default: `prog.cfg.steps`).

    Args:
        batches: `batches(step)` or a sequence indexed by `step % len`.
        loss_fn: `loss_fn(prog, batch)` -> the task loss; the regulariser is added here.
        tile_lr: Adam learning rate of the tile logits (default `lr`, the paper's). `patchc prune` uses
            30x `lr`: at a few hundred steps it chose markedly better tiles (measured in its options).
        checkpoint: file written every `checkpoint_every` steps and at the end (atomically); further apart
            where saving would take more than 5% of the time (`Cadence`).
        resume: continue from `checkpoint` if it exists (exact: same batches, noise, Adam state).
        optimizer: defaults to `make_optimizer(prog, lr, optim, tile_lr)` over `prog.mask_parameters()`.
        schedule_steps: the length T of the tau / kappa schedules and the lambda2 decay (held after T);
            default `steps`, so `train_masks(prog, ..., steps=50)` anneals fully in 50 steps.
        desc: the progress bar's label.
        checkpoint_io: how the checkpoint is written and read (default: one file, `CheckpointIO`).
        optim: the optimizer's memory mode (`MaskOptimConfig`; default fp32 Adam, global clipping).
            `MaskOptimConfig(memory="low")`: bf16 Adam state, each tensor stepped inside backward and
            its gradient freed, `grad_clip` applied per tensor. Under torchrun (DDP, FSDP2) the step runs
            after backward instead, since the gradients are averaged over ranks only then; the clip
            stays per (whole) tensor, so the ranks train what one process trains.

    Example:
        >>> train_masks(prog, blocks, lm_loss, steps=300, optim=MaskOptimConfig(memory="low"))
    """

    steps = prog.cfg.steps if steps is None else steps
    if steps < 0:
        raise ValueError(f"train_masks: steps={steps} must be >= 0")
    schedule_steps = (steps or prog.cfg.steps) if schedule_steps is None else schedule_steps  # 0: nothing to fit
    if schedule_steps < 1:
        raise ValueError(f"train_masks: schedule_steps={schedule_steps} must be >= 1")
    if schedule_steps != prog.cfg.steps:
        prog.cfg = prog.cfg.replace(steps=schedule_steps)  # the program's schedules read T from its config
    optim = optim or MaskOptimConfig()
    optimizer = optimizer or make_optimizer(prog, lr, optim, tile_lr)
    in_backward = bool(optim.in_backward) and world_size() == 1
    clip_each = bool(optim.in_backward)  # the low mode clips per tensor, also where it steps after backward
    io = checkpoint_io or CheckpointIO()
    result = TrainResult()
    if resume:
        if checkpoint is None:
            raise ValueError("train_masks(resume=True) needs checkpoint=PATH")
        if io.exists(checkpoint):
            result = io.load(checkpoint, prog, optimizer)
    get_batch = batch_getter(batches)
    params = prog.mask_parameters()
    prog.train()
    start = time.perf_counter()
    from tqdm.auto import tqdm  # here: `import patchc` must work without tqdm (bare GPU images)

    bar = tqdm(range(result.step, steps), initial=result.step, total=steps, desc=desc, disable=not progress)
    cadence = Cadence(checkpoint_every if checkpoint is not None else 0, last=result.step)
    hooks = StepInBackward(optimizer, params, grad_clip) if in_backward else contextlib.nullcontext()
    # FSDP2 frees each block's gathered weights after its forward: a redraw gathers them again, where
    # `shard_program` said how (`HybridMask.regather`); other sharding keeps W * M.
    sharded = any(hasattr(p, "to_local") for p in params)
    regathers = all(m.regather is not None for m in hybrid_masks(prog.layers.values()))
    redraw = recompute_masked_weights() if optim.recompute and (regathers or not sharded) else contextlib.nullcontext()
    optimizer.zero_grad(set_to_none=True)
    first_bad = None  # the first step whose loss was not finite (0: none), kept on the device: read when it matters
    with hooks, redraw, stoppable() as handled:
        for t in bar:
            losses = _step(prog, loss_fn, get_batch(t), optimizer, params, grad_clip, in_backward, clip_each)
            first_bad = first_bad_step(first_bad, losses[0], t + 1)
            _after_step(prog, result, t, steps, losses, log_every, bar, on_log, first_bad)
            stop = stop_agreed(handled, t + 1, steps, losses[0].device)
            if cadence.due(t + 1) or (stop is not None and checkpoint is not None and cadence.last < t + 1):
                check_finite(first_bad, t + 1, "no checkpoint is written over the last one")  # never save NaN logits
                # rank 0's times on every rank: the ranks must save (a collective under FSDP2) at the same steps
                cadence.save(t + 1, lambda: io.save(checkpoint, prog, optimizer, result), agree)
            if stop is not None:  # a signal asked to stop: after this step, with its checkpoint written
                stop_now(stop)
    result.seconds = time.perf_counter() - start
    if checkpoint is not None and result.step > 0 and cadence.last < result.step:
        check_finite(first_bad, result.step, "no checkpoint is written over the last one")
        io.save(checkpoint, prog, optimizer, result)
    prog.eval()
    return result


def _step(prog, loss_fn, batch, optimizer, params, grad_clip, in_backward, clip_each):
    """One optimizer step; gradients are freed right after it, so none are alive during the next forward."""
    task = loss_fn(prog, batch)
    reg = prog.regularizer()
    loss = task + reg
    loss.backward()  # in_backward: the hooks clip, step and free each tensor's gradient here
    if not in_backward:
        if grad_clip is not None and clip_each:
            clip_each_([p.grad for p in params if p.grad is not None], grad_clip)
        elif grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss, task, reg


def _after_step(prog, result: TrainResult, t: int, steps: int, losses, log_every: int, bar, on_log,
                first_bad: torch.Tensor | None = None) -> None:
    """Advance the schedules; at log steps check the losses so far and record a history line."""
    prog.step()
    result.step = t + 1
    if not ((t + 1) % log_every == 0 or t + 1 == steps or t == 0):
        return
    check_finite(first_bad, t + 1)  # at log steps: a check per step would sync the GPU each step
    record = dict(zip(("loss", "task", "reg"), global_mean(torch.stack(losses).detach()).tolist()))
    record = {"step": t + 1, **record}
    if not math.isfinite(record["loss"]):
        raise FloatingPointError(f"mask training: loss is {record['loss']} at step {t + 1} (task {record['task']})")
    with torch.no_grad():
        record["density"] = prog.density("expected").item()
    record.update(prog.schedule())
    result.history.append(record)
    bar.set_postfix(task=f"{record['task']:.3f}", density=f"{record['density']:.3f}", tau=f"{record['tau']:.2f}")
    if on_log is not None:
        on_log(record)


def lm_loss(
    prog: torch.nn.Module,
    ids: torch.Tensor,
    logits: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM on a (B, T+1) block of token ids.

    The plain call `prog(inputs)` works on a program transformed from `export_causal_lm` (the program
    passes the `use_cache=False` it was exported with; a ModelOutput's `.logits` is taken).
    `logits(prog, inputs)` -> (B, T, V) replaces that call, e.g. a `ModelBundle`'s `logits`.

    Example:
        >>> loss_fn = functools.partial(patchc.lm_loss, logits=bundle.logits)
        >>> patchc.train_masks(prog, blocks, loss_fn, steps=300)
    """
    if ids.dim() != 2 or ids.shape[1] < 2:  # torch said only 'cannot reshape tensor of 0 elements'
        raise ValueError(f"lm_loss: a block of token ids is (batch, seq + 1) with at least 2 tokens (an input and "
                         f"the next token it predicts), got shape {tuple(ids.shape)}")
    out = prog(ids[:, :-1]) if logits is None else logits(prog, ids[:, :-1])
    rows = logits_of(out).flatten(0, 1)  # an HF export returns a ModelOutput; the program passes its use_cache=False
    # a few positions at a time: the gradient of one cross-entropy, bit for bit, with no (B * T, V) temporaries
    return piecewise(functools.partial(_lm_share, count=len(rows)), rows, ids[:, 1:].flatten())


def _lm_share(logits: torch.Tensor, targets: torch.Tensor, count: int) -> torch.Tensor:
    """A piece's share of the mean next-token cross-entropy over `count` positions (none ignored)."""
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum") / count


__all__ = ["TrainResult", "CheckpointIO", "MaskOptimConfig", "train_masks", "lm_loss", "save_checkpoint",
           "load_checkpoint", "atomic_torch_save"]
