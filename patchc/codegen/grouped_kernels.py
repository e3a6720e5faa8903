"""Triton kernels for fused MoE experts: one launch multiplies every expert's rows by its hybrid weight.

The rows of x come sorted by expert, ``offs[e]`` the end of expert e's rows (cumulative; the layout of
``torch._grouped_mm``). The experts' packed weights are stacked into one layer of E * RB block rows
(`patchc.codegen.grouped_layout`): expert e's block row r is CSR row e * RB + r. Each program finds its
expert and token range from ``offs`` on the device, so no launch reads a tensor value back to the host
(CUDA-graph safe), unlike a host loop over the experts.

Token tiles: expert e's rows are cut into ceil(count_e / BLOCK_M) tiles of BLOCK_M rows; tiles are numbered
expert after expert, and `expert_tile` maps a tile number to (expert, first row, end row) with a cumsum over
the E tile counts. The grid allots ceil(M / BLOCK_M) + E tiles, an upper bound on their number for any
routing; programs past the last tile return at once (at decode a few hundred near-empty programs). The
weight loops are `kernels.decode_tile` / `kernels.prefill_tile`, the single-layer kernels' own: the same
instructions per weight byte under Triton 3.6 and 3.9 (3.8's sm_90 decode loops issue up to 31% more, within
the decode targets of `codegen.sass`; `tests/test_grouped_kernels.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from patchc.codegen.kernels import NOT_SPECIALISED, decode_tile, prefill_tile, swizzle


@triton.jit
def expert_tile(offs_ptr, t, M, NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of token tile `t`; expert == NUM_EXPERTS when `t` is past the last tile.
    Offsets past M are read as M, so a bad routing cannot address rows outside x."""
    ie = tl.arange(0, EXPERTS_P2)
    ends = tl.minimum(tl.load(offs_ptr + ie, mask=ie < NUM_EXPERTS, other=0).to(tl.int32), M)
    starts = tl.minimum(tl.load(offs_ptr + ie - 1, mask=(ie > 0) & (ie < NUM_EXPERTS), other=0).to(tl.int32), M)
    counts = tl.maximum(ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # tiles up to and including expert e
    e = tl.sum((last <= t).to(tl.int32), 0)  # the first expert whose tiles reach past t
    here = ie == e
    first_tile = tl.sum(tl.where(here, last - tiles, 0), 0)
    start = tl.sum(tl.where(here, starts, 0), 0)
    end = tl.sum(tl.where(here, ends, 0), 0)
    m0 = start + (t - first_tile) * BLOCK_M
    return e, m0, tl.minimum(end, m0 + BLOCK_M)


@triton.jit(do_not_specialize=NOT_SPECIALISED)
def grouped_decode_kernel(
    x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr,
    dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    offs_ptr, M,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr,
    DENSE_PER_ROW: tl.constexpr, SPARSE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr,
):
    """grid = (ceil(N/BN), SPLIT_K, ceil(M/BM) + E): `decode_tile` on expert e's rows of one token tile."""
    row = tl.program_id(0)
    e, m0, m_end = expert_tile(offs_ptr, tl.program_id(2), M, NUM_EXPERTS, EXPERTS_P2, BLOCK_M)
    if e < NUM_EXPERTS:
        rows_per_expert: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        decode_tile(x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr, dense_ptr, vals_ptr, meta_ptr, dense_rowptr_ptr,
                    dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr, M, row, e * rows_per_expert + row,
                    tl.program_id(1), m0, m_end, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP, HAS_DENSE,
                    HAS_SPARSE, DENSE_PER_ROW, SPARSE_PER_ROW, HAS_BIAS, EVEN_K, DOT_PRECISION)


@triton.jit(do_not_specialize=NOT_SPECIALISED)
def grouped_prefill_kernel(
    x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr,
    dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    offs_ptr, M,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr,
    DENSE_PER_ROW: tl.constexpr, SPARSE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr,
):
    """grid = ((ceil(M/BM) + E) * ceil(N/BN), SPLIT_K), grouped order: `prefill_tile` on one token tile."""
    rows_per_expert: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    t, row = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M) + NUM_EXPERTS, rows_per_expert, GROUP_M)
    e, m0, m_end = expert_tile(offs_ptr, t, M, NUM_EXPERTS, EXPERTS_P2, BLOCK_M)
    if e < NUM_EXPERTS:
        prefill_tile(x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr, dense_ptr, vals_ptr, meta_ptr, dense_rowptr_ptr,
                     dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr, M, row, e * rows_per_expert + row,
                     tl.program_id(1), m0, m_end, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP, HAS_DENSE,
                     HAS_SPARSE, DENSE_PER_ROW, SPARSE_PER_ROW, HAS_BIAS, EVEN_K, DOT_PRECISION)


GROUPED_KERNELS = {"decode": grouped_decode_kernel, "prefill": grouped_prefill_kernel}


def experts_pow2(num_experts: int) -> int:
    """The `EXPERTS_P2` constexpr: the smallest power of two >= num_experts (tl.arange needs one)."""
    return triton.next_power_of_2(max(1, num_experts))
