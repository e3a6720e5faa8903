"""Correctness part of `patchc bench`: every kernel variant and the runtime against fp64 and cuBLAS.

Per layer case and M, each variant's output y is compared with the float64 product x @ (W*M)^T
(W*M rebuilt by `layerplan_to_dense` from the plan's own tensors, not from the packed buffers) and with
cuBLAS (`F.linear` on the dense W*M in the same dtype). A variant passes when

    max |y - ref64| <= 2 * max |cuBLAS - ref64| + u * max |ref64|

with u the dtype's unit roundoff (2^-11 fp16, 2^-8 bf16): it may be at most twice as far from the exact
result as cuBLAS, plus one rounding of the output. One misplaced 2:4 value moves an output by about
|w| |x| ~ 1/sqrt(K), several times that bound.

Variants: "auto" (`tile_linear`'s own choice), "gemv" / "gemv_splitk" / "gemv_splitk_launch" (decode with
block_m = M <= 4, tokens padded to 8; split-K added in the kernel or by a second launch), "dot" (decode
with block_m 16, M <= 64), "dot_prefill" (M >= 16: the decode kernel at a prefill tile, 64 tokens a
program below M = 128 and 128 from it, as the tuner may pick it), "prefill" / "prefill_splitk" (M >= 16),
"unpacked" (M >= 16: W*M unpacked on the device, then cuBLAS) and "runtime" (`TileLinear` with its default
buckets, through the custom op). The explicit variants run on the cases marked `explicit`
(fp16, 128 x 128 tiles); every case runs "auto" and "runtime".

Example:
    >>> rows = check_case(LayerCase((96, 160), "2:4", (32, 32), "fp16", (1, 17)), "cpu", seed=0)  # doctest: +SKIP
    >>> all(r["ok"] for r in rows)                                                                 # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from patchc.bench.layers import DTYPES, Deadline, make_input, make_layer, run_cases
from patchc.bench.options import LayerCase

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def variants(m: int, explicit: bool) -> dict[str, Any]:
    """{variant name: KernelConfig or None (auto) or "runtime"} for one M."""
    from patchc.codegen import KernelConfig

    out: dict[str, Any] = {"auto": None, "runtime": "runtime"}
    if not explicit:
        return out
    if m <= 4:
        bm = 1 << (m - 1).bit_length()
        out["gemv"] = KernelConfig(kernel="decode", block_m=bm, split_k=1)
        out["gemv_splitk"] = KernelConfig(kernel="decode", block_m=bm, split_k=4)
        out["gemv_splitk_launch"] = KernelConfig(kernel="decode", block_m=bm, split_k=4, reduce="launch")
    if m <= 64:
        out["dot"] = KernelConfig(kernel="decode", block_m=16, split_k=1)
    if m >= 16:
        out["dot_prefill"] = KernelConfig(kernel="decode", block_m=64 if m < 128 else 128, split_k=1, num_warps=8,
                                          num_stages=3)
        out["prefill"] = KernelConfig(kernel="prefill")
        out["unpacked"] = KernelConfig(kernel="unpacked")
        if m <= 128:
            out["prefill_splitk"] = KernelConfig(kernel="prefill", split_k=2)
    return out


def error_bound(cublas_err: float, ref_max: float, dtype: torch.dtype) -> float:
    """The pass bound of the module docstring.

    Example:
        >>> error_bound(1e-3, 4.0, torch.float16)
        0.003953125
    """
    return 2.0 * cublas_err + UNIT_ROUNDOFF[dtype] * ref_max


def check_case(case: LayerCase, device: str, seed: int) -> list[dict[str, Any]]:
    """Rows {case, M, variant, err, cublas_err, bound, ok[, error]} for one layer case."""
    from patchc.codegen import pack
    from patchc.codegen.configs import arch_of, choose_block
    from patchc.codegen.reference import layerplan_to_dense
    from patchc.runtime import TileLinear
    from patchc.runtime.tuner import default_tuning

    dtype = DTYPES[case.dtype]
    mixed = isinstance(case.kinds, float)
    layer = make_layer(case, seed, bias=mixed)  # bias on the mixed plans: the epilogue and split-K reduce
    arch = arch_of(device)
    packed_cpu = pack(layer, block=choose_block(case.tile, arch), allow_all_dense=case.kinds == "dense")
    packed = packed_cpu.to(device)
    w64 = layerplan_to_dense(layer, torch.float64).to(device)  # once per case: 11008 x 4096 takes a second
    w = w64.to(dtype)  # W*M holds values of `dtype`: exact, the weight cuBLAS gets
    bias = None if layer.bias is None else layer.bias.to(device=device, dtype=dtype)
    b64 = None if bias is None else bias.to(torch.float64)
    # the runtime layer as `TileLinear.from_plan` builds it untuned, from the same packing (packing a 7B
    # layer takes a second)
    runtime = None if case.kinds == "dense" else TileLinear(
        packed_cpu, default_tuning(layer, packed_cpu, 16, 128, arch), dtype=dtype, device=device)
    xs = {m: make_input(m, case.shape[1], dtype, device, seed + m) for m in case.ms}
    if device.startswith("cuda"):
        from patchc.runtime.timing import compile_threads

        compile_case_ahead(case, packed, xs, arch, compile_threads())
    rows = []
    for m in case.ms:
        x = xs[m]
        ref = F.linear(x.to(torch.float64), w64, b64)
        cublas_err = _max_err(F.linear(x, w, bias), ref)
        bound = error_bound(cublas_err, float(ref.abs().max()), dtype)
        for name, cfg in variants(m, case.explicit).items():
            if cfg == "runtime" and runtime is None:
                continue  # an all-dense layer is routed to F.linear by the runtime: nothing of ours runs
            row = {"case": case.label, "M": m, "variant": name, "cublas_err": cublas_err, "bound": bound}
            row.update(_run_variant(lambda: _call(x, packed, cfg, runtime), ref, bound))
            rows.append(row)
    return rows


def compile_case_ahead(case: LayerCase, packed: Any, xs: dict[int, torch.Tensor], arch: str, threads: int) -> None:
    """Compile every explicit and automatic variant of the case in parallel threads before they run one by
    one (`patchc.runtime.timing.compile_parallel`): the check part is mostly Triton compiles otherwise."""
    import functools

    from patchc.codegen.configs import resolve_config
    from patchc.codegen.launch import warm
    from patchc.codegen.layout import kernel_buffers, per_row_counts
    from patchc.runtime.timing import compile_parallel

    if threads < 2:
        return
    bufs, per_row = kernel_buffers(packed), per_row_counts(packed)
    warmers = [functools.partial(warm, xs[m], bufs, packed.bias, packed.shape, packed.block, per_row,
                                 resolve_config(cfg, packed, m, arch))
               for m in case.ms for cfg in variants(m, case.explicit).values() if cfg != "runtime"]
    compile_parallel(warmers, threads)


def _call(x: torch.Tensor, packed: Any, cfg: Any, runtime: Any) -> torch.Tensor:
    from patchc.codegen import tile_linear

    if cfg == "runtime":
        return runtime(x)
    return tile_linear(x, packed, config=cfg)


def _run_variant(fn: Callable[[], torch.Tensor], ref: torch.Tensor, bound: float) -> dict[str, Any]:
    try:
        err = _max_err(fn(), ref)
    except Exception as e:  # a compile error or launch failure is a failed check, reported with its message
        return {"ok": False, "err": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"ok": err <= bound, "err": err}


def _max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    d = (y.to(torch.float64) - ref).abs()
    return float(d.max()) if d.isfinite().all() else float("inf")


def run_checks(cases: list[LayerCase], device: str, seed: int, deadline: Deadline,
               show: bool = True) -> dict[str, Any]:
    """Every case until the deadline; {"rows", "failed", "skipped": [labels without time]}."""
    rows, skipped = run_cases(cases, lambda case: check_case(case, device, seed), deadline, "bench check", show)
    return {"rows": rows, "failed": [r for r in rows if not r["ok"]], "skipped": skipped}
