"""Opening the model a command works on: one sequence for `prune`, `recover`, `eval` and `sample`.

    check the device -> load the bundle onto it -> cast to the weight dtype -> check the weights and
    sequence lengths -> choose the CPU thread count

Example:
    >>> bundle = load_bundle(PruneOptions())      # stories260K, fp32, one thread on a CPU
    >>> bundle.kind
    'causal'
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import Counter
from collections.abc import Iterator

import torch

from patchc.job.options import PruneOptions

# Square tile sides `auto_tile` picks from, widest first.
AUTO_TILES = (128, 64, 32, 16)


def load_bundle(opts: PruneOptions, training: bool = True):
    """`opts.model` loaded onto `opts.device` in its weight dtype, checked, with the thread count set.
    `training=False` (`patchc eval`): --block-len is not checked, since nothing is trained. With --offload
    the weights load into host memory and stream to the device block by block (`patchc.models.offload`)."""
    from patchc.models import load_model

    from patchc.job.memory import check_loads

    check_device(opts.device)
    dtype = weight_dtype(opts)
    check_loads(opts, dtype)
    # loaded in the weights' dtype (an fp32 copy of a bf16-served model would take twice the GPU memory), then
    # cast whole: a module transformers keeps in fp32 (`_keep_in_fp32_modules`) is cast too, as it always was
    where = "cpu" if opts.offload else opts.device  # --offload: into host memory, then streamed block by block
    bundle = cast_bundle(load_model(opts.model, device=where, dtype=dtype, progress=opts.progress), dtype)
    check_model(bundle, opts, training)
    choose_threads(opts, bundle.model)
    if opts.offload:
        from patchc.models.offload import stream_blocks

        if opts.device == "cpu":
            warnings.warn("--offload on cpu: the weights are in host memory already, so streaming only copies each "
                          "block for its forward; it is meant for --device cuda", stacklevel=2)
        stream_blocks(bundle.model, opts.device)  # `bundle.reload()` still gives plain host copies
    return bundle


def auto_tile(model: torch.nn.Module) -> tuple[int, int]:
    """The tile `patchc prune` uses when --tile is not given: the paper's 128 x 128 for a model at
    least 384 wide, else the widest square of `AUTO_TILES` that fits three times into its hidden size
    (the input width most of its linears share), 16 x 16 at least. The decode kernels stream weights
    at the memory limit from 64 x 64 tiles up; smaller ones only suit small models.

    Example:
        >>> auto_tile(load_model(DEFAULT_MODEL).model), auto_tile(load_model("minilm").model)
        ((16, 16), (128, 128))
    """
    from patchc.ir.targets import is_conv1d

    widths = Counter(m.weight.shape[0] if is_conv1d(m) else m.in_features for m in model.modules()
                     if isinstance(m, torch.nn.Linear) or is_conv1d(m))
    hidden = widths.most_common(1)[0][0] if widths else 0
    side = next((t for t in AUTO_TILES if 3 * t <= hidden), AUTO_TILES[-1])
    return side, side


def with_tile(opts: PruneOptions, bundle) -> PruneOptions:
    """`opts` with --tile resolved for the loaded model (`auto_tile` when it was not given)."""
    return opts if opts.tile is not None else dataclasses.replace(opts, tile=auto_tile(bundle.model))


def cast_bundle(bundle, dtype: torch.dtype):
    """The bundle with its model, and every fresh copy it hands out, in `dtype`."""
    if dtype == torch.float32:
        return bundle
    reload = bundle.reload
    return dataclasses.replace(bundle, model=bundle.model.to(dtype), reload=lambda: reload().to(dtype))


def check_model(bundle, opts: PruneOptions, training: bool = True) -> None:
    """Weights that are all finite, sequence lengths the model's positions allow (--block-len only when
    `training`) and recovery settings the model's kind takes, before any work."""
    opts.recovery_splice(bundle.kind, bundle.name)
    for name, param in bundle.model.named_parameters():
        bad = int((~torch.isfinite(param.detach())).sum())
        if bad:
            raise ValueError(f"--model {opts.model}: parameter {name} holds {bad:,} NaN/inf values; the checkpoint "
                             "is damaged or was saved from a diverged run")
    limit = bundle.block_len_limit
    lengths = [("--eval-context", opts.eval_context)]
    if training:
        lengths.insert(0, ("--block-len", opts.block_len))
    for flag, value in lengths:
        if bundle.kind == "causal" and value > limit:
            raise ValueError(f"{flag} {value} is longer than the {limit} positions {bundle.name} was built for; "
                             f"use {flag} {limit} or less")


def choose_threads(opts: PruneOptions, model: torch.nn.Module) -> None:
    """Tiny models on CPU run faster on one thread: their ops are too small to split."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    elif opts.device == "cpu" and sum(p.numel() for p in model.parameters()) < 10_000_000:
        torch.set_num_threads(1)


def weight_dtype(opts: PruneOptions) -> torch.dtype:
    """bf16 weights on a GPU (the masks' logits, noise and Adam state stay fp32), fp32 on CPU."""
    if opts.dtype == "auto":
        return torch.bfloat16 if opts.device.startswith("cuda") else torch.float32
    return getattr(torch, opts.dtype)


@contextlib.contextmanager
def parked(model: torch.nn.Module, when: bool = True) -> Iterator[torch.nn.Module]:
    """`model`'s weights in host memory for the block when they sit on an accelerator, moved back after.

    FSDP2 ranks train the masks from their shards of the weights (the exported program holds copies), so
    the whole dense model need not take device memory meanwhile. Its parameters move in place (`.to`
    keeps them the same objects), so an export that shares them moves with it.

    Example:
        >>> with parked(bundle.model, when=fsdp):
        ...     patchc.train_masks(prog, ...)
    """
    from patchc.models.offload import streaming

    stream = streaming(model)
    if stream is not None and when:  # --offload: only the parts outside the blocks are on the device
        stream.park()
        try:
            yield model
        finally:
            stream.unpark()
        return
    device = next(iter(model.parameters()), torch.empty(0)).device
    if not when or device.type in ("cpu", "meta"):
        yield model
        return
    model.to("cpu")
    try:
        yield model
    finally:
        model.to(device)


def check_device(device: str) -> None:
    """A CUDA device that exists, before anything is loaded onto it."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA GPU that torch can use; use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")


__all__ = ["check_device", "weight_dtype", "load_bundle", "cast_bundle", "check_model", "choose_threads", "parked"]
