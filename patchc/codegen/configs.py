"""Kernel configurations and the per-architecture default tables.

Architecture differences (block shapes, warps, pipeline stages, how many programs fill the machine) live
in `ARCH_TABLE`, never as branches inside the kernels. `default_config` turns (packed layer, M, arch)
into a `KernelConfig`; an explicit `KernelConfig` passed to `tile_linear` overrides it field by field.

Example:
    >>> cfg = KernelConfig(kernel="decode", split_k=4)
    >>> resolve_config(cfg, packed, m=1, arch="sm_90")   # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

KERNEL_KINDS = ("auto", "decode", "prefill", "unpacked")
REDUCE_KINDS = ("fixup", "launch")


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one tile_linear call; None fields are filled from the architecture table.

    kernel: "decode" (small M, weights on the dot M side), "prefill" (tiled GEMM), "unpacked" (W * M unpacked
    on the device, then cuBLAS: `unpack_kernel`; only block_n / block_k and num_warps matter) or "auto" (by M).
    block_m: tokens per program (decode: padded to >= 8 for tl.dot; one weight pass serves them all).
    block_n / block_k: must equal the packed block (the layout is cut to it); None = the packed block.
    split_k: programs sharing one block row's K range (fp32 partial sums, deterministic reduction).
    reduce: how split-K's partial sums are added: "fixup" (in the kernel, by each output tile's last split)
    or "launch" (a second kernel); the same bits either way, and nothing to add when split_k is 1.

    Example:
        >>> KernelConfig(kernel="prefill", block_m=64, num_warps=4)
        KernelConfig(kernel='prefill', block_m=64, block_n=None, block_k=None, split_k=None, num_warps=4, num_stages=None, group_m=None, reduce=None)
    """

    kernel: str = "auto"
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    split_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    group_m: int | None = None
    reduce: str | None = None

    def __post_init__(self) -> None:
        if self.kernel not in KERNEL_KINDS:
            raise ValueError(f"KernelConfig.kernel must be one of {KERNEL_KINDS}, got {self.kernel!r}")
        if self.reduce not in (None, *REDUCE_KINDS):
            raise ValueError(f"KernelConfig.reduce must be one of {REDUCE_KINDS} (or None for the table's), "
                             f"got {self.reduce!r}")
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {v}")
        for name in ("split_k", "num_stages", "group_m"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"KernelConfig.{name} must be >= 1, got {v}")


@dataclass(frozen=True)
class ArchDefaults:
    """Defaults for one GPU architecture (values chosen from Triton's tutorials and the decode analysis)."""

    sm_count: int  # SMs of the reference part (A100: 108, H100 SXM: 132)
    block: tuple[int, int]  # preferred pack block (BLOCK_N, BLOCK_K) for generate()
    decode_max_m: int  # M above this goes to the prefill kernel
    decode_buckets: tuple[int, ...]  # upper M of each decode bucket (own tuned config each, one weight pass)
    small_m: int  # M at or below this gets its own decode variants (block_m 1, 2 or 4; tokens padded to 8)
    decode_block_m: int  # token padding for the decode tl.dot (>= 16)
    # warps: at least decode_warps, more for bigger blocks (decode_elems_per_warp); fewer warps issue fewer
    # instructions per weight byte (the per-iteration x / address / loop overhead is per warp)
    decode_warps: int
    decode_warps_m16: int  # the minimum for block_m >= 16 (more tokens per iteration: fewer warps pay off)
    decode_elems_per_warp: int
    decode_stages: int  # 1: no cp.async ring, 2 barriers per iteration; latency is hidden by split-K programs
    decode_waves: float  # aim for this many programs per SM when choosing split_k
    max_split_k: int
    reduce: str  # how split-K's partial sums are added by default (KernelConfig.reduce)
    prefill_block_m: int
    prefill_warps: int
    prefill_stages: int
    group_m: int


ARCH_TABLE: dict[str, ArchDefaults] = {
    "sm_80": ArchDefaults(
        sm_count=108, block=(128, 64), decode_max_m=64, decode_buckets=(1, 4, 8, 16, 64), small_m=4, decode_block_m=16,
        decode_warps=4, decode_warps_m16=2, decode_elems_per_warp=2048, decode_stages=1, decode_waves=4.0,
        max_split_k=16, reduce="fixup",
        # 8 warps: with 4, the 128 x 64 fp32 accumulator plus the in-register 2:4 expansion hit 255 registers
        prefill_block_m=128, prefill_warps=8, prefill_stages=3, group_m=8,
    ),
    # Hopper: more SMs and shared memory; wgmma wants 8 warps (two warp groups) for 128-row tiles. Prefill stays
    # at 128 tokens (128 registers: two programs an SM, one's 2:4 expansion beside the other's products); the
    # tuner also times 256 (half the expansion's instructions per FLOP, but 215 registers: one program an SM).
    "sm_90": ArchDefaults(
        sm_count=132, block=(128, 64), decode_max_m=64, decode_buckets=(1, 4, 8, 16, 64), small_m=4, decode_block_m=16,
        decode_warps=4, decode_warps_m16=4, decode_elems_per_warp=2048, decode_stages=1, decode_waves=4.0,
        max_split_k=16, reduce="fixup", prefill_block_m=128, prefill_warps=8, prefill_stages=3, group_m=8,
    ),
}


# 2:4 groups per element of the kernels' kept-value loads, by Triton (major, minor); read from the SASS of
# LLaMA-2-7B layers under each Triton (`make compat`). Triton 3.6 lays the one-group-per-element
# metadata load out column-major and moves the kept pairs through shared memory (sm_90 decode: 6-10
# barriers per iteration, 0.15-0.20 warp-instructions per weight byte). Two groups per 64-bit element,
# loaded in the mma operand's own layout (`kernels.expand_group_pairs`), cost 2 barriers and 0.10-0.11
# there, with 128-bit loads. From 3.7 on, one group per 32-bit load is best (2 barriers, 0.10-0.13);
# Triton 3.9 orders the two-group load's axes differently (6 barriers on sm_80, 0.14-0.16 on sm_90).
GROUPS_PER_LOAD: dict[tuple[int, int], int] = {(3, 6): 2}
GROUPS_ENV = "PATCHC_GROUPS_PER_LOAD"


def groups_per_load(triton_version: str, override: str | None = None) -> int:
    """`GROUPS_PER_LOAD` for a Triton version string ("3.6.0", "3.9.0+git..."): 1 unless listed.
    `override` ("1" or "2", the kernels pass `$PATCHC_GROUPS_PER_LOAD`) wins: to measure both on a GPU."""
    if override:
        if override.strip() not in ("1", "2"):
            raise ValueError(f"PATCHC_GROUPS_PER_LOAD must be 1 or 2 (2:4 groups per kept-value load), got {override!r}")
        return int(override)
    major, minor = (int("".join(ch for ch in part if ch.isdigit()) or 0) for part in triton_version.split(".")[:2])
    return GROUPS_PER_LOAD.get((major, minor), 1)


def groups_in_use(triton_version: str) -> int:
    """What the kernels compile with under this Triton: `groups_per_load` with `$PATCHC_GROUPS_PER_LOAD`."""
    import os

    return groups_per_load(triton_version, os.environ.get(GROUPS_ENV))


def arch_of(device: Any = None) -> str:
    """Table key for a device: "sm_90" for compute capability >= 9, else "sm_80" (also on CPU)."""
    import torch

    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(torch.device(device))
        return "sm_90" if major >= 9 else "sm_80"
    return "sm_80"


def normalize_target(target: str) -> str:
    """'sm_90' / 'sm90' / '90' / 'sm_90a' -> 'sm_90'; unknown targets raise with the known list."""
    t = str(target).lower().replace("sm_", "").replace("sm", "").rstrip("a")
    key = f"sm_{t}"
    if key not in ARCH_TABLE:
        raise ValueError(f"unknown target {target!r}; known: {sorted(ARCH_TABLE)}")
    return key


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, v))))


def choose_kernel(m: int, arch: str) -> str:
    return "decode" if m <= ARCH_TABLE[arch].decode_max_m else "prefill"


def choose_split_k(row_blocks: int, max_blocks_per_row: int, m_blocks: int, arch: str) -> int:
    """Enough programs for ~decode_waves per SM, but never more splits than blocks in the longest row."""
    d = ARCH_TABLE[arch]
    want = math.ceil(d.decode_waves * d.sm_count / max(1, row_blocks * m_blocks))
    return max(1, min(want, max_blocks_per_row, d.max_split_k))


def resolve_config(config: KernelConfig | None, packed: Any, m: int, arch: str) -> KernelConfig:
    """Fill every None field of `config` from the table for this layer and M (returns a full config).

    Prefill defaults to split_k = 1 (enough output tiles at large M); decode picks split_k by
    `choose_split_k`.
    """
    d = ARCH_TABLE[arch]
    cfg = config or KernelConfig()
    bn, bk = packed.block
    if (cfg.block_n not in (None, bn)) or (cfg.block_k not in (None, bk)):
        raise ValueError(
            f"layer {packed.name!r}: config block ({cfg.block_n}, {cfg.block_k}) differs from the packed block "
            f"{packed.block}; re-pack with pack(plan, fqn, block=({cfg.block_n}, {cfg.block_k}))"
        )
    kernel = cfg.kernel if cfg.kernel != "auto" else choose_kernel(m, arch)
    if kernel == "unpacked":  # one program per block, no tokens, no pipeline: the GEMM is cuBLAS's
        block_m, warps, stages = cfg.block_m or 1, 4, 1
    elif kernel == "decode":
        block_m = cfg.block_m or (_pow2_at_least(m) if m <= d.small_m else d.decode_block_m)
        least = d.decode_warps if block_m < 16 else d.decode_warps_m16
        warps = min(8, max(least, bn * bk // d.decode_elems_per_warp))
        stages = d.decode_stages
    else:
        block_m = cfg.block_m or min(d.prefill_block_m, max(16, _pow2_at_least(m)))
        warps, stages = d.prefill_warps, d.prefill_stages
    if kernel == "prefill" and block_m < 16:
        raise ValueError(f"layer {packed.name!r}: prefill needs block_m >= 16 (tl.dot), got {block_m}")
    if cfg.split_k is None:
        rows = packed.grid[0]
        per_row = int(packed.kinds.shape[1])  # upper bound on blocks per row
        m_blocks = math.ceil(m / block_m)
        split_k = choose_split_k(rows, per_row, m_blocks, arch) if kernel == "decode" else 1
    else:
        split_k = cfg.split_k
    return replace(
        cfg,
        kernel=kernel,
        block_m=block_m,
        block_n=bn,
        block_k=bk,
        split_k=split_k,
        num_warps=cfg.num_warps or warps,
        num_stages=cfg.num_stages or stages,
        group_m=cfg.group_m or d.group_m,
        reduce=cfg.reduce or d.reduce,
    )


@dataclass(frozen=True)
class Variant:
    """One kernel that generate() compiles per layer: used for m_min <= M <= m_max (m_max None = no bound)."""

    name: str
    kernel: str
    block_m: int
    m_min: int
    m_max: int | None
    rep_m: int  # M used to pick split_k at generation time


def variants(arch: str) -> tuple[Variant, ...]:
    """The kernels generated per layer for an architecture (M buckets follow resolve_config's choices)."""
    d = ARCH_TABLE[arch]
    return (
        Variant("decode_m1", "decode", 1, 1, 1, 1),
        Variant(f"decode_m{d.small_m}", "decode", d.small_m, 2, d.small_m, d.small_m),
        Variant("decode", "decode", d.decode_block_m, d.small_m + 1, d.decode_max_m, d.decode_block_m),
        Variant("prefill", "prefill", d.prefill_block_m, d.decode_max_m + 1, None, 2048),
    )


def choose_block(tile: tuple[int, int], arch: str) -> tuple[int, int]:
    """Largest power-of-two block dividing the plan tile, capped at the architecture's preferred block."""
    pref = ARCH_TABLE[arch].block
    out = []
    for side, cap in zip(tile, pref):
        b = int(side) & -int(side)  # largest power of two dividing the side
        out.append(min(b, cap))
    return out[0], out[1]
