"""Triton kernel that unpacks a hybrid layer's packed buffers into its dense W * M (N, K) on the device.

Why: at prefill sizes a GEMM is bound by compute, and stock Triton has no sparse tensor-core instruction, so
the hybrid prefill kernel can at best match cuBLAS. Unpacking the weight (reading its packed bytes once,
writing N * K dense values) and handing it to cuBLAS costs a copy of the weight, against a GEMM that at M =
2048 reads it many times over: the tuner times this route ("unpacked", `KernelConfig(kernel="unpacked")`)
beside the hybrid prefill kernel and keeps the faster (`patchc.runtime.tuner`). The same unpacking serves the
op's backward and `TileLinear.weight` on the kernels' path: no host synchronisation, unlike the indexing
reference (`layout.dense_from_buffers`); the tests check it bit for bit against the plan's own weight.

grid = (cdiv(N, BN), cdiv(K, BK)): program (row, j) writes the j-th block of block row `row` in CSR order,
its dense blocks first, then its 2:4 blocks (every block of the grid is one or the other). 2:4 blocks are
expanded in registers by `kernels.load_sparse_block`, the hybrid kernels' own expansion, and stored in its
column order (`sparse_columns`).

Example:
    >>> w = unpack(kernel_buffers(packed), packed.shape, packed.block)   # doctest: +SKIP
"""

from __future__ import annotations

import triton
import triton.language as tl

from patchc.codegen.kernels import load_dense_block, load_sparse_block, sparse_columns


@triton.jit
def store_block(out_ptr, w, offs_n, offs_k, N: tl.constexpr, K: tl.constexpr, EVEN: tl.constexpr):
    """w (BN, BK) into the row-major (N, K) output at rows `offs_n`, columns `offs_k` (masked at the edges)."""
    ptrs = out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    if EVEN:
        tl.store(ptrs, w)
    else:
        tl.store(ptrs, w, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


@triton.jit
def unpack_kernel(
    out_ptr, dense_ptr, vals_ptr, meta_ptr,
    dense_rowptr_ptr, dense_cols_ptr, sparse_rowptr_ptr, sparse_cols_ptr,
    N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_DENSE: tl.constexpr, HAS_SPARSE: tl.constexpr, EVEN: tl.constexpr,
):
    """out (N, K) = W * M from the seven packed buffers. grid = (cdiv(N, BN), cdiv(K, BK))."""
    row = tl.program_id(0)
    j = tl.program_id(1)
    offs_n = row * BLOCK_N + tl.arange(0, BLOCK_N)
    n_dense = 0
    if HAS_DENSE:
        first = tl.load(dense_rowptr_ptr + row)
        n_dense = tl.load(dense_rowptr_ptr + row + 1) - first
        if j < n_dense:
            i = first + j
            cols = tl.load(dense_cols_ptr + i) * BLOCK_K + tl.arange(0, BLOCK_K)
            store_block(out_ptr, load_dense_block(dense_ptr, i, BLOCK_N, BLOCK_K), offs_n, cols, N, K, EVEN)
    if HAS_SPARSE:
        if j >= n_dense:
            i = tl.load(sparse_rowptr_ptr + row) + j - n_dense
            cols = tl.load(sparse_cols_ptr + i) * BLOCK_K + sparse_columns(vals_ptr, BLOCK_K)
            w = load_sparse_block(vals_ptr, meta_ptr, i, BLOCK_N, BLOCK_K)
            store_block(out_ptr, w, offs_n, cols, N, K, EVEN)


UNPACK_ARGS = ("out_ptr", "dense_ptr", "vals_ptr", "meta_ptr", "dense_rowptr_ptr", "dense_cols_ptr",
               "sparse_rowptr_ptr", "sparse_cols_ptr")
GRID_RULE = "(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))"


def unpack_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """(block rows, blocks per row): one program per block of the padded grid (`GRID_RULE`)."""
    return triton.cdiv(shape[0], block[0]), triton.cdiv(shape[1], block[1])


def signature(dtype: str) -> tuple[tuple[str, str], ...]:
    """The kernel's runtime arguments and their Triton types for weights of `dtype` ("fp16", "bf16", "fp32")."""
    return tuple(zip(UNPACK_ARGS, (f"*{dtype}",) * 3 + ("*u8",) + ("*i32",) * 4))


def constexprs(shape: tuple[int, int], block: tuple[int, int], has_dense: bool, has_sparse: bool) -> dict:
    """The constants that specialise the kernel to a layer (shared by the launcher and offline generation)."""
    return {"N": shape[0], "K": shape[1], "BLOCK_N": block[0], "BLOCK_K": block[1], "HAS_DENSE": has_dense,
            "HAS_SPARSE": has_sparse, "EVEN": shape[0] % block[0] == 0 and shape[1] % block[1] == 0}


def code_cost(sass: str, elem_bytes: int, block: tuple[int, int], num_warps: int) -> dict:
    """What the kernel's SASS issues per byte one 2:4 block moves (kept values and metadata read, dense
    written), counting the whole code, both block kinds: an upper bound, since a program runs one of them
    once and has no loop (an H100 stops being memory bound near 0.28). Also its 128-bit stores."""
    import re

    from patchc.codegen.sass import loop_cost, sass_instructions

    code = [text for _, text in sass_instructions(sass)]
    issued = sum(not re.search(r"\bNOP\b", t) for t in code)  # the padding after the exit is never issued
    moved = block[0] * block[1] * (elem_bytes + elem_bytes / 2 + 1 / 8)
    return {"instructions": issued, "stg128": sum(bool(re.search(r"\bSTG\.E\.128\b", t)) for t in code),
            "w_instr_per_byte": loop_cost({"instructions": issued}, num_warps, moved)}


def static_cost(cc: int, dtype: str = "fp16", block: tuple[int, int] = (128, 64), has_dense: bool = True,
                num_warps: int = 4) -> dict:
    """The kernel compiled for sm_<cc> (no GPU; not under TRITON_INTERPRET) for a 4096 x 4096 layer, and
    read from its SASS: registers, spill bytes, 128-bit loads / stores and `code_cost`. {"sass": False, ...}
    without NVIDIA's tools.

    Example:
        >>> static_cost(90, "bf16", (128, 128))["w_instr_per_byte"] < 0.1   # doctest: +SKIP
        True
    """
    from patchc.codegen.compile_pool import CompileJob, compile_job

    consts = constexprs((4096, 4096), block, has_dense, True)
    kernel = compile_job(CompileJob("unpack", signature(dtype), tuple(consts.items()), num_warps, 1, cc))
    # the profile (`compile_pool.profile_all`) holds registers, spills, 128-bit loads and `code_cost`
    return {"cc": cc, "dtype": dtype, "block": list(block), "has_dense": has_dense, "num_warps": num_warps,
            "sass": kernel.profile is not None, **(kernel.profile or {})}


__all__ = ["GRID_RULE", "UNPACK_ARGS", "code_cost", "constexprs", "signature", "static_cost", "store_block",
           "unpack_grid", "unpack_kernel"]
