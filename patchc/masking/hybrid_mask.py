"""The differentiable hybrid mask of one weight: tile logits + 2:4 logits -> M.

One `HybridMask` sits in the graph between a frozen weight W (N, K) and its matmul and returns
W * M in W's dtype. M is built inside the layer's forward and dropped after it, so only one
full-size mask per layer lives at a time (plus what autograd saves).

    tile logits P_t (Tn, Tk)          2:4 logits P24 (N*K/4, 6)
           |                                   |
    sigmoid((k_t P_t + L) / tau_t)    softmax((k_nm P24 + g) / tau_nm) @ S   S: the 6 patterns (6, 4)
           |  broadcast to tiles,             |  reshape to (N, K)
           |  crop the padded edge            |
           +------> M = M_t + (1 - M_t) * M24 <+

L is Logistic(0, 1) noise and g Gumbel(0, 1) noise (the two-class Gumbel-softmax of [P_t, 0]
is exactly the sigmoid form). All logits, noise and the mask are fp32: updates of ~1e-4 vanish in
bf16. Noise is keyed by (seed, layer index, draw counter, element); the counter is a buffer, so a
restored state_dict continues the same noise stream.

impl: "fused" (default): W * M in one autograd node that saves no noise, softmax or mask; noise is
a window of a per-seed Gumbel bank, regenerated in backward. On the CPU (fp32 / bf16 weights) it runs
as one compiled C loop per direction (`patchc.masking.native`), elsewhere as torch ops
(`patchc.masking.fused`); the tile-only variant uses the argmax 2:4 pattern of its frozen logits,
computed once. "compiled": the torch ops through torch.compile (for GPUs; a compile of about a
minute). "reference": the original autograd graph, noise from a torch.Generator
(`_sample_reference` also takes injected noise, for tests).
nm_param: "pattern" (6 logits per group of 4) or "weight" (4 scores per group, one per weight: the
pattern logits are the pairwise sums s_i + s_j, hardening keeps the top-2 scores). `nm_logits`
holds either, (N*K/4, 6) or (N*K/4, 4); `pattern_logits()` is always (N*K/4, 6).

Modes: "sample" (training), "hard" (eval default: tile dense iff P_t > 0, 2:4 pattern = argmax
P24; exactly what `patchc.harden` produces), "soft" (noise-free softmax at the current tau and
kappa), "ones" (M = 1: the program computes the original model).

Example:
    >>> m = HybridMask("fc.weight", (8, 16), tile=(4, 8), variant="joint")
    >>> w = torch.randn(8, 16)
    >>> m.mode = "hard"; (m(w) != 0).float().mean() >= 0.5
    tensor(True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from patchc.ir.patterns import PATTERNS
from patchc.ir.tiles import expand_tiles, tile_grid, tile_sizes
from patchc.masking import native, recompute
from patchc.masking.fused import MaskSpec, cover_sums, fused_masked_weight, gumbel, logistic, pair_sums, split_key

MODES = ("sample", "hard", "soft", "ones")
IMPLS = ("fused", "compiled", "reference")
NM_PARAMS = ("pattern", "weight")

_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def noise_seed(seed: int, index: int, draw: int) -> int:
    """A well-mixed 63-bit seed per (run seed, layer, draw) so streams never overlap."""
    x = (seed * _MIX[0] + (index + 1) * _MIX[1] + (draw + 1) * _MIX[2]) & (2**64 - 1)
    x ^= x >> 31
    x = (x * _MIX[1]) & (2**64 - 1)
    x ^= x >> 29
    return x & (2**63 - 1)


def _uniform(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    eps = torch.finfo(torch.float32).tiny
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32).clamp_(eps, 1.0 - 1e-7)


def fp32_kept(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fn` (of `nn.Module._apply`) that only moves fp32 tensors where it would cast them to 16 bits:
    `prog.half()` / `.to(torch.bfloat16)` cast the weights, while the mask logits (Adam's small steps), tile
    counts past 256 and the regularizer's weight norms stay fp32. Any other `fn` meets them as it is
    (`.cuda()`, `share_memory_`, `.double()` for an fp64 reference)."""
    def kept(t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.float32:
            return fn(t)
        probe = fn(t.new_empty(0))
        return t.to(probe.device) if probe.dtype in (torch.float16, torch.bfloat16) else fn(t)

    return kept


class HybridMask(nn.Module):
    """Learnable dense-or-2:4 tile mask of one (N, K) weight. See the module docstring."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, int],
        tile: tuple[int, int],
        variant: str = "joint",
        index: int = 0,
        seed: int = 0,
        hard: bool = False,
        nm_param: str = "pattern",
        impl: str = "fused",
    ) -> None:
        super().__init__()
        n, k = shape
        if k % 4:
            raise ValueError(f"{name}: in_features={k} is not a multiple of 4, so it has no 2:4 groups")
        if nm_param not in NM_PARAMS:
            raise ValueError(f"{name}: nm_param={nm_param!r}: choose one of {NM_PARAMS}")
        self.name, self.shape, self.tile, self.variant = name, (n, k), tuple(tile), variant
        self.index, self.seed, self.hard, self.nm_param = index, seed, hard, nm_param
        self.impl = impl
        self.regather = None  # FSDP2 (`shard_program`): gathers this mask's block again for a redraw in backward
        self.grid = tile_grid((n, k), self.tile)
        self.mode = "sample"
        # Set by the owning program before each forward from its step counter.
        self.tau_tile, self.tau_nm, self.kappa_tile, self.kappa_nm = 1.0, 1.0, 1.0, 1.0

        tile_logits = torch.zeros(self.grid, dtype=torch.float32)
        nm_logits = torch.zeros(n * k // 4, 6 if nm_param == "pattern" else 4, dtype=torch.float32)
        self.tile_logits = nn.Parameter(tile_logits) if variant != "nm" else None
        if variant == "tile":
            self.register_buffer("nm_logits", nm_logits)
        else:
            self.nm_logits = nn.Parameter(nm_logits)
        self.register_buffer("draws", torch.zeros((), dtype=torch.int64))
        self._draw = 0  # host copy of `draws`: reading the buffer would sync a GPU every step
        # What the regulariser needs from each training forward (the program turns off what it won't use).
        self.track_sum, self.track_norm = True, True
        # Elements per tile: edge tiles of a padded grid are partial and must weigh less.
        self.register_buffer("tile_numel", tile_sizes((n, k), self.tile).float(), persistent=False)
        self.register_buffer("patterns", PATTERNS.float(), persistent=False)
        self.last_sum: torch.Tensor | None = None  # sum(M) of the last forward, for "sampled" density
        self.last_sq_norm: torch.Tensor | None = None  # ||M * W||^2 of the last forward
        self._keep_cache: tuple[tuple, torch.Tensor] | None = None  # tile-only: frozen 2:4 keep mask

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in IMPLS:
            raise ValueError(f"{self.name}: impl={value!r}: choose one of {IMPLS}")
        self._impl = value

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def extra_repr(self) -> str:
        return f"{self.name}, shape={self.shape}, tile={self.tile}, grid={self.grid}, variant={self.variant}"

    # -- logits initialisation -------------------------------------------------------------
    @torch.no_grad()
    def init_logits(self, std: float, gen: torch.Generator) -> None:
        """Paper init: logits ~ N(0, std); per-weight scores N(0, std / sqrt(2)), so their pairwise
        sums (the pattern logits) have the paper's spread."""
        if self.tile_logits is not None:
            self.tile_logits.copy_(torch.randn(self.grid, generator=gen) * std)
        nm_std = std if self.nm_param == "pattern" else std / 2**0.5
        self.nm_logits.copy_(torch.randn(self.nm_logits.shape, generator=gen) * nm_std)

    @torch.no_grad()
    def add_prior(self, nm_prior: torch.Tensor | None, tile_prior: torch.Tensor | None, scale: float) -> None:
        """logits += prior * scale, prior in {-1, 0, 1} per DESIGN.md (scale = std * strength).

        The random init is first clipped to +-0.45 * scale: prior levels are `scale` apart, so the
        prior's choice (its 2:4 pattern, its dense tiles) is exactly what hardening right after init
        gives, and the random part only breaks ties within a level.

        Per-weight scores take the least-squares scores whose pairwise sums are the pattern prior
        (+-0.5 per position for a one-shot pattern, exact), the random part clipped to +-0.2 * scale
        so a pattern logit's random part stays within +-0.4 * scale.
        """
        if nm_prior is not None and self.nm_param == "weight":
            cover = cover_sums(nm_prior.to(self.nm_logits))  # (S^T S)^-1 S^T p with S^T S = 2I + J
            self.nm_logits.clamp_(-0.2 * scale, 0.2 * scale).add_(0.5 * (cover - cover.sum(-1, keepdim=True) / 6) * scale)
            nm_prior = None
        for logits, prior in ((self.nm_logits, nm_prior), (self.tile_logits, tile_prior)):
            if prior is None or logits is None:
                continue
            logits.clamp_(-0.45 * scale, 0.45 * scale).add_(prior.to(logits) * scale)

    # -- mask construction ----------------------------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(noise_seed(self.seed, self.index, self._draw))
        return gen

    def _apply(self, fn, recurse=True):
        return super()._apply(fp32_kept(fn), recurse)  # `prog.half()` casts the weights, never the logits

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._draw = int(self.draws)
        self._keep_cache = None

    def pattern_logits(self) -> torch.Tensor:
        """(N*K/4, 6) logits of the 6 candidates (derived as pairwise sums for per-weight scores)."""
        return self.nm_logits if self.nm_param == "pattern" else pair_sums(self.nm_logits)

    def tile_probability(self) -> torch.Tensor:
        """P(tile dense) of the hard sample, sigmoid(kappa * P_t) (Tn, Tk); zeros for "nm"."""
        if self.tile_logits is None:
            return torch.zeros(self.grid, device=self.nm_logits.device)
        return torch.sigmoid(self.kappa_tile * self.tile_logits)

    def expected_kept(self) -> torch.Tensor:
        """E[sum(M)] under the hard sample: a 2:4 group keeps 2 of 4, a dense tile all."""
        p = self.tile_probability()
        return (self.tile_numel * (0.5 + 0.5 * p)).sum()

    def hard_tiles(self) -> torch.Tensor:
        """Bool (Tn, Tk): tile dense iff its logit > 0 (the paper's hardening rule)."""
        if self.tile_logits is None:
            return torch.zeros(self.grid, dtype=torch.bool, device=self.nm_logits.device)
        return self.tile_logits.detach() > 0

    def hard_patterns(self) -> torch.Tensor:
        """Long (N*K/4,): the argmax 2:4 candidate of each group."""
        return self.pattern_logits().detach().argmax(-1)

    def hard_mask(self, tiles: torch.Tensor | None = None) -> torch.Tensor:
        """Bool (N, K) hard mask; `tiles` overrides the dense-tile choice (exact budgets)."""
        tiles = self.hard_tiles() if tiles is None else tiles
        m24 = self.patterns.bool()[self.hard_patterns()].reshape(self.shape)
        return expand_tiles(tiles, self.tile, self.shape) | m24

    def _advance(self) -> int:
        draw, self._draw = self._draw, self._draw + 1
        self.draws += 1
        return draw

    def _sample_reference(self, noise: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        return sample_reference(self, noise)

    def _soft(self) -> torch.Tensor:
        m24 = (torch.softmax(self.kappa_nm * self.pattern_logits() / self.tau_nm, dim=-1) @ self.patterns).reshape(self.shape)
        if self.tile_logits is None:
            return m24
        mt = expand_tiles(torch.sigmoid(self.kappa_tile * self.tile_logits / self.tau_tile), self.tile, self.shape)
        return mt + (1 - mt) * m24

    def frozen_keep(self) -> torch.Tensor:
        """Tile-only: bool (N, K) argmax 2:4 pattern of the frozen logits, computed once and
        recomputed when they change (in place, or through load_state_dict)."""
        stamp = (self.nm_logits._version, self.nm_logits.data_ptr(), self.nm_logits.device)
        if self._keep_cache is None or self._keep_cache[0] != stamp:
            keep = self.patterns.bool()[self.hard_patterns()].reshape(self.shape)
            self._keep_cache = (stamp, keep)
        return self._keep_cache[1]

    def mask(self) -> torch.Tensor:
        """The fp32 (N, K) mask of the current mode."""
        if self.mode == "sample":
            if self.impl == "reference":
                return self._sample_reference()
            ones = torch.ones(self.shape, device=self.nm_logits.device, dtype=self.nm_logits.dtype)
            return sample_fused(self, ones, False)[0]
        if self.mode == "soft":
            return self._soft()
        if self.mode == "hard":
            return self.hard_mask().float()
        if self.mode == "ones":
            return torch.ones(self.shape, device=self.nm_logits.device)
        raise ValueError(f"{self.name}: unknown mask mode {self.mode!r}; choose one of {MODES}")

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"{self.name}: mask built for {self.shape}, got a weight of shape {tuple(weight.shape)}")
        if self.mode == "sample" and self.impl != "reference":
            out, self.last_sq_norm, total = sample_fused(self, weight, self.track_norm)
            self.last_sum = total if self.track_sum else None
            return out
        if self.mode == "ones":  # W itself, copied: FSDP2 frees the gathered weight after its block's forward
            return weight.detach().clone()
        m = self.mask()
        # fp32 product rounded once into W's dtype: M = 1 reproduces W bit for bit.
        masked = weight.detach().float() * m
        if self.mode == "sample":
            self.last_sum = m.sum() if self.track_sum else None
            self.last_sq_norm = masked.square().sum() if self.track_norm else None
        return masked.to(weight.dtype)


def _views(m: HybridMask, weight: torch.Tensor, mt: torch.Tensor | None) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """5-D shape (Tn, b1, Tk, b2/4, 4) of the weight and the tile mask viewed to broadcast over it;
    (1, N, 1, K/4, 4) and an expanded tile mask where the tile does not divide the shape."""
    (n, k), (b1, b2), (tn, tk) = m.shape, m.tile, m.grid
    if n % b1 == 0 and k % b2 == 0:
        return (tn, b1, tk, b2 // 4, 4), (None if mt is None else mt.view(tn, 1, tk, 1, 1))
    return (1, n, 1, k // 4, 4), (None if mt is None else expand_tiles(mt, m.tile, m.shape).reshape(1, n, 1, k // 4, 4))


def draw_key(m: HybridMask, draw: int) -> torch.Tensor:
    """(3,) int64 key of `fused.gumbel` for draw `draw` of `m`, on the CPU (read back without a sync)."""
    return torch.tensor([*split_key(noise_seed(m.seed, m.index, draw)), m.seed])


def sample_fused(m: HybridMask, weight: torch.Tensor, want_sq: bool):
    """One training draw of `m` through `patchc.masking.fused`: (W * M, ||W * M||^2 or None, sum(M)).

    sum(M) is exact from the tile probabilities alone: every 2:4 group, soft or hard, sums to 2.
    """
    logits = m.nm_logits
    device, dt = logits.device, logits.dtype
    key = draw_key(m, m._advance())
    p = None
    if m.tile_logits is not None:
        z = (m.kappa_tile * m.tile_logits + logistic(key, m.grid, 0, device)) / m.tau_tile
        p = torch.sigmoid(z)
        if m.hard:
            p = (z > 0).to(p) - p.detach() + p
    frozen = m.variant == "tile"
    nm = m.frozen_keep() if frozen else logits
    total = torch.full((), m.numel / 2, dtype=dt, device=device) if p is None else (m.tile_numel * (0.5 + 0.5 * p)).sum()
    if m.impl == "fused" and native.supports(weight, nm):
        g = None if frozen else gumbel(key, (logits.shape[0], 6), 0, device)

        def draw(mt):
            return native.native_masked_weight(weight, nm, mt, g, m.tile, m.kappa_nm, m.tau_nm, m.hard, frozen)
    else:
        shape5, _ = _views(m, weight, None)
        spec = MaskSpec(hard=m.hard, scores=m.nm_param == "weight", want_sq=want_sq, frozen=frozen,
                        impl="compiled" if m.impl == "compiled" else "eager")
        kappa, tau = (torch.tensor(v, dtype=dt, device=device) for v in (m.kappa_nm, m.tau_nm))

        def draw(mt):
            out, sq = fused_masked_weight(weight.reshape(shape5), nm.reshape(*shape5[:-1], nm.shape[-1] if not frozen else 4),
                                          _views(m, weight, mt)[1], key, kappa, tau, spec)
            return out.view(m.shape), sq
    out, sq = draw(p)
    if recompute.active():
        recompute.register(out, functools.partial(_redraw, m.name, draw, None if p is None else p.detach(), nm, nm._version,
                                                  weight, m.regather))
    return out, (sq if want_sq else None), total


def _redraw(name: str, draw, p: torch.Tensor | None, nm: torch.Tensor, version: int, weight: torch.Tensor,
            regather=None) -> torch.Tensor:
    """The same draw again, for backward (`patchc.masking.recompute`). Under FSDP2 the matmul's backward runs
    before its block's own pre-backward gather (the block's outputs are the W * M it consumes), so a freed weight
    is gathered here (`regather`, into the same storage: FSDP2 keeps the tensors and their version counters);
    every rank unpacks in the same order, so every rank enters the same collective."""
    if regather is not None and weight.untyped_storage().nbytes() == 0:
        regather()
    if weight.untyped_storage().nbytes() < weight.numel() * weight.element_size():
        raise RuntimeError(f"{name}: its weight was freed after forward (FSDP reshards it), so W * M cannot be "
                           "recomputed in backward; train without recompute (MaskOptimConfig(recompute=False))")
    if nm._version != version:
        raise RuntimeError(f"{name}: its 2:4 logits changed between forward and backward, so W * M cannot be "
                           "recomputed; step the optimizer after backward, or train without recompute")
    with torch.no_grad():
        return draw(p)[0]


def sample_reference(m: HybridMask, noise: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """The original autograd graph of a training draw of `m`; `noise` = (Gumbel noise of the (groups, 6) logits,
    logistic noise of the tiles) replaces the generator's draws (the counter still advances)."""
    device = m.nm_logits.device
    gen = m._generator(device)
    m._advance()
    groups = m.nm_logits.shape[0]
    g = -torch.log(-torch.log(_uniform((groups, 6), gen, device))) if noise is None else noise[0]
    soft24 = torch.softmax((m.kappa_nm * m.pattern_logits() + g) / m.tau_nm, dim=-1)
    if m.hard:
        hard24 = F.one_hot(soft24.argmax(-1), 6).to(soft24)
        soft24 = hard24 - soft24.detach() + soft24
    m24 = (soft24 @ m.patterns).reshape(m.shape)
    if m.tile_logits is None:
        return m24
    if noise is None:
        u = _uniform(m.grid, gen, device)
        noise = (None, torch.log(u) - torch.log1p(-u))
    z = (m.kappa_tile * m.tile_logits + noise[1]) / m.tau_tile
    p = torch.sigmoid(z)
    if m.hard:
        p = (z > 0).to(p) - p.detach() + p
    mt = expand_tiles(p, m.tile, m.shape)
    return mt + (1 - mt) * m24
