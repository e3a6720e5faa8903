"""What a hybrid kernel launch is specialised on: its runtime arguments, its constexprs and its grid.

`launch` and `generate` both build them here, so a kernel compiled offline takes exactly the arguments
and constants the runtime passes.

Example:
    >>> cfg = resolve_config(None, packed, 1, "sm_90")                              # doctest: +SKIP
    >>> specialisation(packed, cfg, torch.float16, has_bias=False)["FIXUP"]        # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
from typing import Any

import torch

from patchc.codegen.configs import KernelConfig
from patchc.codegen.layout import PackedLayer, per_row_counts

# Runtime (non-constexpr) arguments of decode_kernel / prefill_kernel, in order.
KERNEL_ARGS = (
    "x_ptr", "y_ptr", "part_ptr", "count_ptr", "bias_ptr",
    "dense_ptr", "vals_ptr", "meta_ptr",
    "dense_rowptr_ptr", "dense_cols_ptr", "sparse_rowptr_ptr", "sparse_cols_ptr",
    "M",
)


def signature(dtype: str) -> dict[str, str]:
    """`KERNEL_ARGS` with their Triton types for weights and activations of `dtype` ("fp16", "bf16", "fp32").

    Example:
        >>> signature("bf16")["count_ptr"], signature("bf16")["vals_ptr"]
        ('*i32', '*bf16')
    """
    types = {
        "x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "part_ptr": "*fp32", "count_ptr": "*i32", "bias_ptr": f"*{dtype}",
        "dense_ptr": f"*{dtype}", "vals_ptr": f"*{dtype}", "meta_ptr": "*u8",
        "dense_rowptr_ptr": "*i32", "dense_cols_ptr": "*i32", "sparse_rowptr_ptr": "*i32", "sparse_cols_ptr": "*i32",
        "M": "i32",
    }
    assert tuple(types) == KERNEL_ARGS
    return types


def constexprs(
    shape: tuple[int, int],
    block: tuple[int, int],
    per_row: tuple[int, int],
    has_dense: bool,
    has_sparse: bool,
    cfg: KernelConfig,
    dtype: torch.dtype,
    has_bias: bool,
) -> dict[str, Any]:
    """The constexpr arguments that specialise a kernel to a layer and config (plain ints: no tensor reads)."""
    n, k = shape
    bn, bk = block
    consts: dict[str, Any] = {
        "N": n,
        "K": k,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "SPLIT_K": cfg.split_k,
        "FIXUP": fixes_up(cfg),
        "HAS_DENSE": has_dense,
        "HAS_SPARSE": has_sparse,
        "DENSE_PER_ROW": per_row[0],
        "SPARSE_PER_ROW": per_row[1],
        "HAS_BIAS": has_bias,
        "EVEN_K": k % bk == 0,
        # fp32 inputs: exact fp32 products (tf32 would break the fp32 tolerances); ignored for fp16/bf16
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }
    if cfg.kernel == "prefill":
        consts["GROUP_M"] = cfg.group_m
    return consts


def fixes_up(cfg: KernelConfig) -> bool:
    """Whether a resolved config adds its split-K partial sums in the kernel (`kernels.fixup`)."""
    return cfg.split_k > 1 and cfg.reduce == "fixup"


def specialisation(packed: PackedLayer, cfg: KernelConfig, dtype: torch.dtype, has_bias: bool) -> dict[str, Any]:
    """`constexprs` of a packed layer (what generate() bakes into each compiled kernel)."""
    return constexprs(packed.shape, packed.block, per_row_counts(packed), packed.n_dense > 0, packed.n_sparse > 0,
                      cfg, dtype, has_bias)


def grid_of(cfg: KernelConfig, block_rows: int, m: int) -> tuple[int, ...]:
    """Launch grid; the rule is recorded in generate()'s manifest as GRID_RULES."""
    if cfg.kernel == "decode":
        return (block_rows, cfg.split_k, math.ceil(m / cfg.block_m))
    return (math.ceil(m / cfg.block_m) * block_rows, cfg.split_k)


GRID_RULES = {
    "decode": "(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))",
    "prefill": "(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K)",
    "splitk_reduce": "(cdiv(M * N, 1024),)  [only when SPLIT_K > 1 and not FIXUP; BLOCK=1024]",
}
