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


def unpack_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """(block rows, blocks per row): one program per block of the padded grid."""
    return triton.cdiv(shape[0], block[0]), triton.cdiv(shape[1], block[1])


def static_cost(cc: int, dtype: str = "fp16", block: tuple[int, int] = (128, 64), has_dense: bool = True,
                num_warps: int = 4) -> dict:
    """The kernel compiled for sm_<cc> (no GPU; not under TRITON_INTERPRET) and read from its SASS: registers,
    spill bytes, 128-bit loads / stores, its instructions and the warp-instructions they issue per byte one
    2:4 block moves (packed bytes read, dense bytes written), counting the whole code, both block kinds: an
    upper bound (an H100 stops being memory bound near 0.28). {"sass": None, ...} without NVIDIA's tools.

    Example:
        >>> static_cost(90, "bf16", (128, 128))["w_instr_per_byte"] < 0.1   # doctest: +SKIP
        True
    """
    import re
    import tempfile
    from pathlib import Path

    from patchc.codegen.compile_pool import CompileJob, compile_job
    from patchc.codegen.sass import disassemble_many, loop_cost, sass_instructions

    names = ("out_ptr", "dense_ptr", "vals_ptr", "meta_ptr", "dense_rowptr_ptr", "dense_cols_ptr",
             "sparse_rowptr_ptr", "sparse_cols_ptr")
    types = (f"*{dtype}",) * 3 + ("*u8",) + ("*i32",) * 4
    consts = (("N", 4096), ("K", 4096), ("BLOCK_N", block[0]), ("BLOCK_K", block[1]), ("HAS_DENSE", has_dense),
              ("HAS_SPARSE", True), ("EVEN", True))
    kernel = compile_job(CompileJob("unpack", tuple(zip(names, types)), consts, num_warps, 1, cc))
    with tempfile.TemporaryDirectory(prefix="patchc-unpack-") as tmp:
        path = Path(tmp) / "unpack.cubin"
        path.write_bytes(kernel.cubin)
        (sass,) = disassemble_many([path])
    # the profile (`sass.static_profile`) holds registers, spills and the 128-bit loads (`ldg128`)
    out = {"cc": cc, "dtype": dtype, "block": list(block), "has_dense": has_dense, "num_warps": num_warps,
           "sass": sass is not None, **(kernel.profile or {})}
    if sass is None:
        return out
    code = [text for _, text in sass_instructions(sass)]
    issued = sum(not re.search(r"\bNOP\b", t) for t in code)  # the padding after the exit is never issued
    elem = 2 if dtype in ("fp16", "bf16") else 4
    moved = block[0] * block[1] * (elem + elem / 2 + 1 / 8)  # dense written; kept values and metadata read
    return out | {"instructions": issued, "stg128": sum(bool(re.search(r"\bSTG\.E\.128\b", t)) for t in code),
                  "w_instr_per_byte": loop_cost({"instructions": issued}, num_warps, moved)}


__all__ = ["static_cost", "store_block", "unpack_grid", "unpack_kernel"]
