"""Will mask training (and weight recovery) fit? Checked once the model is loaded, before text is generated.

Mask training holds, beyond the model (under FSDP2 on GPUs, 1/N of its weights: the rest waits in host
memory while the masks train), its 2:4 logits, their Adam state and (in the default mode) every
gradient until the step: a number of bytes per masked weight that follows from the dtypes alone
(`bytes_per_weight`, see `patchc.masking.optim`), 24 by default and 6.5 in the leanest mode. When that
floor alone exceeds the memory free on the device, the run cannot succeed, and `check_fits` says so at
once, with what each memory mode would need, instead of failing with an out-of-memory error at the first
step after minutes of generating text and calibrating on a 7B model. Activations, W * M and the logits come
on top of the floor, so a run that passes can still run out; one that fails would always have. For a causal
LM they are measured on the loaded model (`patchc.job.activations`), and a run whose floor and step together
exceed the free memory is warned, not refused: that part is an estimate.

Example:
    >>> check_fits(bundle.model, opts.patch_config(), opts)   # ValueError when the masks cannot fit
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from patchc.config import PatchConfig
from patchc.job.options import PruneOptions
from patchc.masking.optim import STATE_DTYPES, MaskOptimConfig
from patchc.pruning.observe import layer_matrix, plain_layers
from patchc.utils.env import proc_bytes
from patchc.utils.files import size_text as _size  # one formatter for every size patchc prints

log = logging.getLogger(__name__)

# The exported program keeps 5-10% more than the eager forward `step_bytes` measures (GQA's K / V repeated per
# head, explicit (T, T) masks: tests/test_activations.py)
STEP_MARGIN = 1.1
# (flags, the option changes they make), leanest last: what the refusal offers
MODES = (("--low-memory", dict(low_memory=True)),
         ("--low-memory --nm-param weight", dict(low_memory=True, nm_param="weight")),
         ("--low-memory --nm-param weight --v-per-group", dict(low_memory=True, nm_param="weight", v_per_group=True)))


def bytes_per_weight(cfg: MaskOptimConfig, logits_per_weight: float, group: int = 4) -> float:
    """Bytes per masked weight that its 2:4 logits (fp32), their Adam m and v and, unless each tensor steps
    inside backward, their gradients hold: what `patchc.masking.optim.state_bytes` measures, from the
    dtypes alone (the tile logits, one per tile, are left out).

    Example:
        >>> bytes_per_weight(MaskOptimConfig(), 6 / 4), bytes_per_weight(MaskOptimConfig(memory="low"), 6 / 4)
        (24.0, 12.0)
        >>> bytes_per_weight(MaskOptimConfig(memory="low", v_per_group=True), 4 / 4)   # 4 scores per group
        6.5
    """
    state = STATE_DTYPES[cfg.state_dtype].itemsize
    grads = 0 if cfg.in_backward else 4
    v = state / group if cfg.v_per_group else state * logits_per_weight
    return logits_per_weight * (4 + grads + state) + v


def logits_per_weight(opts: PruneOptions) -> float:
    """2:4 logits per masked weight: 6 patterns or 4 scores per group of 4; none when only tiles are learned."""
    if opts.variant == "tile":
        return 0.0
    return 6 / 4 if opts.nm_param == "pattern" else 4 / 4


def masked_weights(model: nn.Module, cfg: PatchConfig, layers: dict[str, int] | None = None) -> int:
    """How many weights `patchc.transform` masks under `cfg` (`masked_layers`)."""
    return sum(layer_matrix(model, name).numel() for name in masked_layers(model, cfg, layers))


def masked_layers(model: nn.Module, cfg: PatchConfig, layers: dict[str, int] | None = None) -> list[str]:
    """The layers `patchc.transform` masks under `cfg`: those it masks by default (`plain_layers`: nn.Linear,
    Conv1D, each expert's slice; no tied LM head) that `cfg.selects`, with 2:4 groups (K a multiple of 4).
    `layers`: `plain_layers(model, cfg.exclude)`, when already listed."""
    out = []
    for name in plain_layers(model, cfg.exclude) if layers is None else layers:
        w = layer_matrix(model, name)
        if cfg.selects(name, tuple(w.shape)) is None and w.shape[1] % 4 == 0:
            out.append(name)
    return out


def model_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s parameters (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_bytes(device: str) -> int | None:
    """Bytes free on `device` now (a GPU's, or the host's MemAvailable); None where it cannot be read."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    return proc_bytes("/proc/meminfo", "MemAvailable")


def check_fits(model: nn.Module, cfg: PatchConfig, opts: PruneOptions, ranks: int = 1, probe: bool = False) -> None:
    """ValueError when what mask training (and --recover's weight training) certainly holds beyond the
    loaded model exceeds what `opts.device` has free now; `ranks`: FSDP ranks sharing the mask state.
    `probe` (a causal LM): also measure what a step keeps for backward (`patchc.job.activations`) and warn
    when the masks and a step together exceed the free memory."""
    free = free_bytes(opts.device)
    if free is None:
        return
    layers = plain_layers(model, cfg.exclude)  # listed once: seconds for a model of many experts
    names = masked_layers(model, cfg, layers)
    weights, share = sum(layer_matrix(model, n).numel() for n in names), ranks if opts.fsdp else 1
    free_masks, held = free, "with the model loaded"
    if share > 1 and opts.device.startswith("cuda"):  # the ranks train from 1/N of it, the rest is `parked`
        dense = model_bytes(model)
        free_masks, held = free + dense * (1 - 1 / share), f"with 1/{share} of the model's weights"
    check_masks(weights, free_masks, opts, share, held)
    check_hessians(model, cfg, opts, layers)
    if opts.recover:
        check_recovery(model, weights, free, opts.device, share=share, hint=(
            "Prune without --recover and recover the run later where more memory is free (patchc recover RUN "
            "--device ...)" + ("" if share > 1 else ", or shard it: torchrun --nproc_per_node=N -m patchc prune "
                               "--fsdp --recover ...")))
    if probe:  # last: a run refused above needs no forward of the model
        warn_step(model, names, opts, weights, free_masks, ranks)


def warn_step(model: nn.Module, names: list[str], opts: PruneOptions, weights: int, free: float, ranks: int) -> None:
    """Warn when the masks' floor plus what a step keeps (`step_bytes`, measured) for the masked layers `names`
    (`weights` of them; `ranks` processes, which share the masks' state under --fsdp) exceeds `free`: an
    estimate, so a warning before minutes of text generation and calibration, not a refusal."""
    from patchc.job.activations import step_bytes

    try:
        step = step_bytes(model, names, opts, ranks)
    except Exception as exc:  # an estimate: a model the probe cannot run still trains
        log.debug("no step-memory estimate: %s", exc)
        return
    share = ranks if opts.fsdp else 1
    floor = weights * bytes_per_weight(opts.mask_optim(), logits_per_weight(opts)) / share
    if floor + STEP_MARGIN * step.total <= free:
        return
    where = f"each of {share} ranks" if share > 1 else opts.device
    redraw = "" if opts.low_memory else ", --low-memory (redraws W * M in backward)"
    warnings.warn(
        f"mask training will likely run out of memory on {where}: the masks need {_size(floor)} and a step of "
        f"{step.tokens:,} tokens keeps about {_size(STEP_MARGIN * step.total)} more (activations "
        f"{_size(step.activations)}, W * M {_size(step.masked_weights)}, logits {_size(step.logits)}, measured on "
        f"this model, and {STEP_MARGIN - 1:.0%} for what the program keeps beyond them), against "
        f"{_size(free)} free. Try a smaller --batch-size or --block-len{redraw}, or --fsdp under torchrun.",
        stacklevel=2)


def check_hessians(model: nn.Module, cfg: PatchConfig, opts: PruneOptions,
                   layers: dict[str, int] | None = None) -> None:
    """`check_hessian` for a prune whose prior or baselines use SparseGPT (`layers`: as `masked_weights`)."""
    if opts.prior == "sparsegpt" or opts.baselines:
        check_hessian(plain_layers(model, cfg.exclude) if layers is None else layers, opts.device,
                      "--prior sparsegpt" if opts.prior == "sparsegpt" else "a baseline",
                      "use --prior wanda --no-baselines")


def check_hessian(layers: dict[str, int], device: str, user: str, remedy: str) -> None:
    """ValueError when SparseGPT (for `user`) needs a K x K fp32 Hessian of one of `layers` (`plain_layers`: name
    -> K) larger than the memory free where it is built (`device`, with the model loaded) or where it waits (the
    host: `calibration_memory`): a layer that reads very many inputs, such as DBRX's flat w2 (E * F of them:
    118 GB at DBRX's size), before calibration runs out of memory."""
    if not layers:
        return
    name, k = max(layers.items(), key=lambda item: item[1])
    for where in dict.fromkeys((device, "cpu")):
        free = free_bytes(where)
        if free is not None and 4 * k * k > free:
            raise ValueError(f"SparseGPT ({user}) needs the {k:,} x {k:,} fp32 Hessian of {name}, "
                             f"{_size(4 * k * k)}, and {'the host' if where == 'cpu' else where} has {_size(free)} "
                             f"free; {remedy}")


def check_loads(opts: PruneOptions, dtype: torch.dtype) -> None:
    """ValueError before loading when the model's weights alone (`weight_bytes`, in `dtype`) exceed the memory
    free on `opts.device`, a GPU: a clear refusal instead of an out-of-memory error after minutes of reading.
    With --offload the weights must fit in host memory instead, and the GPU must hold what streaming keeps
    there (`check_streams`)."""
    if not opts.device.startswith("cuda"):
        return
    from patchc.ir.file_format import dtype_name
    from patchc.models.spec import weight_bytes

    if opts.offload:
        check_streams(opts, dtype)
        return
    free, need = free_bytes(opts.device), weight_bytes(opts.model, dtype)
    if free is None or need is None or need <= free:
        return
    raise ValueError(f"--model {opts.model}: its weights take {_size(need)} in {dtype_name(dtype)} and "
                     f"{opts.device} has {_size(free)} free. patchc loads the whole model onto each GPU (--fsdp shards "
                     "it once the masks train, not before), so it must fit on one; use a GPU with more free memory, "
                     "or --device cpu (`patchc eval` and `patchc sample` take --offload)")


def check_streams(opts: PruneOptions, dtype: torch.dtype) -> None:
    """--offload's refusals before loading: weights beyond host memory's MemAvailable, or the parts outside
    the blocks plus the largest block beyond the GPU's free memory."""
    from patchc.ir.file_format import dtype_name
    from patchc.models.offload import device_share
    from patchc.models.spec import meta_model, weight_bytes

    model = meta_model(opts.model)  # built once: seconds for a large config
    weights, host = weight_bytes(opts.model, dtype, meta=model), free_bytes("cpu")
    if weights is not None and host is not None and weights > host:
        raise ValueError(f"--model {opts.model} --offload: its weights take {_size(weights)} in {dtype_name(dtype)} "
                         f"and host memory has {_size(host)} available; --offload keeps them there, so use a "
                         "machine with more memory")
    free = free_bytes(opts.device)
    if model is None or free is None:
        return
    resident, block = device_share(model)
    need = (resident + block) * dtype.itemsize
    if need > free:
        raise ValueError(f"--model {opts.model} --offload: the parts outside its blocks and its largest block take "
                         f"{_size(need)} in {dtype_name(dtype)} on {opts.device}, which has {_size(free)} free")


def calibration_memory(opts: PruneOptions) -> tuple[int | None, str | None]:
    """(`max_hessian_bytes`, `store`) for `patchc.calibrate` in the job.

    On a GPU the SparseGPT Hessians (K x K fp32 per distinct input: 22 GB for LLaMA-2-7B, 1.6 times its bf16
    weights) take at most half the memory free there at a time, and wait in host memory for the prior and
    the baselines, which move each layer's to its weight's device; the masks train without them. On a CPU
    they stay where they are.

    Example:
        >>> calibration_memory(PruneOptions(device="cpu"))
        (None, None)
    """
    if not opts.device.startswith("cuda"):
        return None, None
    free = free_bytes(opts.device)
    return (None if free is None else free // 2), "cpu"


def check_masks(weights: int, free: float, opts: PruneOptions, share: int = 1,
                held: str = "with the model loaded") -> None:
    """The masks' logits, Adam state and gradients (`bytes_per_weight`), `share`d by FSDP ranks; `free`: bytes
    free beside what `held` says the device holds meanwhile."""
    per_weight = bytes_per_weight(opts.mask_optim(), logits_per_weight(opts))
    need = weights * per_weight / share
    if need <= free:
        return
    where = f"each of {share} ranks" if share > 1 else opts.device
    lines = [f"mask training needs at least {_size(need)} on {where} for the masks alone ({weights:,} masked "
             f"weights x {per_weight:g} bytes of logits, Adam state and gradients), and {_size(free)} "
             f"are free {held}."]
    leaner = []
    for flags, changes in MODES:
        other = dataclasses.replace(opts, **changes)
        b = bytes_per_weight(other.mask_optim(), logits_per_weight(other))
        if b < per_weight:
            fits = "fits" if weights * b / share <= free else "does not fit either"
            leaner.append(f"{flags}: {b:g} bytes per weight, {_size(weights * b / share)} ({fits})")
    if leaner:
        lines.append("Leaner modes (as good on stories260K: the README's mask-training state): " + "; ".join(leaner) + ".")
    lines.append("Or shard the state over GPUs with torchrun --nproc_per_node=N -m patchc prune --fsdp ..."
                 if opts.device.startswith("cuda") else "Or run on GPUs with --device cuda (and --fsdp to shard).")
    raise ValueError(" ".join(lines))


def check_recovery(model: nn.Module, weights: int, free: int, device: str, hint: str = "", share: int = 1) -> None:
    """Weight recovery trains a second copy of the model against the loaded dense one (the teacher), with a
    gradient, Adam's m and v (in the weights' dtype) and two bool masks per planned weight. `share` FSDP ranks
    (`fsdp_recover`) each hold 1/share of the copy, of a copy of the teacher and of the rest, and a GPU the loaded
    model leaves meanwhile (`parked`) has its bytes free too; `free`: what is free with the model loaded."""
    copy = model_bytes(model)
    per_weight = 3 * next(model.parameters()).element_size() + 2
    state = (f"{per_weight} bytes per planned weight for its gradient, Adam's m and v and two masks "
             f"({weights:,} weights)")
    if share == 1:
        need, where, held = copy + weights * per_weight, device, "with the model loaded"
        what = f"a second copy of the model ({_size(copy)}) beside the dense teacher, and {state}"
    else:
        need, where, held = (2 * copy + weights * per_weight) / share, f"each of {share} ranks", "with the " \
            "loaded model in host memory"
        if device.startswith("cuda"):  # the loaded model waits in host memory meanwhile (`parked`)
            free += copy
        what = f"1/{share} of a copy of the model and of the dense teacher ({_size(copy)} each) and of {state}"
    if need <= free:
        return
    raise ValueError(f"weight recovery needs at least {_size(need)} on {where}: {what}; {_size(free)} are free "
                     f"{held}. {hint}".rstrip())


# What uses the device's memory in each stage of a job, and the flags that shrink it.
STAGE_REMEDIES = {
    # every process loads the whole model (under --fsdp too) and generates its text (--train-data self, mix)
    "load": "a device with more memory, or --train-data real (no text to generate)",
    "export": "a device with more memory",
    "evaluate": "a smaller --eval-context",
    "calibrate": "fewer --calib-blocks",
    "train": "a smaller --batch-size or --block-len (activations), --low-memory (then --nm-param weight, "
             "--v-per-group), or --fsdp under torchrun",
    "baselines": "fewer --calib-blocks, a smaller --batch-size or --block-len (learned 2:4 trains as PATCH does)",
    "recover": "a smaller --batch-size, --fsdp under torchrun (shards the recovered copy, its teacher and Adam), "
               "or prune without --recover and `patchc recover RUN --batch-size N` later",
}


def out_of_memory(command: str, exc: BaseException) -> str:
    """One line for an out-of-memory error: where it happened (the job's stage, `stages.timed` marks it),
    what to shrink there, and that a run keeps what it finished.

    Example:
        >>> out_of_memory("prune", exc)   # exc raised in mask training
        'out of memory in the train stage (CUDA out of memory. Tried ...): try a smaller --batch-size ...'
    """
    stage = getattr(exc, "patchc_stage", None)
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    remedy = STAGE_REMEDIES.get(stage, "a smaller --batch-size, or a device with more memory")
    if command == "recover":
        remedy = "a smaller --batch-size; --resume goes on from its last checkpoint"
    elif command == "eval":
        remedy = "a smaller --eval-context"
    where = f" in the {stage} stage" if stage else ""
    kept = "; what finished is kept: rerun with --resume (same --out)" if command == "prune" else ""
    return f"out of memory{where} ({first[:160]}): try {remedy}{kept}"


__all__ = ["bytes_per_weight", "calibration_memory", "check_fits", "check_hessian", "check_hessians", "check_loads",
           "check_masks", "check_recovery", "check_streams", "free_bytes", "masked_layers", "masked_weights",
           "model_bytes", "out_of_memory", "warn_step"]
