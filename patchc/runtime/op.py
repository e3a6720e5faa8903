"""The `patchc::tile_linear` custom op: y = x @ W_hat^T (+ bias) from a layer's packed buffers.

The op receives the packed layout (see `patchc.codegen.layout`) as real tensors plus a few ints, so
`torch.export`, `torch.compile` and CUDA-graph capture see one opaque node with a fake (meta) kernel:

* on CUDA (or on CPU when the Triton kernels run in the interpreter, TRITON_INTERPRET=1) it launches the
  hybrid Triton kernels; which kernel and launch config depends only on M = x.numel() // K (a shape,
  never a tensor value): M <= threshold -> the decode config, above -> the prefill config. Nothing in that
  path reads a tensor value back to the host (no `.item()`, no data-dependent branch), so it can be
  captured in a CUDA graph;
* on CPU otherwise it runs a plain-PyTorch reference: W_hat rebuilt from the packed buffers, F.linear.

The op has a backward to x (and to a bias read from the model): dL/dx = dL/dy @ W_hat through the opaque
`patchc::tile_linear_grad_x` (W_hat unpacked on the device on the kernels' path); the packed weights are
frozen. Without it, a compiled model called with gradients on fails in aot_autograd.

A launch config travels as 7 ints (see `encode_config`): kernel (0 decode, 1 prefill, 2 unpacked: W_hat
unpacked on the device, then cuBLAS), block_m, split_k, num_warps, num_stages, group_m, reduce (0 fixup: in
the kernel, 1 launch: a second kernel). The decode side may
be bucketed by M (`encode_buckets`): records of 8 ints, the bucket's largest M then its config, in
increasing M; the first bucket that holds M serves it (the last one serves any larger M up to the
threshold), so M = 1, 2-4, 5-8, ... each get a config that reads the weights once.

Example:
    >>> import torch, patchc.runtime.op  # registers torch.ops.patchc.tile_linear
    >>> y = torch.ops.patchc.tile_linear(x, *buffers, bias, name, shape, block, per_row,
    ...                                   decode_cfg, prefill_cfg, threshold)      # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.nn.functional as F

from patchc.codegen.configs import KernelConfig
from patchc.codegen.launch import launch, unpack
from patchc.codegen.layout import dense_from_buffers

KERNEL_CODES = {"decode": 0, "prefill": 1, "unpacked": 2}
REDUCE_CODES = {"fixup": 0, "launch": 1}
CONFIG_FIELDS = ("kernel", "block_m", "split_k", "num_warps", "num_stages", "group_m", "reduce")
# How CPU tensors are served: "auto" = Triton iff the kernels module runs in the interpreter,
# "reference" = always plain PyTorch, "triton" = always Triton (needs TRITON_INTERPRET=1 on CPU).
CPU_IMPLS = ("auto", "reference", "triton")


def encode_config(cfg: KernelConfig) -> list[int]:
    """A fully resolved KernelConfig -> the op's 7-int form.

    Example:
        >>> encode_config(KernelConfig("decode", 16, split_k=2, num_warps=4, num_stages=3, group_m=8, reduce="fixup"))
        [0, 16, 2, 4, 3, 8, 0]
    """
    if cfg.kernel not in KERNEL_CODES:
        raise ValueError(f"encode_config: kernel must be one of {tuple(KERNEL_CODES)} (resolved), got {cfg.kernel!r}")
    vals = [cfg.block_m, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.group_m, cfg.reduce]
    if any(v is None for v in vals):
        raise ValueError(f"encode_config: every field must be set (use resolve_config first), got {cfg}")
    return [KERNEL_CODES[cfg.kernel], *(int(v) for v in vals[:-1]), REDUCE_CODES[cfg.reduce]]


def encode_buckets(buckets: list[tuple[int, KernelConfig]]) -> list[int]:
    """[(largest M, config), ...] in increasing M -> the op's flat decode_cfg (8 ints per bucket).

    Example:
        >>> encode_buckets([(1, KernelConfig("decode", 1, None, None, 4, 4, 4, 8, "fixup"))])
        [1, 0, 1, 4, 4, 4, 8, 0]
    """
    bounds = [int(m) for m, _ in buckets]
    if not bounds or bounds != sorted(set(bounds)) or bounds[0] < 1:
        raise ValueError(f"decode buckets need increasing largest-M bounds >= 1, got {bounds}")
    return [v for m, cfg in buckets for v in (int(m), *encode_config(cfg))]


def encode_tuning(tuning: Any) -> tuple[list[int], list[int], int]:
    """A `LayerTuning` -> what the op dispatches on: (decode configs, one per M bucket, or the one config where
    the tuning has no buckets; the prefill config; the largest M that decodes).

    Example:
        >>> decode, prefill, threshold = encode_tuning(mod.tuning)   # doctest: +SKIP
    """
    decode = encode_buckets(list(tuning.buckets)) if tuning.buckets else encode_config(tuning.decode)
    return decode, encode_config(tuning.prefill), int(tuning.threshold)


def pick_decode(decode_cfg: list[int], m: int) -> list[int]:
    """The 7-int decode config that serves M: decode_cfg itself (7 ints) or its first bucket holding M.

    Example:
        >>> pick_decode([1, 0, 1, 4, 4, 4, 8, 0, 4, 0, 4, 4, 4, 4, 8, 1], 3)
        [0, 4, 4, 4, 4, 8, 1]
    """
    width = len(CONFIG_FIELDS) + 1
    if len(decode_cfg) == len(CONFIG_FIELDS):
        return list(decode_cfg)
    if not decode_cfg or len(decode_cfg) % width:
        raise ValueError(f"decode_cfg holds {len(CONFIG_FIELDS)} ints or buckets of {width}, "
                         f"got {len(decode_cfg)} ints")
    for start in range(0, len(decode_cfg), width):
        if m <= decode_cfg[start]:
            break
    return list(decode_cfg[start + 1 : start + width])


def decode_config(ints: list[int]) -> KernelConfig:
    """The op's 7-int form -> KernelConfig (the inverse of `encode_config`).

    Example:
        >>> decode_config([1, 64, 1, 8, 3, 8, 0]).kernel
        'prefill'
    """
    if len(ints) != len(CONFIG_FIELDS):
        raise ValueError(f"a launch config has {len(CONFIG_FIELDS)} ints {CONFIG_FIELDS}, got {list(ints)}")
    kernel = {v: k for k, v in KERNEL_CODES.items()}.get(int(ints[0]))
    if kernel is None:
        raise ValueError(f"unknown kernel code {ints[0]} (0 decode, 1 prefill, 2 unpacked)")
    reduce = {v: k for k, v in REDUCE_CODES.items()}.get(int(ints[-1]))
    if reduce is None:
        raise ValueError(f"unknown reduce code {ints[-1]} (0 fixup, 1 launch)")
    bm, sk, nw, ns, gm = (int(v) for v in ints[1:-1])
    return KernelConfig(kernel=kernel, block_m=bm, split_k=sk, num_warps=nw, num_stages=ns, group_m=gm, reduce=reduce)


def cpu_impl() -> str:
    """The CPU serving mode: $PATCHC_CPU_IMPL (one of CPU_IMPLS), default "auto"."""
    mode = os.environ.get("PATCHC_CPU_IMPL", "auto")
    if mode not in CPU_IMPLS:
        raise ValueError(f"PATCHC_CPU_IMPL must be one of {CPU_IMPLS}, got {mode!r}")
    return mode


def kernels_interpreted() -> bool:
    """True when patchc's Triton kernels were decorated under TRITON_INTERPRET=1 (they then run on CPU)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from patchc.codegen import kernels
    except Exception:  # no usable Triton: the reference serves CPU tensors
        return False
    return isinstance(kernels.decode_kernel, InterpretedFunction)


def use_triton(x: torch.Tensor) -> bool:
    """Whether this call launches the Triton kernels (CUDA always; CPU per `cpu_impl`), float64 never: the
    kernels accumulate in fp32, so a model moved to float64 would get fp32 accuracy; the reference is exact."""
    if x.dtype == torch.float64:
        return False
    if x.is_cuda:
        return True
    mode = cpu_impl()
    return mode == "triton" or (mode == "auto" and kernels_interpreted())


def w_hat(buffers: tuple[torch.Tensor, ...], shape: tuple[int, int], block: tuple[int, int],
          like: torch.Tensor) -> torch.Tensor:
    """W_hat (N, K) in the packed values' dtype: by the unpack kernel where calls on `like` run the kernels
    (`use_triton`: no host synchronisation, nothing allocated beside W_hat), else by the indexing reference."""
    if use_triton(like):
        return unpack(buffers, shape, block)
    return dense_from_buffers(buffers, shape, block)


@torch.library.custom_op("patchc::tile_linear", mutates_args=())
def tile_linear(
    x: torch.Tensor,
    dense: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    dense_rowptr: torch.Tensor,
    dense_cols: torch.Tensor,
    sparse_rowptr: torch.Tensor,
    sparse_cols: torch.Tensor,
    bias: Optional[torch.Tensor],
    name: str,
    shape: list[int],
    block: list[int],
    per_row: list[int],
    decode_cfg: list[int],
    prefill_cfg: list[int],
    threshold: int,
) -> torch.Tensor:
    """y (..., N) = x (..., K) @ W_hat^T (+ bias); see the module docstring for the arguments.

    Example:
        >>> y = torch.ops.patchc.tile_linear(x, *bufs, None, "fc.weight", [N, K], [16, 16], [-1, -1],
        ...                                   [0, 16, 1, 4, 4, 8, 0], [1, 64, 1, 8, 3, 8, 0], 64)  # doctest: +SKIP
    """
    n, k = _check(x, dense, values, bias, name, shape)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, n))
    if not use_triton(x):
        buffers = (dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols)
        w = dense_from_buffers(buffers, (n, k), (block[0], block[1]))
        # F.linear on the rebuilt W_hat: bitwise the same math as the pruned dense model's F.linear
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    # dispatch by M, a shape: free of host synchronisation (CUDA-graph safe)
    cfg = pick_decode(decode_cfg, m) if m <= threshold else prefill_cfg
    y = launch(x2.contiguous(), (dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols),
               bias, (n, k), (block[0], block[1]), (per_row[0], per_row[1]), decode_config(cfg), name=name)
    # not a view (what aten's own linear returns): autograd forbids in-place ops on a view a custom op outputs,
    # such as Llama 4's `out.add_(routed)` on its shared expert's output with gradients on
    return torch.ops.aten._unsafe_view(y, (*lead, n))


@tile_linear.register_fake
def _(x, dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols, bias, name, shape, block,
      per_row, decode_cfg, prefill_cfg, threshold):
    n, _ = _check(x, dense, values, bias, name, shape)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op("patchc::tile_linear_grad_x", mutates_args=())
def tile_linear_grad_x(grad: torch.Tensor, dense: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                       dense_rowptr: torch.Tensor, dense_cols: torch.Tensor, sparse_rowptr: torch.Tensor,
                       sparse_cols: torch.Tensor, shape: list[int], block: list[int]) -> torch.Tensor:
    """dL/dx (..., K) = dL/dy (..., N) @ W_hat: W_hat unpacked on the kernels' path (`launch.unpack`: no host
    synchronisation), else rebuilt by the reference."""
    buffers = (dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols)
    w = w_hat(buffers, (int(shape[0]), int(shape[1])), (int(block[0]), int(block[1])), grad)
    return grad @ w.to(grad.dtype)


@tile_linear_grad_x.register_fake
def _(grad, dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols, shape, block):
    return grad.new_empty((*grad.shape[:-1], int(shape[1])))


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:8])
    ctx.shape, ctx.block, ctx.bias = inputs[10], inputs[11], inputs[8] is not None


def _backward(ctx, grad: torch.Tensor):
    """Gradients reach x (and a bias read from the model); the packed weights are frozen."""
    grad_x = torch.ops.patchc.tile_linear_grad_x(grad.contiguous(), *ctx.saved_tensors, ctx.shape, ctx.block)
    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias else None
    return (grad_x, *(None,) * 7, grad_bias, *(None,) * 7)


# Without it, calling a compiled model with gradients on (no torch.no_grad) fails in aot_autograd.
tile_linear.register_autograd(_backward, setup_context=_save)


def _check(x: torch.Tensor, dense: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, name: str,
           shape: list[int]) -> tuple[int, int]:
    """Shape / dtype / device checks that need no tensor values (also run by the fake kernel)."""
    n, k = int(shape[0]), int(shape[1])
    where = f"patchc::tile_linear({name!r})"
    if x.shape[-1] != k:
        raise ValueError(f"{where}: x has {x.shape[-1]} features, the layer expects K={k}")
    if x.dtype != values.dtype or x.dtype != dense.dtype:
        raise TypeError(f"{where}: x is {x.dtype} but the packed weights are {values.dtype}; cast the module "
                        f"(e.g. model.to({x.dtype})) or the input")
    if x.device != values.device:
        raise ValueError(f"{where}: x is on {x.device}, the packed weights on {values.device}; move the model")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{where}: bias must have shape ({n},), got {tuple(bias.shape)}")
    return n, k
