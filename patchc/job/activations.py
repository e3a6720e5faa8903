"""What one mask step keeps for backward beyond the masks' own state: measured on the loaded model.

`patchc.job.memory.check_fits` refuses a run whose masks alone cannot fit. The rest of a step's memory grows
with --batch-size x --block-len and depends on the architecture, so it is measured, not modelled: three short
forwards of the loaded causal LM (1 x 16, 32 and 64 tokens, or fewer positions where the model has fewer:
`probe_lengths`) in the form the export traces (`program_form`: DBRX's experts run every expert on every
token, as in the program), with the masked layers' weights requiring grad as W * M does in training, count the
bytes autograd saves (each storage once; parameters and buffers not at all), and a quadratic in the length
(attention that keeps its T x T scores) carries them to --block-len. On top come each masked layer's W * M,
which the matmul keeps for its input's gradient unless the low-memory mode redraws it in backward (under
--fsdp too), and the (tokens, vocab) student logits, their gradient and (distilling) the teacher's logits, in
fp32.

The exported program the masks train keeps a little more than this eager forward: GQA's K / V repeated per
head and an explicit (T, T) mask per attention. On a Llama of hidden 512 x 4 layers (8 heads, 4 K / V heads),
batch 8 x 128 tokens, the estimate (142.7 MiB of activations + 44.3 MiB of W * M) is 9.5% below what the
program's own step keeps (206.6 MiB, logits and the mask draw's Gumbel bank aside); 5-8% below on 2 layers of
hidden 128 (`tests/test_activations.py`). `patchc.job.memory.warn_step` allows 10% for it.

Example:
    >>> step = step_bytes(bundle.model, ["model.layers.0.mlp.up_proj.weight", ...], opts)   # doctest: +SKIP
    >>> step.total > free                                                                   # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from patchc.ir import targets
from patchc.job.options import PruneOptions
from patchc.models.hf_export import program_form

PROBE_LENGTHS = (16, 32, 64)


@dataclass(frozen=True)
class StepBytes:
    """Bytes one mask step holds on one rank beyond the masks' state (`check_masks`' floor)."""

    activations: float  # what autograd saves through the model at the step's batch and length
    masked_weights: float  # W * M of every masked layer, kept for backward (0 where redrawn)
    logits: float  # the student's logits and their gradient, and a KD teacher's logits, fp32
    tokens: int  # this rank's tokens a step

    @property
    def total(self) -> float:
        return self.activations + self.masked_weights + self.logits


def saved_bytes(model: nn.Module, params: Iterable[nn.Parameter], length: int) -> int:
    """Bytes autograd keeps for backward in a forward of one random `length`-token sequence through `model`
    while `params`, and no other parameter, require grad: each storage once, the model's parameters and
    buffers not at all."""
    params = list(params)
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = max(kept.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    device = next(model.parameters()).device
    ids = torch.randint(0, vocab_size(model), (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    training = {id(p) for p in params}
    every = list(model.parameters())
    flags = [p.requires_grad for p in every]
    try:
        for p in every:  # as in mask training: only the masked weights' W * M carry a gradient
            p.requires_grad_(id(p) in training)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad(), \
                program_form(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids)  # fork_rng: a model in train mode draws dropout, and the job's draws stay its own
        del out  # the logits: counted apart (`StepBytes.logits`)
    finally:
        for p, flag in zip(every, flags):
            p.requires_grad_(flag)
    return sum(kept.values())


def per_sequence(model: nn.Module, params: list[nn.Parameter], length: int) -> float:
    """Bytes saved for one sequence of `length` tokens: `saved_bytes` at `probe_lengths`, fitted as
    a + b t + c t^2 (exact through the three), at `length`; never less than the longest probe scaled linearly."""
    lengths = probe_lengths(model)
    t = torch.tensor(lengths, dtype=torch.float64)
    y = torch.tensor([float(saved_bytes(model, params, n)) for n in lengths], dtype=torch.float64)
    a, b, c = torch.linalg.solve(torch.stack([torch.ones_like(t), t, t * t], dim=1), y).tolist()
    fitted = a + b * length + max(c, 0.0) * length * length
    return max(fitted, y[-1].item() * length / lengths[-1])


def probe_lengths(model: nn.Module) -> tuple[int, int, int]:
    """`PROBE_LENGTHS`, or a quarter, half and all of a shorter model's positions (ValueError below 4)."""
    from patchc.models.hf import max_positions

    limit = max_positions(getattr(model, "config", None), default=PROBE_LENGTHS[-1])
    if limit >= PROBE_LENGTHS[-1]:
        return PROBE_LENGTHS
    if limit < 4:
        raise ValueError(f"a model of {limit} positions is too short to probe at three lengths")
    return limit // 4, limit // 2, limit


def vocab_size(model: nn.Module) -> int:
    """The vocabulary a causal LM reads: its config's, else its first embedding's rows."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return next(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))


def step_bytes(model: nn.Module, layers: Iterable[str], opts: PruneOptions, ranks: int = 1) -> StepBytes:
    """`StepBytes` of a mask step of `opts.batch_size` x `opts.block_len` tokens (split over `ranks` processes)
    training the masks of plan layers `layers` of the loaded causal LM `model`."""
    params = {}
    for name in layers:
        p = model.get_parameter(targets.resolve(model, name).param)
        params[id(p)] = p
    batch = math.ceil(opts.batch_size / ranks)  # each rank trains on its share of the batch
    activations = batch * per_sequence(model, list(params.values()), opts.block_len)
    masked = 0 if opts.mask_optim().recompute else sum(p.numel() * p.element_size() for p in params.values())
    tokens = batch * opts.block_len
    copies = 2 if opts.loss == "lm" else 3  # the student's logits and their gradient; a teacher's for KD
    return StepBytes(activations, masked, copies * tokens * vocab_size(model) * 4, tokens)


__all__ = ["PROBE_LENGTHS", "StepBytes", "per_sequence", "probe_lengths", "saved_bytes", "step_bytes", "vocab_size"]
