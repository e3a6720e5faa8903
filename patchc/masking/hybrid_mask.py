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
bf16. Noise is drawn from a generator seeded by (seed, layer index, draw counter); the counter is
a buffer, so a restored state_dict continues the same noise stream.

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

import torch
import torch.nn.functional as F
from torch import nn

from patchc.ir.patterns import PATTERNS
from patchc.ir.tiles import expand_tiles, tile_grid, tile_sizes

MODES = ("sample", "hard", "soft", "ones")

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
    ) -> None:
        super().__init__()
        n, k = shape
        if k % 4:
            raise ValueError(f"{name}: in_features={k} is not a multiple of 4, so it has no 2:4 groups")
        self.name, self.shape, self.tile, self.variant = name, (n, k), tuple(tile), variant
        self.index, self.seed, self.hard = index, seed, hard
        self.grid = tile_grid((n, k), self.tile)
        self.mode = "sample"
        # Set by the owning program before each forward from its step counter.
        self.tau_tile, self.tau_nm, self.kappa_tile, self.kappa_nm = 1.0, 1.0, 1.0, 1.0

        tile_logits = torch.zeros(self.grid, dtype=torch.float32)
        nm_logits = torch.zeros(n * k // 4, 6, dtype=torch.float32)
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

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def extra_repr(self) -> str:
        return f"{self.name}, shape={self.shape}, tile={self.tile}, grid={self.grid}, variant={self.variant}"

    # -- logits initialisation -------------------------------------------------------------
    @torch.no_grad()
    def init_logits(self, std: float, gen: torch.Generator) -> None:
        """Paper init: logits ~ N(0, std)."""
        if self.tile_logits is not None:
            self.tile_logits.copy_(torch.randn(self.grid, generator=gen) * std)
        self.nm_logits.copy_(torch.randn(self.nm_logits.shape, generator=gen) * std)

    @torch.no_grad()
    def add_prior(self, nm_prior: torch.Tensor | None, tile_prior: torch.Tensor | None, scale: float) -> None:
        """logits += prior * scale, prior in {-1, 0, 1} per DESIGN.md (scale = std * strength).

        The random init is first clipped to +-0.45 * scale: prior levels are `scale` apart, so the
        prior's choice (its 2:4 pattern, its dense tiles) is exactly what hardening right after init
        gives, and the random part only breaks ties within a level.
        """
        for logits, prior in ((self.nm_logits, nm_prior), (self.tile_logits, tile_prior)):
            if prior is None or logits is None:
                continue
            logits.clamp_(-0.45 * scale, 0.45 * scale).add_(prior.to(logits) * scale)

    # -- mask construction ----------------------------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(noise_seed(self.seed, self.index, self._draw))
        return gen

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._draw = int(self.draws)

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
        return self.nm_logits.detach().argmax(-1)

    def hard_mask(self, tiles: torch.Tensor | None = None) -> torch.Tensor:
        """Bool (N, K) hard mask; `tiles` overrides the dense-tile choice (exact budgets)."""
        tiles = self.hard_tiles() if tiles is None else tiles
        m24 = self.patterns.bool()[self.hard_patterns()].reshape(self.shape)
        return expand_tiles(tiles, self.tile, self.shape) | m24

    def _sample(self) -> torch.Tensor:
        device = self.nm_logits.device
        gen = self._generator(device)
        self._draw += 1
        self.draws += 1
        groups = self.nm_logits.shape[0]
        g = -torch.log(-torch.log(_uniform((groups, 6), gen, device)))
        soft24 = torch.softmax((self.kappa_nm * self.nm_logits + g) / self.tau_nm, dim=-1)
        if self.hard:
            hard24 = F.one_hot(soft24.argmax(-1), 6).to(soft24)
            soft24 = hard24 - soft24.detach() + soft24
        m24 = (soft24 @ self.patterns).reshape(self.shape)
        if self.tile_logits is None:
            return m24
        u = _uniform(self.grid, gen, device)
        z = (self.kappa_tile * self.tile_logits + torch.log(u) - torch.log1p(-u)) / self.tau_tile
        p = torch.sigmoid(z)
        if self.hard:
            p = (z > 0).to(p) - p.detach() + p
        mt = expand_tiles(p, self.tile, self.shape)
        return mt + (1 - mt) * m24

    def _soft(self) -> torch.Tensor:
        m24 = (torch.softmax(self.kappa_nm * self.nm_logits / self.tau_nm, dim=-1) @ self.patterns).reshape(self.shape)
        if self.tile_logits is None:
            return m24
        mt = expand_tiles(torch.sigmoid(self.kappa_tile * self.tile_logits / self.tau_tile), self.tile, self.shape)
        return mt + (1 - mt) * m24

    def mask(self) -> torch.Tensor:
        """The fp32 (N, K) mask of the current mode."""
        if self.mode == "sample":
            return self._sample()
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
        m = self.mask()
        # fp32 product rounded once into W's dtype: M = 1 reproduces W bit for bit.
        masked = weight.detach().float() * m
        if self.mode == "sample":
            self.last_sum = m.sum() if self.track_sum else None
            self.last_sq_norm = masked.square().sum() if self.track_norm else None
        return masked.to(weight.dtype)
