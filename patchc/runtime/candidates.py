"""The tuner's candidate space: per GPU generation, the kernel configs worth timing, pruned before any timing.

One `CandidateSpace` table per generation (sm_80 / sm_90: blocks, block_m, split-K, warps, stages, the
shared memory limit, the kernels timed at prefill sizes). `candidates(regime, ...)` expands a table for a
layer and drops, with a reason (`prune_reason`), blocks that do not divide the plan tile or exceed the
layer, configs whose estimated shared memory exceeds the device limit, split-K that leaves too little K per
split, and split-K whose fp32 workspace at the tuned M exceeds the launcher's bound (it would launch fewer
splits than timed).
Split-K configs come twice, adding their partial sums in the kernel and in a second launch (`reduce`).
Prefill configs come for both hybrid kernels: the tiled GEMM ("prefill") and the decode kernel, whose weights
sit on the product's M side (on sm_80 its 2:4 loop issues 1.6 warp-instructions per 1,000 FLOPs, under the
A100's budget of 1.95, against the GEMM's 2.2; on sm_90 0.87 against 0.77): which is faster is timed.

Example:
    >>> cands = candidates("decode", (4096, 4096), (128, 128), 16, torch.float16, "sm_90")
    >>> {c.kernel for c in cands}
    {'decode'}
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from patchc.codegen import launch as _launch
from patchc.codegen.configs import ARCH_TABLE, REDUCE_KINDS, KernelConfig

# bump when candidate tables change: old cache entries then miss (6: sm_90 prefill block_m 256; 7: reduce;
# 8: the decode kernel at prefill sizes)
SPACE_VERSION = 8
PREFILL_KERNELS = ("prefill", "decode")  # the hybrid kernels that can serve prefill sizes


@dataclass(frozen=True)
class CandidateSpace:
    """Candidate values for one GPU generation (before pruning).

    Example:
        >>> candidate_space("sm_90").smem_bytes
        232448
    """

    blocks: tuple[tuple[int, int], ...]
    decode_block_m: tuple[int, ...]
    decode_split_k: tuple[int, ...]
    decode_warps: tuple[int, ...]
    decode_stages: tuple[int, ...]
    prefill_block_m: tuple[int, ...]
    prefill_split_k: tuple[int, ...]
    prefill_warps: tuple[int, ...]
    prefill_stages: tuple[int, ...]
    group_m: int
    smem_bytes: int  # opt-in shared memory per block of the generation's reference part
    min_k_per_split: int  # K elements each split must keep (below it the reduction pass dominates)
    min_blocks_per_split: int
    prefill_kernels: tuple[str, ...] = PREFILL_KERNELS  # the kernels timed at prefill sizes, first the default

    def __post_init__(self) -> None:
        if not self.prefill_kernels or not set(self.prefill_kernels) <= set(PREFILL_KERNELS):
            raise ValueError(f"CandidateSpace.prefill_kernels must name some of {PREFILL_KERNELS}, "
                             f"got {self.prefill_kernels}")
        for name in ("decode_block_m", "prefill_block_m", "decode_warps", "prefill_warps"):
            if any(v < 1 or v & (v - 1) for v in getattr(self, name)):
                raise ValueError(f"CandidateSpace.{name} must hold powers of two, got {getattr(self, name)}")
        for bn, bk in self.blocks:
            if min(bn, bk) < 16 or bn & (bn - 1) or bk & (bk - 1):
                raise ValueError(f"CandidateSpace.blocks: ({bn}, {bk}) must be powers of two >= 16")
        if self.smem_bytes <= 0 or self.min_k_per_split < 1 or self.min_blocks_per_split < 1:
            raise ValueError("CandidateSpace: smem_bytes, min_k_per_split, min_blocks_per_split must be positive")


_BLOCKS = ((16, 64), (32, 64), (64, 32), (64, 64), (128, 64), (64, 128), (128, 128))
# Only for tiles under 64 wide (the stories260K demo's 16 x 16): no block above divides them, and tuning such
# a plan failed with "every candidate ... was pruned". Wider tiles skip them (more compiles, never faster).
SMALL_TILE_BLOCKS = ((16, 16), (16, 32), (32, 16), (32, 32))
SPACES: dict[str, CandidateSpace] = {
    # Ampere (A100: 163 KiB opt-in shared memory per block, 108 SMs): mma.sync; 4 warps per 64-row tile.
    "sm_80": CandidateSpace(
        blocks=_BLOCKS, decode_block_m=(16, 32, 64), decode_split_k=(1, 2, 4, 8), decode_warps=(2, 4, 8),
        decode_stages=(1, 2, 4), prefill_block_m=(64, 128), prefill_split_k=(1, 2), prefill_warps=(4, 8),
        prefill_stages=(3, 4), group_m=8, smem_bytes=163 * 1024, min_k_per_split=256, min_blocks_per_split=2,
    ),
    # Hopper (H100/H200: 227 KiB, 132 SMs): more SMs want more split-K at decode; deeper pipelines fit, and
    # 256-token prefill tiles (half the 2:4 expansion's instructions per FLOP, one program an SM: timed).
    "sm_90": CandidateSpace(
        blocks=_BLOCKS, decode_block_m=(16, 32, 64), decode_split_k=(1, 2, 4, 8, 16), decode_warps=(4, 8),
        decode_stages=(1, 3, 4), prefill_block_m=(64, 128, 256), prefill_split_k=(1, 2), prefill_warps=(4, 8),
        prefill_stages=(3, 4), group_m=8, smem_bytes=227 * 1024, min_k_per_split=256, min_blocks_per_split=2,
    ),
}


def candidate_space(arch: str) -> CandidateSpace:
    """The candidate table of a GPU generation ("sm_80" or "sm_90").

    Example:
        >>> candidate_space("sm_80").decode_split_k
        (1, 2, 4, 8)
    """
    if arch not in SPACES:
        raise ValueError(f"no candidate table for {arch!r}; known: {sorted(SPACES)}")
    return SPACES[arch]


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, v))))


def smem_estimate(cfg: KernelConfig, dtype: torch.dtype) -> int:
    """Shared memory bytes of a pipelined config: stages x (x tile + weight tile); 2:4 counted dense.

    Example:
        >>> smem_estimate(KernelConfig("prefill", 128, 128, 64, 1, 8, 4, 8), torch.float16)
        131072
    """
    elem = torch.empty((), dtype=dtype).element_size()
    # decode pads block_m < 8 to 8 tokens (an mma N side)
    x_tile = max(8, cfg.block_m) * cfg.block_k
    return cfg.num_stages * (x_tile + cfg.block_n * cfg.block_k) * elem


def prune_reason(
    cfg: KernelConfig,
    shape: tuple[int, int],
    tile: tuple[int, int],
    dtype: torch.dtype,
    space: CandidateSpace,
    smem_limit: int | None = None,
    m: int | None = None,
) -> str | None:
    """Why `cfg` is dropped before timing, or None if it is kept (`m`: the M it is tuned at, if known).

    Example:
        >>> cfg = KernelConfig("decode", 16, 64, 64, 8, 4, 2, 8)
        >>> prune_reason(cfg, (4096, 256), (64, 64), torch.float16, candidate_space("sm_80"))
        'split_k 8 leaves 32 K per split (< 256)'
    """
    n, k = shape
    bn, bk = cfg.block_n, cfg.block_k
    if tile[0] % bn or tile[1] % bk:
        return f"block {bn}x{bk} does not divide the tile {tile[0]}x{tile[1]}"
    if bn > max(16, _pow2_ceil(n)) or bk > max(16, _pow2_ceil(k)):
        return f"block {bn}x{bk} exceeds the layer {n}x{k}"
    limit = space.smem_bytes if smem_limit is None else smem_limit
    smem = smem_estimate(cfg, dtype)
    if smem > limit:
        return f"shared memory {smem} B exceeds the device limit {limit} B"
    if cfg.split_k > 1:
        if k // cfg.split_k < space.min_k_per_split:
            return f"split_k {cfg.split_k} leaves {k // cfg.split_k} K per split (< {space.min_k_per_split})"
        if math.ceil(k / bk) < cfg.split_k * space.min_blocks_per_split:
            return f"split_k {cfg.split_k} leaves < {space.min_blocks_per_split} blocks per split"
        if m is not None and _launch.workspace_split_k(cfg.split_k, m, n) < cfg.split_k:
            return (f"split_k {cfg.split_k} at M={m} needs a {4 * cfg.split_k * m * n} B workspace "
                    f"(> {_launch.MAX_WORKSPACE_BYTES} B; the launcher would split less)")
    if cfg.kernel == "prefill" and cfg.block_m < 16:
        return "prefill needs block_m >= 16"
    return None


def candidates(
    regime: str,
    shape: tuple[int, int],
    tile: tuple[int, int],
    m: int,
    dtype: torch.dtype,
    arch: str,
    block: tuple[int, int] | None = None,
    smem_limit: int | None = None,
) -> list[KernelConfig]:
    """Pruned candidates of a regime ("decode" / "prefill"); `block` fixes the block shape.

    Example:
        >>> cands = candidates("decode", (4096, 4096), (128, 128), 16, torch.float16, "sm_90")
        >>> {c.kernel for c in cands}
        {'decode'}
    """
    if regime not in ("decode", "prefill"):
        raise ValueError(f"regime must be 'decode' or 'prefill', got {regime!r}")
    space = candidate_space(arch)
    blocks = (block,) if block is not None else space.blocks + (SMALL_TILE_BLOCKS if min(tile) < 64 else ())
    if regime == "decode":
        dot_bms = tuple(b for b in space.decode_block_m if b <= max(16, _pow2_ceil(m)))
        # M <= 4: block_m = M rounded up (tokens padded to 8 inside the kernel) or the smallest block_m of 16
        bms = (_pow2_ceil(m), *dot_bms[:1]) if m <= ARCH_TABLE[arch].small_m else dot_bms
        sks, warps, stages = space.decode_split_k, space.decode_warps, space.decode_stages
        kernels: tuple[str, ...] = ("decode",)
    else:
        bms = tuple(b for b in space.prefill_block_m if b <= max(16, _pow2_ceil(m))) or (16,)
        sks, warps, stages = space.prefill_split_k, space.prefill_warps, space.prefill_stages
        kernels = space.prefill_kernels
    out = []
    for kernel, (bn, bk), bm, sk, nw, ns in itertools.product(kernels, blocks, bms, sks, warps, stages):
        for red in REDUCE_KINDS if sk > 1 else (ARCH_TABLE[arch].reduce,):
            cfg = KernelConfig(kernel, bm, bn, bk, sk, nw, ns, space.group_m, red)
            if prune_reason(cfg, shape, tile, dtype, space, smem_limit, m) is None:
                out.append(cfg)
    return out
