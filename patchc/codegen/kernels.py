"""Triton kernels for hybrid dense / 2:4 linear layers (layout: see `patchc.codegen.layout`).

Layering as in Triton's tutorials: these `@triton.jit` kernels are called only by the plain launchers in
`patchc.codegen.launch` (check, allocate, grid, launch). Two kernels:

* `decode_kernel` (small M, bound by weight bytes): the weight block is the `tl.dot` M side,
  acc[BN, TOK] += W[BN, BK] @ x^T[BK, TOK], BLOCK_M tokens padded to TOK >= 8 (for M <= 16 one program
  reads every weight once). Its loops are unpipelined by default (num_stages 1: 2 barriers per iteration).
  Split-K over grid axis 1: split s of a block row takes the s-th equal share of the row's dense blocks and
  the s-th equal share of its 2:4 blocks, so every split reads the same bytes (balanced by bytes).
* `prefill_kernel` (large M, compute bound): a tiled GEMM acc[BM, BN] += x[BM, BK] @ W^T[BK, BN] with
  grouped ("super-grouping") program order for L2 reuse of x, same two loops and optional split-K.

In both, a block row's dense blocks and 2:4 blocks are walked by two separate loops (no per-iteration
branch on the block kind). A 2:4 block is loaded compressed (values (BN, BK/2) + metadata (BN, BK/8) bytes)
and expanded to the dense (BN, BK) operand in registers: for fp16 / bf16 each group's kept pair is one
32-bit load and two PRMT byte permutes whose selectors come from the group's nibble (`expand_words`, ~10
instructions per group of 4 weights, no layout conversion; under Triton 3.6 two groups per 64-bit element,
loaded straight into the mma operand's registers with the block's columns reordered, `GROUPS_PER_LOAD`);
fp32 uses the generic `expand_24`.
Accumulation is fp32. With SPLIT_K > 1 each split writes fp32 partial sums to a (SPLIT_K, M, N) workspace,
added in split order either by the last split of each output tile to finish (FIXUP: `fixup`, one launch,
an int32 counter per tile) or by a second launch, `splitk_reduce_kernel`. Both give the same bits, run to
run (unlike fp32 atomics, whose summation order depends on scheduling). A second launch adds a kernel
boundary (launch latency, ramp and tail) to a decode layer that streams its weights in a few microseconds;
FIXUP instead makes each tile's last split read the partial sums back from L2. FIXUP is the default and
the tuner times both (`KernelConfig.reduce`).

Why this file is long: `generate()` ships this module's source beside every compiled kernel as its
self-contained, recompilable source, so every helper the kernels call lives here (the grouped MoE kernels
in `grouped_kernels` reuse `decode_tile` / `prefill_tile`, the bodies of the two kernels).

Per-layer specialisation: N, K, the block sizes, the per-row block counts when uniform (DENSE_PER_ROW /
SPARSE_PER_ROW, -1 when they vary), HAS_DENSE / HAS_SPARSE (an all-2:4 layer has no dense loop), HAS_BIAS,
SPLIT_K, FIXUP and EVEN_K are `tl.constexpr`. x and y are contiguous, so their strides are K and N.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from patchc.codegen.configs import groups_in_use

# Triton's interpreter multiplies bf16 tl.dot operands as their raw uint16 bits (it converts only fp8), so
# there `mma` widens them to fp32 first; compiled kernels never see this branch. Tests reload this module
# when they switch the interpreter on or off, so the flag follows the environment.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# How `load_sparse_block` loads 16-bit kept values: one 2:4 group per 32-bit element, or two per 64-bit
# element in the mma operand's layout on Triton versions that lay the former out badly
# (`configs.GROUPS_PER_LOAD`; $PATCHC_GROUPS_PER_LOAD overrides it, e.g. to time both on a GPU).
GROUPS_PER_LOAD = tl.constexpr(groups_in_use(triton.__version__))
# The token count M stays a plain i32 argument: Triton's JIT would otherwise turn M == 1 into the Python
# int 1 (so `M.to(...)` fails to compile: every split-K decode at M = 1 did on the first GPU run) and
# compile another variant per M % 16; unspecialised, the JIT builds what `generate` compiles and profiles.
NOT_SPECIALISED = ["M"]
# The decode kernel at 64 or more tokens a program (prefill sizes, where the tuner may pick it): block rows per
# group of its grouped program order, which sweeps the token blocks while a group's weights sit in L2
DECODE_GROUP_ROWS = tl.constexpr(8)


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


# One 2:4 group -> its four dense values, as two 32-bit words of two 16-bit values each. A group's kept
# pair is one word (v0 low, v1 high); PRMT picks each output half from {v0, v1, zero} by a selector built
# from the group's nibble i0 | i1 << 2: every position starts as "zero" (selector byte 0x54: bytes 4, 5 of
# the zero operand), position i0 is flipped to v0 (0x10) and i1 to v1 (0x32) by xor-ing 0x44 << 8*i0 and
# 0x66 << 8*i1. The nibble sits at bit `sh` (0 or 4) of its metadata byte; 8*i0 = (byte rotr (sh - 3)) & 0x18
# and 8*i1 = (byte rotr (sh - 1)) & 0x18, the rotations r0, r1 precomputed per group.
_EXPAND_ASM = tl.constexpr("""{
.reg .b32 s0, s1, t0, t1, sel, selhi;
shf.r.wrap.b32 s0, $3, $3, $4;
and.b32 s0, s0, 0x18;
shf.r.wrap.b32 s1, $3, $3, $5;
and.b32 s1, s1, 0x18;
shl.b32 t0, 0x44, s0;
shl.b32 t1, 0x66, s1;
xor.b32 sel, t0, t1;
xor.b32 sel, sel, 0x54545454;
prmt.b32 $0, $2, 0, sel;
shr.b32 selhi, sel, 16;
prmt.b32 $1, $2, 0, selhi;
}""")


@triton.jit
def _pick(pair, sel):
    """What `prmt.b32 d, pair, 0, sel` gives for the selectors `_EXPAND_ASM` builds (the interpreter's path):
    each 16-bit half is v0 (selector byte 0x10), v1 (0x32) or zero."""
    c0 = sel & 0xFF
    c1 = (sel >> 8) & 0xFF
    v0 = pair & 0xFFFF
    v1 = (pair >> 16) & 0xFFFF
    h0 = tl.where(c0 == 0x10, v0, tl.where(c0 == 0x32, v1, 0))
    h1 = tl.where(c1 == 0x10, v0, tl.where(c1 == 0x32, v1, 0))
    return h0 | (h1 << 16)


@triton.jit
def expand_words(pair, byte, r0, r1):
    """(lo, hi) int32 words: positions 0, 1 and 2, 3 of each group (see `_EXPAND_ASM`)."""
    if INTERPRETED:  # no inline PTX in the interpreter: the same selector arithmetic in plain ops
        u = byte.to(tl.uint32, bitcast=True)  # rotate: a logical shift (the word's top bit may be set)
        s0 = (((u >> r0) | (u << ((32 - r0) & 31))) & 0x18).to(tl.int32, bitcast=True)
        s1 = (((u >> r1) | (u << ((32 - r1) & 31))) & 0x18).to(tl.int32, bitcast=True)
        sel = (0x44 << s0) ^ (0x66 << s1) ^ 0x54545454
        return _pick(pair, sel), _pick(pair, (sel >> 16) & 0xFFFF)
    else:
        return tl.inline_asm_elementwise(_EXPAND_ASM, "=r,=r,r,r,r,r", [pair, byte, r0, r1],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def halves(w, dtype: tl.constexpr):
    """(..., 2) 16-bit values of 32-bit words, low half first."""
    lo = (w & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    hi = (w >> 16).to(tl.int16).to(dtype, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def load_sparse_block(vals_ptr, meta_ptr, t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      WIDE_META: tl.constexpr = False):
    """Load 2:4 block number `t` compressed and expand it: (BN, BK). 16-bit values: two PRMTs per group
    (`expand_words`), its kept pair loaded alone (`expand_groups`) or beside the next group's
    (`expand_group_pairs`, `GROUPS_PER_LOAD`; its columns come in `sparse_columns` order); fp32 values (not
    bandwidth critical): `expand_24`. WIDE_META (prefill): metadata in 32-bit words where a row has them
    (BK >= 32), which Triton's pipeline copies with cp.async like the values; byte loads it cannot, so each
    iteration waited on them in global memory before its expansion (decode keeps bytes: fewer instructions,
    its latency hidden by its many programs)."""
    rn = tl.arange(0, BLOCK_N)
    t64 = tl.cast(t, tl.int64)
    vbase = vals_ptr + t64 * (BLOCK_N * BLOCK_K // 2)
    mbase = meta_ptr + t64 * (BLOCK_N * BLOCK_K // 8)
    if vals_ptr.dtype.element_ty.primitive_bitwidth == 16:
        if GROUPS_PER_LOAD == 2:
            return expand_group_pairs(vbase, mbase, BLOCK_N, BLOCK_K, WIDE_META and BLOCK_K >= 32)
        else:
            return expand_groups(vbase, mbase, rn, BLOCK_N, BLOCK_K, WIDE_META and BLOCK_K >= 32)
    else:
        rv = tl.arange(0, BLOCK_K // 2)
        rm = tl.arange(0, BLOCK_K // 8)
        vals = tl.load(vbase + rn[:, None] * (BLOCK_K // 2) + rv[None, :])
        meta = tl.load(mbase + rn[:, None] * (BLOCK_K // 8) + rm[None, :])
        return expand_24(vals, meta, BLOCK_N, BLOCK_K)


@triton.jit
def expand_groups(vbase, mbase, rn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    """16-bit 2:4 block -> (BN, BK): each group's kept pair one 32-bit element, beside its metadata byte (or
    the 32-bit word holding it: WORDS)."""
    G: tl.constexpr = BLOCK_K // 4
    rg = tl.arange(0, G)[None, :]
    pair = tl.load(vbase.to(tl.pointer_type(tl.int32)) + rn[:, None] * G + rg)  # (BN, G) kept pairs
    if WORDS:  # 4 metadata bytes, 8 groups: the group's nibble at 8 * (its byte in the word) + 4 * (g odd)
        bits = tl.load(mbase.to(tl.pointer_type(tl.int32)) + rn[:, None] * (BLOCK_K // 32) + rg // 8)
        sh = ((rg // 2) % 4) * 8 + (rg & 1) * 4
    else:
        bits = tl.load(mbase + rn[:, None] * (BLOCK_K // 8) + rg // 2).to(tl.int32)
        sh = (rg & 1) * 4
    lo, hi = expand_words(pair, bits, (sh + 29) & 31, (sh + 31) & 31)
    dense = halves(tl.join(lo, hi), vbase.dtype.element_ty)  # (BN, G, word, half): column 4g + 2 word + half
    return tl.reshape(dense, (BLOCK_N, BLOCK_K))


@triton.constexpr_function
def pair_lanes(block_k):
    """`expand_group_pairs` splits a row's BK/8 64-bit elements over this many lanes of an mma quad (the rest
    are each lane's registers); `sparse_columns` reads x in the order that split gives."""
    return 4 if block_k >= 32 else block_k // 8


@triton.jit
def expand_group_pairs(vbase, mbase, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    """16-bit 2:4 block -> (BN, BK) with its columns in `sparse_columns` order, loaded straight into the
    registers of the tl.dot operand (mma.sync A, m16n8k16): Triton 3.6 would move a load in its own
    coalesced layout there through shared memory (4 more barriers per iteration).

    Element b of a row is groups 2b and 2b+1 (8 columns): one 64-bit kept-value load and metadata byte b.
    A row's elements are split as b = lane * REGS + r (lane: one of an mma quad's 4 lanes, r: a register),
    so each lane's REGS elements are adjacent in memory (a 128-bit load for REGS = 2) and the operand's
    column order is (r, lane, 8 columns). The load's shape (lane, row % 8, row // 16, row // 8 % 2, r) is
    the mma operand's lane / warp / register split of rows, which Triton's coalescing reproduces."""
    LANES: tl.constexpr = pair_lanes(BLOCK_K)
    REGS: tl.constexpr = BLOCK_K // 8 // LANES
    lane = tl.arange(0, LANES)[:, None, None, None, None]
    row_lo = tl.arange(0, 8)[None, :, None, None, None]
    row_hi = tl.arange(0, BLOCK_N // 16)[None, None, :, None, None]
    row_mid = tl.arange(0, 2)[None, None, None, :, None]
    reg = tl.arange(0, REGS)[None, None, None, None, :]
    off = (row_hi * 16 + row_mid * 8 + row_lo) * (BLOCK_K // 8) + lane * REGS + reg
    off = tl.max_contiguous(off, [1, 1, 1, 1, REGS])  # vectorise along r only, never across lanes
    pairs = tl.load(vbase.to(tl.pointer_type(tl.int64)) + off)
    if WORDS:  # metadata byte b in its 32-bit word (the byte's offset is `off`): rotate 8 * (b % 4) further
        bits = tl.load(mbase.to(tl.pointer_type(tl.int32)) + off // 4)
        at = (off % 4) * 8
    else:
        bits = tl.load(mbase + off).to(tl.int32)
        at = 0
    lo0, hi0 = expand_words((pairs & 0xFFFFFFFF).to(tl.int32), bits, (at + 29) & 31, (at + 31) & 31)  # 2b: low nibble
    lo1, hi1 = expand_words((pairs >> 32).to(tl.int32), bits, at + 1, at + 3)  # group 2b + 1: the high nibble
    words = tl.join(tl.join(lo0, lo1), tl.join(hi0, hi1))  # (..., group, word)
    dense = halves(words, vbase.dtype.element_ty)  # column 8b + 4 group + 2 word + half
    dense = tl.permute(dense, (2, 3, 1, 4, 0, 5, 6, 7))  # (row // 16, row // 8 % 2, row % 8, r, lane, 8 columns)
    return tl.reshape(dense, (BLOCK_N, BLOCK_K))


@triton.jit
def sparse_columns(vals_ptr, BLOCK_K: tl.constexpr):
    """The x columns (0..BK-1 within the block) that match `load_sparse_block`'s columns, in its order:
    in order, except for `expand_group_pairs`, whose column r * 8 * LANES + 8 * lane + c is 8b + c."""
    if (vals_ptr.dtype.element_ty.primitive_bitwidth == 16) and (GROUPS_PER_LOAD == 2):
        LANES: tl.constexpr = pair_lanes(BLOCK_K)
        REGS: tl.constexpr = BLOCK_K // 8 // LANES
        b = tl.arange(0, LANES)[None, :, None] * REGS + tl.arange(0, REGS)[:, None, None]  # (r, lane, 1)
        cols = tl.reshape(b * 8 + tl.arange(0, 8)[None, None, :], (BLOCK_K,))
        return tl.max_contiguous(tl.multiple_of(cols, 8), 8)  # runs of 8 columns: x still loads 128-bit
    else:
        return tl.arange(0, BLOCK_K)


@triton.jit
def opaque(w):
    """`w` unchanged, behind an inline-PTX move that ptxas deletes (no SASS cost). Triton 3.6's sm_90
    OptimizeDotOperands pushes a dot operand's shared-memory store back through `load_sparse_block`'s
    reshape to its 4-D join, then aborts ("Illegal shared layout"): the move stops it at the 2-D block."""
    if INTERPRETED:
        return w
    else:
        PER_WORD: tl.constexpr = 32 // w.dtype.primitive_bitwidth  # values moved per 32-bit register
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], dtype=w.dtype, is_pure=True, pack=PER_WORD)


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
def load_x(x_ptr, offs_m, offs_k, M, K: tl.constexpr, EVEN_K: tl.constexpr):
    """x block (BM, BK) of the contiguous (M, K) input, zero outside."""
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    if EVEN_K:
        mask = offs_m[:, None] < M
    else:
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def decode_mac(acc, w, x_ptr, m0, col, cols, M, K: tl.constexpr,
               TOK: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc[BN, TOK] += w[BN, BK] @ x[m0 : m0+TOK, col*BK + cols]^T (tl.dot; rows from M on are zeros; `cols`
    are the block's columns in w's order).

    x is loaded token-major and transposed in registers: on sm_80 that feeds the mma with fewer register
    moves than a (BK, TOK) load."""
    x = load_x(x_ptr, m0 + tl.arange(0, TOK), col * BLOCK_K + cols, M, K, EVEN_K)
    return mma(w, tl.trans(x), acc, DOT_PRECISION)


@triton.jit
def store_out(acc, offs_m, offs_n, keep_m, y_ptr, part_ptr, count_ptr, bias_ptr, split, M, N: tl.constexpr,
              HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr):
    """Epilogue for an acc[BM, BN] tile (rows where `keep_m`): bias + cast + store, or a split's fp32 partial
    sum; with FIXUP the tile's last split to finish then adds the partial sums itself (`fixup`)."""
    mask = keep_m[:, None] & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # int32: the launcher keeps SPLIT_K * M * N under 2**31 (`launch.MAX_WORKSPACE_BYTES`), and 64-bit
        # offsets kept live to the fixup cost registers
        offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + split * M * N + offs, acc, mask=mask)
        if FIXUP:
            fixup(offs_m, offs_n, keep_m, y_ptr, part_ptr, count_ptr, bias_ptr, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def fixup(offs_m, offs_n, keep_m, y_ptr, part_ptr, count_ptr, bias_ptr, M, N: tl.constexpr,
          HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Split-K without a second launch: each split counts itself in on its output tile's counter once its
    partial sum is stored; the last one in adds the SPLIT_K partial sums in split order (so y is bitwise
    the reduce kernel's) and sets the counter back to 0 for the next launch.

    Ordering as CUTLASS's semaphore: a barrier puts every thread's stores before one thread's acq_rel
    atomic at GPU scope, whose result reaches the program's threads through shared memory and a barrier;
    the partial sums are then read past L1 (.cg). A tile is (axis 0, axis 2) of the grid: the splits of
    one tile differ only in axis 1, so counters hold num_programs(0) * num_programs(2) entries."""
    tl.debug_barrier()
    tile = tl.program_id(0) + tl.program_id(2) * tl.num_programs(0)
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        offs = offs_m[:, None] * N + offs_n[None, :]  # recomputed: cheaper than keeping them live
        mask = keep_m[:, None] & (offs_n[None, :] < N)
        total = tl.zeros(offs.shape, dtype=tl.float32)
        # four splits' loads in flight an iteration (one L2 round trip), added in split order: one load an
        # iteration waits SPLIT_K round trips; all SPLIT_K unrolled took Triton 3.6 16-28 more registers (and a
        # static tail for SPLIT_K % 4 ~20). Past SPLIT_K the loads are masked: adding +0.0 to a sum begun at
        # +0.0 changes no bit, so y stays the reduce kernel's.
        for s0 in range(0, SPLIT_K, 4):
            for j in tl.static_range(4):
                total += tl.load(part_ptr + (s0 + j) * M * N + offs, mask=mask & (s0 + j < SPLIT_K), other=0.0,
                                 cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(count_ptr + tile, 0)


@triton.jit
def decode_tile(
    x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr,
    dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    M, row, block_row, split, m0, m_end,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr,
    DENSE_PER_ROW: tl.constexpr, SPARSE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One decode program's work: output columns of block row `row`, tokens [m0, m_end) (at most BLOCK_M),
    weights from CSR row `block_row` (== row for one layer; expert e's row e * RB + row in a grouped layer)."""
    TOK: tl.constexpr = BLOCK_M if BLOCK_M >= 8 else 8  # an mma's N side is 8 tokens
    offs_m = m0 + tl.arange(0, TOK)
    offs_n = row * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, TOK), dtype=tl.float32)
    if HAS_DENSE:
        lo, hi = row_share(dense_rowptr_ptr, block_row, split, DENSE_PER_ROW, SPLIT_K)
        for i in range(lo, hi):
            col = tl.load(dense_cols_ptr + i)
            w = load_dense_block(dense_ptr, i, BLOCK_N, BLOCK_K)
            acc = decode_mac(acc, w, x_ptr, m0, col, tl.arange(0, BLOCK_K), m_end, K, TOK, BLOCK_K, EVEN_K,
                             DOT_PRECISION)
    if HAS_SPARSE:
        lo, hi = row_share(sparse_rowptr_ptr, block_row, split, SPARSE_PER_ROW, SPLIT_K)
        cols = sparse_columns(vals_ptr, BLOCK_K)
        for i in range(lo, hi):
            col = tl.load(sparse_cols_ptr + i)
            w = load_sparse_block(vals_ptr, meta_ptr, i, BLOCK_N, BLOCK_K)
            acc = decode_mac(acc, w, x_ptr, m0, col, cols, m_end, K, TOK, BLOCK_K, EVEN_K, DOT_PRECISION)
    store_out(tl.trans(acc), offs_m, offs_n, offs_m < m_end, y_ptr, part_ptr, count_ptr, bias_ptr, split, M, N,
              HAS_BIAS, SPLIT_K, FIXUP)


@triton.jit(do_not_specialize=NOT_SPECIALISED)
def decode_kernel(
    x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr,
    dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    M,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr,
    DENSE_PER_ROW: tl.constexpr, SPARSE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Small-M kernel. grid = (ceil(N/BN), SPLIT_K, ceil(M/BM)): acc[BN, TOK] += W @ x^T with the weights
    on the tl.dot M side, BLOCK_M tokens padded to TOK >= 8 (an mma's N side); one weight pass per program.
    From 64 tokens a program, grouped order: DECODE_GROUP_ROWS block rows sweep every token block while their
    weights sit in L2 (in launch order a layer larger than the L2 would be read again per wave of token blocks);
    below, the order of the grid, and no divisions before the weight loops."""
    row, tok = tl.program_id(0), tl.program_id(2)
    if BLOCK_M >= 64:
        row, tok = swizzle(tl.program_id(0) + tl.program_id(2) * tl.num_programs(0), tl.num_programs(0),
                           tl.num_programs(2), DECODE_GROUP_ROWS)
    m0 = tok * BLOCK_M
    m_end = tl.minimum(M, m0 + BLOCK_M)  # padding rows and the next program's tokens read as zeros
    decode_tile(x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr, dense_ptr, vals_ptr, meta_ptr, dense_rowptr_ptr,
                dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr, M, row, row, tl.program_id(1), m0, m_end, N, K,
                BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP, HAS_DENSE, HAS_SPARSE, DENSE_PER_ROW, SPARSE_PER_ROW,
                HAS_BIAS, EVEN_K, DOT_PRECISION)


@triton.jit
def prefill_tile(
    x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr,
    dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    M, row, block_row, split, m0, m_end,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr,
    DENSE_PER_ROW: tl.constexpr, SPARSE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One prefill program's (BM, BN) output tile: rows [m0, m_end), columns of block row `row`, weights from
    CSR row `block_row` (see `decode_tile`)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = row * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rn = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_DENSE:
        lo, hi = row_share(dense_rowptr_ptr, block_row, split, DENSE_PER_ROW, SPLIT_K)
        for i in range(lo, hi):
            col = tl.load(dense_cols_ptr + i)
            x = load_x(x_ptr, offs_m, col * BLOCK_K + rk, m_end, K, EVEN_K)
            # W^T block (BK, BN) read straight from the row-major (BN, BK) block
            wt = tl.load(dense_ptr + tl.cast(i, tl.int64) * (BLOCK_N * BLOCK_K) + rk[:, None] + rn[None, :] * BLOCK_K)
            acc = mma(x, wt, acc, DOT_PRECISION)
    if HAS_SPARSE:
        lo, hi = row_share(sparse_rowptr_ptr, block_row, split, SPARSE_PER_ROW, SPLIT_K)
        cols = sparse_columns(vals_ptr, BLOCK_K)
        for i in range(lo, hi):
            col = tl.load(sparse_cols_ptr + i)
            x = load_x(x_ptr, offs_m, col * BLOCK_K + cols, m_end, K, EVEN_K)
            w = opaque(load_sparse_block(vals_ptr, meta_ptr, i, BLOCK_N, BLOCK_K, WIDE_META=True))
            acc = mma(x, tl.trans(w), acc, DOT_PRECISION)
    store_out(acc, offs_m, offs_n, offs_m < m_end, y_ptr, part_ptr, count_ptr, bias_ptr, split, M, N, HAS_BIAS,
              SPLIT_K, FIXUP)


@triton.jit
def swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(m, n) of linear program `pid` in grouped order, a bijection of [0, num_pid_m * num_pid_n): GROUP_M
    consecutive m share one sweep over every n (the prefill GEMM: m tiles over the weight block rows, L2 reuse
    of x; the decode kernel at prefill sizes: block rows over the token blocks, L2 reuse of the weights). A
    constexpr `num_pid_n` stays one, so its divisions fold."""
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


@triton.jit(do_not_specialize=NOT_SPECIALISED)
def prefill_kernel(
    x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr,
    dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    M,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr,
    DENSE_PER_ROW: tl.constexpr, SPARSE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Large-M tiled GEMM. grid = (ceil(M/BM) * ceil(N/BN), SPLIT_K), grouped program order."""
    pid_m, row = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)
    prefill_tile(x_ptr, y_ptr, part_ptr, count_ptr, bias_ptr, dense_ptr, vals_ptr, meta_ptr, dense_rowptr_ptr,
                 dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr, M, row, row, tl.program_id(1), pid_m * BLOCK_M, M,
                 N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP, HAS_DENSE, HAS_SPARSE, DENSE_PER_ROW, SPARSE_PER_ROW,
                 HAS_BIAS, EVEN_K, DOT_PRECISION)


@triton.jit(do_not_specialize=NOT_SPECIALISED)
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
