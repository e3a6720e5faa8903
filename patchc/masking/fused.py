"""The fused mask step: W * M of one weight in one autograd node that saves no noise, softmax or mask.

`fused_masked_weight` replaces `HybridMask`'s reference path (noise from a torch.Generator, softmax
over (groups, 6), the pattern matmul, each saved for backward). Here:

    noise      keyed: a window of a per-seed bank of Gumbel noise at an offset hashed from (key, stream),
               key = noise_seed(seed, layer, draw), so backward REGENERATES it instead of keeping it
               (`gumbel`); the same numbers in either implementation (eager or `torch.compile`d)
    forward    Gumbel-softmax of the pattern logits, merged with the tile mask, times W; optionally
               also ||W * M||^2 for the magnitude term
    backward   recomputes the softmax from the logits and the regenerated noise and writes the logit
               gradients directly; the only saved tensors are the weight, the logits and the
               (tiles,) tile mask, all of which exist anyway

Tensors are viewed 5-D as (Tn, b1, Tk, b2/4, 4) so the per-tile mask broadcasts without being
expanded (shapes the tile does not divide use (1, N, 1, K/4, 4) and an expanded tile mask). The 2:4
logits are (..., 6) pattern logits, or (..., 4) per-weight scores whose pairwise sums are the pattern
logits (`PatchConfig.nm_param="weight"`). "frozen" replaces logits and noise by a fixed 0/1 2:4 mask
(the tile-only variant): the step is then W * (keep + (1 - keep) * M_t) and its tile gradient.

Example:
    >>> spec = MaskSpec(hard=False, scores=False, want_sq=False, impl="eager")
    >>> out, _ = fused_masked_weight(w5, logits5, mt5, key, kappa=100.0, tau=1.0, spec=spec)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Pattern p keeps positions PAIRS[p] of its group (the order of `patchc.ir.patterns.PATTERNS`).
PAIRS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
IMPLS = ("eager", "compiled")
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class MaskSpec:
    """What one fused call computes (hashable: it selects a compiled kernel).

    hard: straight-through (forward one-hot patterns, backward the soft gradient);
    scores: the 2:4 logits are 4 per-weight scores per group, not 6 pattern logits;
    want_sq: also return ||W * M||^2; frozen: the 2:4 part is a fixed 0/1 mask (tile-only);
    impl: "eager" torch ops or "compiled" (the same functions through torch.compile).
    """

    hard: bool = False
    scores: bool = False
    want_sq: bool = False
    frozen: bool = False
    impl: str = "eager"

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"MaskSpec.impl={self.impl!r}: choose one of {IMPLS}")


# -- counter-based noise: windows into a per-seed bank of Gumbel noise ------------------------------
BANK_CHUNK = 1 << 20  # bank lengths are whole chunks, with at least one spare chunk of offsets
_BANKS: dict[tuple, torch.Tensor] = {}
_MAX_BANKS = 8
_eager = getattr(torch, "_disable_dynamo", torch.compiler.disable)  # private; the public one if it goes


def split_key(seed63: int) -> tuple[int, int]:
    """Two 32-bit halves of a 63-bit stream seed (`hybrid_mask.noise_seed`)."""
    return seed63 & _M32, (seed63 >> 32) & _M32


def _stream_seed(k0: int, k1: int, offset: int) -> int:
    """splitmix64 of (key, offset): one independent 63-bit number per (seed, layer, draw, stream)."""
    x = ((k1 << 32) | k0) + (offset + 1) * 0x9E3779B97F4A7C15 & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


def bank_length(numel: int) -> int:
    """Bank entries serving windows of `numel`: whole chunks, at least one spare chunk, so a window
    starts at any of >= 2^20 offsets (two draws of an element repeat a value with odds ~1e-6)."""
    return (-(-numel // BANK_CHUNK) + 1) * BANK_CHUNK


def gumbel_bank(seed: int, length: int, device) -> torch.Tensor:
    """fp32 Gumbel(0, 1) noise, `length` values drawn once per (run seed, length, device) and kept.

    Drawn by the CPU generator on every device, then copied: a seed gives the same noise, so the same
    plan up to rounding, on a CPU and a GPU (CUDA's generator draws other numbers; this costs one copy).
    The values lie strictly inside (-3.0, 17.4): U is lifted off 0 and never reaches 1, so both logs
    are finite (an exact 1.0 once made the job's loss NaN within ~15 steps).
    """
    device = torch.device(device)
    slot = (seed, length, device.type, device.index)
    bank = _BANKS.get(slot)
    if bank is None:
        if len(_BANKS) >= _MAX_BANKS:
            _BANKS.pop(next(iter(_BANKS)))
        gen = torch.Generator()
        gen.manual_seed(_stream_seed(seed & _M32, (seed >> 32) & _M32, length))
        u = torch.rand(length, generator=gen, dtype=torch.float32).clamp_(min=2.0**-24)
        bank = _BANKS[slot] = u.log_().neg_().log_().neg_().to(device)
    return bank


def clear_banks() -> None:
    """Drop every cached noise bank (they are rebuilt, identical, on the next draw)."""
    _BANKS.clear()


# Eager under torch.compile too: a Python-int offset in a graph would recompile per draw. torch's own
# lazy form imports torch._dynamo on the first draw, not at `import patchc` (1.2 s of every CLI start).
@_eager
def gumbel(key: torch.Tensor, shape: tuple[int, ...], stream: int, device) -> torch.Tensor:
    """Gumbel(0, 1) noise of `stream` keyed by `key` (3,) int64 = (`split_key` halves, run seed), kept on
    the CPU: a read-only fp32 view into the run's bank at an offset hashed from (key, stream). The same
    key gives the same noise, so backward regenerates what forward drew instead of saving it, and a
    draw costs no generator pass and no logs (a torch.Generator pass over (groups, 6) cost ~17% of a
    CPU step, an integer hash of each element's index ~25 passes).

    Within one draw every element gets its own bank value (iid Gumbel); across draws an element's
    values come from independent offsets. Two tensors of similar size share a bank.

    >>> key = torch.tensor([*split_key(12345), 0])
    >>> torch.equal(gumbel(key, (3, 6), 0, "cpu"), gumbel(key, (3, 6), 0, "cpu"))
    True
    """
    k0, k1, seed = (int(v) for v in key.tolist())
    numel = math.prod(shape)
    bank = gumbel_bank(seed, bank_length(numel), device)
    start = _stream_seed(k0, k1, stream) % (bank.numel() - numel + 1)
    return bank[start:start + numel].view(shape)


def logistic(key: torch.Tensor, shape: tuple[int, ...], stream: int, device) -> torch.Tensor:
    """Logistic(0, 1) noise (log U - log(1 - U) in law): the difference of two independent Gumbels."""
    return gumbel(key, shape, 2 * stream + 1, device) - gumbel(key, shape, 2 * stream + 2, device)


# -- pattern algebra (explicit sums: a (.., 6) @ (6, 4) matmul would break fusion) ----------------
def pair_sums(x4: torch.Tensor) -> torch.Tensor:
    """(..., 4) per-position values -> (..., 6): pattern p gets x[i] + x[j] for its kept (i, j)."""
    return torch.stack([x4[..., i] + x4[..., j] for i, j in PAIRS], -1)


def cover_sums(x6: torch.Tensor) -> torch.Tensor:
    """(..., 6) per-pattern values -> (..., 4): position i gets the sum over the 3 patterns keeping it."""
    return torch.stack([x6[..., a] + x6[..., b] + x6[..., c] for a, b, c in ((0, 1, 2), (0, 3, 4), (1, 3, 5), (2, 4, 5))], -1)


def _softmax6(y: torch.Tensor) -> torch.Tensor:
    # written out: torch.softmax over a last dim of 6 is ~10x slower on CPU than these three passes
    e = (y - y.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def _sample24(logits, key, kappa, tau, spec: MaskSpec):
    """Soft pattern probabilities s (..., 6) and the forward 2:4 mask m24 (..., 4) of this draw."""
    p = pair_sums(logits) if spec.scores else logits
    y = (kappa * p + gumbel(key, p.shape, 0, p.device)) / tau
    s = _softmax6(y)
    chosen = F.one_hot(y.argmax(-1), 6).to(s) if spec.hard else s
    return s, cover_sums(chosen)


def _merge(m24, mt):
    return m24 if mt is None else mt + (1 - mt) * m24


def _sum_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reduce a broadcast result back to `like`'s shape (the tile mask's 5-D view)."""
    dims = [d for d in range(x.dim()) if like.shape[d] == 1 and x.shape[d] != 1]
    return x.sum(dims, keepdim=True) if dims else x


def _compute_dtype(logits, mt, spec: MaskSpec) -> torch.dtype:
    # the logits' dtype (fp32 in training, fp64 in the reference comparison); a frozen keep mask is 0/1
    return mt.dtype if spec.frozen else logits.dtype


def forward_core(w, logits, mt, key, kappa, tau, spec: MaskSpec):
    """(W * M in W's dtype, ||W * M||^2 or None); `logits` is the 0/1 keep mask when spec.frozen."""
    dt = _compute_dtype(logits, mt, spec)
    m24 = logits.to(dt) if spec.frozen else _sample24(logits, key, kappa, tau, spec)[1]
    masked = w.to(dt) * _merge(m24, mt)
    sq = masked.square().sum() if spec.want_sq else None
    return masked.to(w.dtype), sq


def backward_core(grad_out, grad_sq, w, logits, mt, key, kappa, tau, spec: MaskSpec):
    """(d logits or None, d mt or None) from the regenerated sample."""
    wf = w.to(_compute_dtype(logits, mt, spec))
    if spec.frozen:
        s, m24 = None, logits.to(wf.dtype)
    else:
        s, m24 = _sample24(logits, key, kappa, tau, spec)
    d_m = grad_out.to(wf.dtype) * wf
    if grad_sq is not None:  # d ||W M||^2 / dM = 2 W^2 M
        d_m = d_m + (2 * grad_sq) * wf * wf * _merge(m24, mt)
    d_mt = None if mt is None else _sum_like(d_m * (1 - m24), mt)
    if spec.frozen:
        return None, d_mt
    d_s = pair_sums(d_m if mt is None else d_m * (1 - mt))
    d_y = s * (d_s - (s * d_s).sum(-1, keepdim=True))
    d_p = d_y * (kappa / tau)
    return (cover_sums(d_p) if spec.scores else d_p), d_mt


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    fn = {"forward": forward_core, "backward": backward_core}[name]
    return torch.compile(fn, dynamic=True)


def _core(name: str, spec: MaskSpec):
    if spec.impl == "compiled":
        return _compiled(name)
    return forward_core if name == "forward" else backward_core


class _FusedMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, logits, mt, key, kappa, tau, spec):  # noqa: D401 - autograd signature
        out, sq = _core("forward", spec)(w, logits, mt, key, kappa, tau, spec)
        ctx.save_for_backward(w, logits, mt, key, kappa, tau)
        ctx.spec = spec
        return out, (sq if sq is not None else out.new_zeros(()))

    @staticmethod
    def backward(ctx, grad_out, grad_sq):
        w, logits, mt, key, kappa, tau = ctx.saved_tensors
        spec = ctx.spec
        g_sq = grad_sq if spec.want_sq else None
        d_logits, d_mt = _core("backward", spec)(grad_out, g_sq, w, logits, mt, key, kappa, tau, spec)
        d_logits = d_logits if ctx.needs_input_grad[1] else None
        d_mt = d_mt if ctx.needs_input_grad[2] else None
        return None, d_logits, d_mt, None, None, None, None


def fused_masked_weight(w, logits, mt, key, kappa, tau, spec: MaskSpec):
    """(W * M, ||W * M||^2 or None) with gradients to `logits` and `mt` only (W is frozen).

    Args:
        w: (.., 4) 5-D view of the weight; logits: (.., 6) pattern logits, (.., 4) scores, or the
            (.., 4) 0/1 keep mask when spec.frozen; mt: tile mask broadcastable to w, or None (2:4 only).
        key: (3,) int64, `split_key` of the draw's seed and the run seed (see `gumbel`); kappa, tau: 0-d tensors (tensors, so a compiled kernel
            is not rebuilt when the schedules move).
    """
    out, sq = _FusedMask.apply(w.detach(), logits, mt, key, kappa, tau, spec)
    return out, (sq if spec.want_sq else None)


__all__ = ["MaskSpec", "fused_masked_weight", "gumbel", "logistic", "clear_banks", "split_key", "pair_sums", "cover_sums", "forward_core", "backward_core"]
