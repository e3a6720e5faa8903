"""Triton kernels for hybrid dense / 2:4 linear layers (layout: see `patchc.codegen.layout`).

Layering as in Triton's tutorials: these `@triton.jit` kernels are called only by the plain launchers in
`patchc.codegen.launch` (check, allocate, grid, launch). Two kernels:

* `decode_kernel` (small M, bound by weight bytes): the weight block is the `tl.dot` M side,
  acc[BN, BM] += W[BN, BK] @ x^T[BK, BM] with the tokens padded to BLOCK_M >= 16; for M <= 4
  (USE_DOT=False) the dense blocks still go through `tl.dot` (16 padded tokens, unpipelined: 2 barriers per
  iteration), but the 2:4 blocks are never expanded: `decode_gemv` multiplies each kept value with the x it
  gathers, every thread owning whole 16-byte chunks, and reduces over K once after the loop.
  Split-K over grid axis 1: split s of a block row takes the s-th equal share of the row's dense blocks and
  the s-th equal share of its 2:4 blocks, so every split reads the same bytes (balanced by bytes).
* `prefill_kernel` (large M, compute bound): a tiled GEMM acc[BM, BN] += x[BM, BK] @ W^T[BK, BN] with
  grouped ("super-grouping") program order for L2 reuse of x, same two loops and optional split-K.

In both, a block row's dense blocks and 2:4 blocks are walked by two separate loops (no per-iteration
branch on the block kind). A 2:4 block is loaded compressed (values (BN, BK/2) + metadata (BN, BK/8) bytes,
each one contiguous 16-byte-aligned run); `tl.dot` paths expand it to (BN, BK) in registers by `expand_24`.
Accumulation is fp32. With SPLIT_K > 1 each split writes fp32 partial sums to a (SPLIT_K, M, N) workspace
and `splitk_reduce_kernel` adds them in split order: the result is deterministic (bitwise reproducible run
to run), unlike fp32 atomics whose summation order depends on scheduling; the cost is one extra small pass
over M*N*SPLIT_K fp32, negligible at decode sizes.

Per-layer specialisation: N, K, the block sizes, the per-row block counts when uniform (DENSE_PER_ROW /
SPARSE_PER_ROW, -1 when they vary), HAS_DENSE / HAS_SPARSE (an all-2:4 layer has no dense loop), HAS_BIAS,
SPLIT_K and EVEN_K are `tl.constexpr`. x and y are contiguous, so their strides are K and N.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter multiplies bf16 tl.dot operands as their raw uint16 bits (it converts only fp8), so
# there `mma` widens them to fp32 first; compiled kernels never see this branch. Tests reload this module
# when they switch the interpreter on or off, so the flag follows the environment.
INTERPRETED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a @ b on the tensor cores (`tl.dot`), exact under the interpreter for bf16 too."""
    if INTERPRETED:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def expand_24(vals, meta, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BN, BK/2) kept values + (BN, BK/8) metadata bytes -> dense (BN, BK) in registers."""
    v0, v1 = tl.split(tl.reshape(vals, (BLOCK_N, BLOCK_K // 4, 2)))  # kept values, lower position first
    m = meta.to(tl.int32)
    # byte b holds group 2b (low nibble) and 2b+1 (high nibble): join keeps that order on the new last axis
    nib = tl.reshape(tl.join(m & 15, m >> 4), (BLOCK_N, BLOCK_K // 4))
    i0 = (nib & 3)[:, :, None]
    i1 = (nib >> 2)[:, :, None]
    pos = tl.arange(0, 4)[None, None, :]
    zero = tl.zeros((BLOCK_N, BLOCK_K // 4, 4), dtype=vals.dtype)
    dense = tl.where(pos == i0, v0[:, :, None], tl.where(pos == i1, v1[:, :, None], zero))
    return tl.reshape(dense, (BLOCK_N, BLOCK_K))


@triton.jit
def load_sparse_block(vals_ptr, meta_ptr, t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Load 2:4 block number `t` compressed and expand it: (BN, BK)."""
    rn = tl.arange(0, BLOCK_N)
    rv = tl.arange(0, BLOCK_K // 2)
    rm = tl.arange(0, BLOCK_K // 8)
    t64 = tl.cast(t, tl.int64)
    vals = tl.load(vals_ptr + t64 * (BLOCK_N * BLOCK_K // 2) + rn[:, None] * (BLOCK_K // 2) + rv[None, :])
    meta = tl.load(meta_ptr + t64 * (BLOCK_N * BLOCK_K // 8) + rn[:, None] * (BLOCK_K // 8) + rm[None, :])
    return expand_24(vals, meta, BLOCK_N, BLOCK_K)


@triton.jit
def load_dense_block(dense_ptr, t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Load dense block number `t`: (BN, BK)."""
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    return tl.load(dense_ptr + tl.cast(t, tl.int64) * (BLOCK_N * BLOCK_K) + rn[:, None] * BLOCK_K + rk[None, :])


@triton.jit
def row_share(rowptr_ptr, row, split, PER_ROW: tl.constexpr, SPLIT_K: tl.constexpr):
    """[lo, hi) of the CSR entries of block row `row` that split `split` handles (equal shares)."""
    if PER_ROW >= 0:  # uniform rows: no rowptr load, constexpr trip counts when SPLIT_K == 1
        start = row * PER_ROW
        count = PER_ROW
    else:
        start = tl.load(rowptr_ptr + row)
        count = tl.load(rowptr_ptr + row + 1) - start
    if SPLIT_K == 1:
        return start, start + count
    else:
        return start + (count * split) // SPLIT_K, start + (count * (split + 1)) // SPLIT_K


@triton.jit
def load_xt(x_ptr, offs_m, offs_k, M, K: tl.constexpr, EVEN_K: tl.constexpr):
    """x^T block (BK, BM) of the contiguous (M, K) input, zero outside."""
    ptrs = x_ptr + offs_m[None, :].to(tl.int64) * K + offs_k[:, None]
    if EVEN_K:
        mask = offs_m[None, :] < M
    else:
        mask = (offs_m[None, :] < M) & (offs_k[:, None] < K)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def load_x(x_ptr, offs_m, offs_k, M, K: tl.constexpr, EVEN_K: tl.constexpr):
    """x block (BM, BK) of the contiguous (M, K) input, zero outside."""
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    if EVEN_K:
        mask = offs_m[:, None] < M
    else:
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def decode_mac(acc, w, x_ptr, m0, col, M, K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc[BN, BM] += w[BN, BK] @ x[m0 : m0+BM, col*BK : col*BK+BK]^T (tl.dot, tokens padded to BM >= 16)."""
    offs_k = col * BLOCK_K + tl.arange(0, BLOCK_K)
    xt = load_xt(x_ptr, m0 + tl.arange(0, BLOCK_M), offs_k, M, K, EVEN_K)
    return mma(w, xt, acc, DOT_PRECISION)


@triton.jit
def to_f32(x):
    """fp32 of loaded values; bf16 by moving its bits up (one instruction per value, where cvt takes two for
    the high half of a register)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def gemv_sparse(acc, v, xrow, col, gbase, pos, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc (BN, CS, VEC) += each kept value times the x it gathers (column gbase + pos) for one token."""
    xb = xrow + col * BLOCK_K
    # (xb + gbase) + pos, not xb + (gbase + pos): the per-thread constant part folds into the load's offset
    if EVEN_K:
        x = to_f32(tl.load((xb + gbase) + pos))
    else:
        x = to_f32(tl.load((xb + gbase) + pos, mask=col * BLOCK_K + gbase + pos < K, other=0.0))
    return acc + v * x


@triton.jit
def decode_gemv(x_ptr, vals_ptr, meta_ptr, sparse_rowptr_ptr, sparse_cols_ptr, row, split, m0, M, K: tl.constexpr,
                BLOCK_M: tl.constexpr, TOK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, SPARSE_PER_ROW: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr):
    """(TOK, BN) partial sums of a block row's 2:4 blocks for BLOCK_M <= 4 tokens, without expanding a block.

    Each thread owns whole 16-byte chunks (VEC values) of a few rows, so the K reduction stays in-thread
    until after the loop: no shuffles, one small metadata layout change per iteration. A 2:4 value multiplies
    the x it gathers: value r of a chunk belongs to group r // 2, and its position in the group is bits
    2r, 2r + 1 of the chunk's 2*VEC-bit metadata word (the nibble i0 | i1 << 2 of consecutive groups, as
    packed). One fp32 accumulator per value and token, so the inner loop is gathers and FMAs only. Rows
    TOK > BLOCK_M of the result repeat the last token (the caller never stores them).
    """
    rn = tl.arange(0, BLOCK_N)
    rv = tl.arange(0, VEC)
    # token rows past M re-read row M - 1 (always valid) and are never stored
    x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * K
    x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * K
    x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * K
    x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * K
    CS: tl.constexpr = BLOCK_K // 2 // VEC  # chunks of VEC kept values (VEC // 2 groups) per row
    rc = tl.arange(0, CS)
    voffs = rn[:, None, None] * (BLOCK_K // 2) + rc[None, :, None] * VEC + rv[None, None, :]
    moffs = rn[:, None] * CS + rc[None, :]  # one metadata word per chunk
    gbase = (rc[:, None] * (2 * VEC) + (rv[None, :] // 2) * 4)[None, :, :]  # first column of value r's group
    shift = (2 * rv)[None, None, :]
    # signed words: sign extension leaves bits 0..15 as they are and costs no masking instruction
    if VEC == 8:
        mptr = meta_ptr.to(tl.pointer_type(tl.int16))
    else:
        mptr = meta_ptr.to(tl.pointer_type(tl.int8))
    b0 = tl.zeros((BLOCK_N, CS, VEC), dtype=tl.float32)
    b1 = tl.zeros((BLOCK_N, CS, VEC), dtype=tl.float32)
    b2 = tl.zeros((BLOCK_N, CS, VEC), dtype=tl.float32)
    b3 = tl.zeros((BLOCK_N, CS, VEC), dtype=tl.float32)
    lo, hi = row_share(sparse_rowptr_ptr, row, split, SPARSE_PER_ROW, SPLIT_K)
    for i in range(lo, hi):
        col = tl.load(sparse_cols_ptr + i)
        t64 = tl.cast(i, tl.int64)
        v = to_f32(tl.load(vals_ptr + t64 * (BLOCK_N * BLOCK_K // 2) + voffs))
        meta = tl.load(mptr + t64 * (BLOCK_N * CS) + moffs).to(tl.int32)
        pos = (meta[:, :, None] >> shift) & 3  # (BN, CS, VEC) position of each kept value in its group
        b0 = gemv_sparse(b0, v, x0, col, gbase, pos, K, BLOCK_K, EVEN_K)
        if BLOCK_M > 1:
            b1 = gemv_sparse(b1, v, x1, col, gbase, pos, K, BLOCK_K, EVEN_K)
        if BLOCK_M > 2:
            b2 = gemv_sparse(b2, v, x2, col, gbase, pos, K, BLOCK_K, EVEN_K)
            b3 = gemv_sparse(b3, v, x3, col, gbase, pos, K, BLOCK_K, EVEN_K)
    s0 = tl.sum(tl.sum(b0, axis=2), axis=1)  # the cross-thread reduction, once, after the loop
    s1 = tl.sum(tl.sum(b1, axis=2), axis=1)
    s2 = tl.sum(tl.sum(b2, axis=2), axis=1)
    s3 = tl.sum(tl.sum(b3, axis=2), axis=1)
    tok = tl.arange(0, TOK)[:, None]
    return tl.where(tok == 0, s0[None, :], tl.where(tok == 1, s1[None, :], tl.where(tok == 2, s2[None, :], s3[None, :])))


@triton.jit
def decode_dot(acc, x_ptr, dense_ptr, dense_rowptr_ptr, dense_cols_ptr, row, split, m0, M, K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
               PER_ROW: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc[BN, BM] += the block row's dense blocks @ x^T (tensor cores; tokens from M on read as zeros)."""
    lo, hi = row_share(dense_rowptr_ptr, row, split, PER_ROW, SPLIT_K)
    for i in range(lo, hi):
        col = tl.load(dense_cols_ptr + i)
        w = load_dense_block(dense_ptr, i, BLOCK_N, BLOCK_K)
        acc = decode_mac(acc, w, x_ptr, m0, col, M, K, BLOCK_M, BLOCK_K, EVEN_K, DOT_PRECISION)
    return acc


@triton.jit
def store_out(acc, offs_m, offs_n, keep_m, y_ptr, part_ptr, bias_ptr, split, M, N: tl.constexpr,
              HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Epilogue for an acc[BM, BN] tile (rows where `keep_m`): bias + cast + store, or a split's fp32 partial sum."""
    mask = keep_m[:, None] & (offs_n[None, :] < N)
    offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split.to(tl.int64) * M * N + offs, acc, mask=mask)


@triton.jit
def decode_kernel(
    x_ptr, y_ptr, part_ptr, bias_ptr,
    dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    M,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr,
    DENSE_PER_ROW: tl.constexpr, SPARSE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    VEC: tl.constexpr,
):
    """Small-M kernel. grid = (ceil(N/BN), SPLIT_K, ceil(M/BM)); tl.dot with the weights on its M side
    (USE_DOT, BLOCK_M >= 16), else `decode_gemv` (BLOCK_M <= 4)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = row * BLOCK_N + tl.arange(0, BLOCK_N)
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if HAS_DENSE:
            acc = decode_dot(acc, x_ptr, dense_ptr, dense_rowptr_ptr, dense_cols_ptr, row, split, m0, M, K,
                             BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, DENSE_PER_ROW, EVEN_K, DOT_PRECISION)
        if HAS_SPARSE:
            lo, hi = row_share(sparse_rowptr_ptr, row, split, SPARSE_PER_ROW, SPLIT_K)
            for i in range(lo, hi):
                col = tl.load(sparse_cols_ptr + i)
                w = load_sparse_block(vals_ptr, meta_ptr, i, BLOCK_N, BLOCK_K)
                acc = decode_mac(acc, w, x_ptr, m0, col, M, K, BLOCK_M, BLOCK_K, EVEN_K, DOT_PRECISION)
        out = tl.trans(acc)
        keep = offs_m < M
    else:
        # dense blocks on the tensor cores (tokens padded to 16: a tl.dot side), 2:4 blocks by gathering x
        TOK: tl.constexpr = 16 if HAS_DENSE else BLOCK_M
        offs_m = m0 + tl.arange(0, TOK)
        keep = (offs_m < M) & (tl.arange(0, TOK) < BLOCK_M)
        out = tl.zeros((TOK, BLOCK_N), dtype=tl.float32)
        if HAS_DENSE:  # first, as in every kernel here: the static profile reads the dense loop first
            acc = tl.zeros((BLOCK_N, TOK), dtype=tl.float32)
            # this program's tokens only: rows from m0 + BLOCK_M on belong to the next program
            acc = decode_dot(acc, x_ptr, dense_ptr, dense_rowptr_ptr, dense_cols_ptr, row, split, m0,
                             tl.minimum(M, m0 + BLOCK_M), K, TOK, BLOCK_N, BLOCK_K, SPLIT_K, DENSE_PER_ROW, EVEN_K,
                             DOT_PRECISION)
            out = tl.trans(acc)
        if HAS_SPARSE:
            out += decode_gemv(x_ptr, vals_ptr, meta_ptr, sparse_rowptr_ptr, sparse_cols_ptr, row, split, m0, M, K,
                               BLOCK_M, TOK, BLOCK_N, BLOCK_K, SPLIT_K, SPARSE_PER_ROW, EVEN_K, VEC)
    store_out(out, offs_m, offs_n, keep, y_ptr, part_ptr, bias_ptr, split, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def prefill_kernel(
    x_ptr, y_ptr, part_ptr, bias_ptr,
    dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    M,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr,
    DENSE_PER_ROW: tl.constexpr, SPARSE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Large-M tiled GEMM. grid = (ceil(M/BM) * ceil(N/BN), SPLIT_K), grouped program order."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    # GROUP_M block rows of the output share one sweep over the weight block rows (L2 reuse)
    group_size: tl.constexpr = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    row = (pid % group_size) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = row * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rn = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_DENSE:
        lo, hi = row_share(dense_rowptr_ptr, row, split, DENSE_PER_ROW, SPLIT_K)
        for i in range(lo, hi):
            col = tl.load(dense_cols_ptr + i)
            x = load_x(x_ptr, offs_m, col * BLOCK_K + rk, M, K, EVEN_K)
            # W^T block (BK, BN) read straight from the row-major (BN, BK) block
            wt = tl.load(dense_ptr + tl.cast(i, tl.int64) * (BLOCK_N * BLOCK_K) + rk[:, None] + rn[None, :] * BLOCK_K)
            acc = mma(x, wt, acc, DOT_PRECISION)
    if HAS_SPARSE:
        lo, hi = row_share(sparse_rowptr_ptr, row, split, SPARSE_PER_ROW, SPLIT_K)
        for i in range(lo, hi):
            col = tl.load(sparse_cols_ptr + i)
            x = load_x(x_ptr, offs_m, col * BLOCK_K + rk, M, K, EVEN_K)
            w = load_sparse_block(vals_ptr, meta_ptr, i, BLOCK_N, BLOCK_K)
            acc = mma(x, tl.trans(w), acc, DOT_PRECISION)
    store_out(acc, offs_m, offs_n, offs_m < M, y_ptr, part_ptr, bias_ptr, split, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def splitk_reduce_kernel(part_ptr, y_ptr, bias_ptr, M, N,
                         SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum_s part[s] (+ bias), summed in split order (deterministic). grid = (ceil(M*N/BLOCK),)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = M.to(tl.int64) * N  # int64: M * N * SPLIT_K overflows int32 at large M
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


KERNELS = {"decode": decode_kernel, "prefill": prefill_kernel}
