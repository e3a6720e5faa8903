"""`patchc::tile_grouped_mm` and `TileGroupedLinear`: every expert of a fused MoE weight in one launch.

The experts' packed slices are stacked into one layout (`patchc.codegen.grouped_layout`): planned slices
with their dense and 2:4 tiles, the others as dense blocks of their weight. The op multiplies rows
``offs[e-1]:offs[e]`` of x (sorted by expert, as ``torch._grouped_mm`` takes them) by expert e's slice:

* on CUDA (or on CPU with the kernels in the interpreter) one grouped Triton launch
  (`patchc.codegen.grouped_kernels`); the kernels read the offsets on the device, and the launch config
  depends only on S = x.shape[0] and E (`grouped_config`), so nothing reads a tensor back to the host and
  the op can be captured in a CUDA graph;
* on CPU otherwise a plain-PyTorch reference (W_hat of every expert rebuilt, one matmul per expert).

The backward to x (`tile_grouped_mm_grad_x`) reads nothing on the host either where the kernels run: the
experts' W_hat are unpacked a few experts at a time (`launch.unpack` over a slice of the stacked layout's
block rows, `UNPACK_CHUNKS` launches) and their transposes written as dense blocks into one stacked layout on
the device (`grouped_layout.fill_transposed`), so the experts' dense weights are held once, plus one
chunk; then the grouped kernels multiply each expert's rows of dL/dy by its W_hat. The CPU reference reads
the offsets on the host and runs one matmul per expert.

Example:
    >>> mod = TileGroupedLinear.from_plan(plan, "mlp.experts.down_proj", w_nk)     # doctest: +SKIP
    >>> y = mod(x_sorted, offs)                                                     # doctest: +SKIP
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch
import triton
from torch import nn

from patchc.codegen.configs import ARCH_TABLE, KernelConfig, arch_of, choose_block, resolve_config
from patchc.codegen.grouped_layout import (experts_from_buffers, fill_transposed, pack_dense, stack_experts,
                                           transposed_layout)
from patchc.codegen.launch import launch_grouped, unpack, warm_grouped
from patchc.codegen.layout import BUFFER_NAMES, kernel_buffers, pack
from patchc.ir import tile_grid
from patchc.runtime.op import decode_config, encode_tuning, pick_decode, use_triton
from patchc.runtime.timing import compile_ahead, packed_buffers
from patchc.runtime.tuner import LayerTuning, default_tuning


@torch.library.custom_op("patchc::tile_grouped_mm", mutates_args=())
def tile_grouped_mm(
    x: torch.Tensor,
    offs: torch.Tensor,
    dense: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    dense_rowptr: torch.Tensor,
    dense_cols: torch.Tensor,
    sparse_rowptr: torch.Tensor,
    sparse_cols: torch.Tensor,
    name: str,
    shape: list[int],
    num_experts: int,
    block: list[int],
    per_row: list[int],
    decode_cfg: list[int],
    prefill_cfg: list[int],
    threshold: int,
) -> torch.Tensor:
    """y (S, N): rows ``offs[e-1]:offs[e]`` of x (S, K) times expert e's W_hat (N, K)^T; other rows zero.

    Example:
        >>> y = torch.ops.patchc.tile_grouped_mm(x, offs, *bufs, "experts.down_proj", [N, K], 8, [16, 16],
        ...                                      [-1, -1], decode_cfg, prefill_cfg, 64)   # doctest: +SKIP
    """
    n, k = _check(x, offs, values, name, shape, num_experts)
    buffers = (dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols)
    s = x.shape[0]
    if s == 0:
        return x.new_zeros((0, n))
    if not use_triton(x):
        w = experts_from_buffers(buffers, num_experts, (n, k), (block[0], block[1])).to(x.dtype)
        out = x.new_zeros((s, n))
        for e, start, end in _segments(offs, s):
            out[start:end] = x[start:end] @ w[e].t()
        return out
    return launch_grouped(x.contiguous(), offs, buffers, (n, k), num_experts, (block[0], block[1]),
                          (per_row[0], per_row[1]), grouped_config(decode_cfg, prefill_cfg, threshold, s, num_experts),
                          name=name)


def grouped_config(decode_cfg: list[int], prefill_cfg: list[int], threshold: int, rows: int,
                   num_experts: int) -> KernelConfig:
    """The launch config for `rows` routed rows, from shapes alone (no host synchronisation): a slice's config
    for M = rows (its decode bucket up to the threshold, else prefill), its split-K divided among the up to
    min(E, rows) experts that receive rows, since they fill the GPU together where the slice's split-K was
    chosen for one layer alone. A prefill tile over 128 tokens is cut to what an expert gets on average (at
    least 128): each expert's rows are padded to whole tiles.

    Example:
        >>> grouped_config([0, 16, 8, 4, 1, 8], [1, 64, 1, 8, 3, 8], 64, 4, 128).split_k
        2
        >>> grouped_config([0, 16, 8, 4, 1, 8], [1, 256, 1, 8, 3, 8], 64, 4096, 64).block_m   # 64 rows each
        128
    """
    cfg = decode_config(pick_decode(decode_cfg, rows) if rows <= threshold else prefill_cfg)
    if cfg.kernel == "prefill" and cfg.block_m > 128:
        per_expert = -(-rows // max(1, min(num_experts, rows)))
        cfg = replace(cfg, block_m=min(cfg.block_m, max(128, triton.next_power_of_2(per_expert))))
    return replace(cfg, split_k=max(1, cfg.split_k // max(1, min(num_experts, rows))))


@tile_grouped_mm.register_fake
def _(x, offs, dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols, name, shape, num_experts,
      block, per_row, decode_cfg, prefill_cfg, threshold):
    n, _ = _check(x, offs, values, name, shape, num_experts)
    return x.new_empty((x.shape[0], n))


def _segments(offs: torch.Tensor, rows: int):
    """(expert, start, end) of every expert with rows (a host read of the offsets: reference paths only)."""
    start = 0
    for e, end in enumerate(offs.tolist()):
        end = min(int(end), rows)
        if end > start:
            yield e, start, end
        start = max(start, end)


@torch.library.custom_op("patchc::tile_grouped_mm_grad_x", mutates_args=())
def tile_grouped_mm_grad_x(grad: torch.Tensor, offs: torch.Tensor, dense: torch.Tensor, values: torch.Tensor,
                           meta: torch.Tensor, dense_rowptr: torch.Tensor, dense_cols: torch.Tensor,
                           sparse_rowptr: torch.Tensor, sparse_cols: torch.Tensor, shape: list[int], num_experts: int,
                           block: list[int]) -> torch.Tensor:
    """dL/dx (S, K): each expert's rows of dL/dy (S, N) times its W_hat (N, K)."""
    n, k = int(shape[0]), int(shape[1])
    buffers = (dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols)
    if grad.shape[0] == 0:
        return grad.new_zeros((0, k))
    if use_triton(grad):
        return _grad_x_by_kernels(grad, offs, buffers, (n, k), num_experts, (block[0], block[1]))
    w = experts_from_buffers(buffers, num_experts, (n, k), (block[0], block[1])).to(grad.dtype)
    out = grad.new_zeros((grad.shape[0], k))
    for e, start, end in _segments(offs, grad.shape[0]):
        out[start:end] = grad[start:end] @ w[e]
    return out


UNPACK_CHUNKS = 8  # the backward holds W_hat of 1/8 of the experts beside their transposes


def _expert_rows(buffers: tuple[torch.Tensor, ...], start: int, end: int) -> tuple[torch.Tensor, ...]:
    """The stacked buffers of block rows [start, end): views of the row pointers (their entries index the
    whole buffers, which stay as they are)."""
    dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols = buffers
    return dense, values, meta, dense_rowptr[start : end + 1], dense_cols, sparse_rowptr[start : end + 1], sparse_cols


def _grad_x_by_kernels(grad: torch.Tensor, offs: torch.Tensor, buffers: tuple[torch.Tensor, ...],
                       shape: tuple[int, int], num_experts: int, block: tuple[int, int]) -> torch.Tensor:
    """dL/dx on the kernels' path, nothing read on the host: W_hat unpacked a chunk of experts at a time, their
    transposes written as dense blocks, the grouped kernels on dL/dy (see the module docstring)."""
    n, k = shape
    rb = tile_grid(shape, block)[0]  # an expert's block rows in the stacked layout
    arch = arch_of(grad.device)
    # blocks of W_hat^T (K, N): the architecture's, no wider than the padded sides (dense: any block serves)
    pref = ARCH_TABLE[arch].block
    tb = (min(pref[0], max(16, triton.next_power_of_2(k))), min(pref[1], max(16, triton.next_power_of_2(n))))
    wt = transposed_layout(num_experts, shape, tb, grad.dtype, grad.device, name="<experts' W_hat^T>")
    per = -(-num_experts // UNPACK_CHUNKS)
    for first in range(0, num_experts, per):
        count = min(per, num_experts - first)
        w = unpack(_expert_rows(buffers, first * rb, (first + count) * rb), (count * rb * block[0], k), block)
        fill_transposed(wt, w.view(count, rb * block[0], k)[:, :n].to(grad.dtype), first)
        del w  # before the next chunk is unpacked: one chunk at a time
    # split_k 1: the experts' rows fill the GPU together (a training step's backward has many)
    cfg = resolve_config(KernelConfig(split_k=1), wt, grad.shape[0], arch)
    return launch_grouped(grad, offs, kernel_buffers(wt), (k, n), num_experts, tb, wt.per_row, cfg)


@tile_grouped_mm_grad_x.register_fake
def _(grad, offs, dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols, shape, num_experts,
      block):
    return grad.new_empty((grad.shape[0], int(shape[1])))


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:9])
    ctx.shape, ctx.num_experts, ctx.block = inputs[10], inputs[11], inputs[12]


def _backward(ctx, grad: torch.Tensor):
    """Gradients reach x; the experts' weights are frozen (packed copies)."""
    grad_x = torch.ops.patchc.tile_grouped_mm_grad_x(grad.contiguous(), *ctx.saved_tensors, ctx.shape,
                                                     ctx.num_experts, ctx.block)
    return (grad_x, *(None,) * 16)


tile_grouped_mm.register_autograd(_backward, setup_context=_save)  # compiled calls with gradients on


def _check(x: torch.Tensor, offs: torch.Tensor, values: torch.Tensor, name: str, shape: list[int],
           num_experts: int) -> tuple[int, int]:
    """Checks that need no tensor values (also run by the fake kernel); returns (N, K)."""
    n, k = int(shape[0]), int(shape[1])
    where = f"patchc::tile_grouped_mm({name!r})"
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{where}: x must be (S, K={k}), got {tuple(x.shape)}")
    if offs.dim() != 1 or offs.shape[0] != num_experts or offs.is_floating_point():
        raise ValueError(f"{where}: offs must be the ({num_experts},) integer row ends of the experts, got "
                         f"{offs.dtype} {tuple(offs.shape)}")
    if x.dtype != values.dtype:
        raise TypeError(f"{where}: x is {x.dtype} but the packed experts are {values.dtype}; cast the model or x")
    if x.device != values.device or offs.device != x.device:
        raise ValueError(f"{where}: x is on {x.device}, offs on {offs.device}, the packed experts on "
                         f"{values.device}; move them to one device")
    return n, k


class TileGroupedLinear(nn.Module):
    """Every expert slice of one fused MoE weight, stacked: forward(x (S, K) sorted by expert, offs (E,)) ->
    (S, N) through `patchc::tile_grouped_mm`. Experts without a plan keep their weight as dense blocks.

    Example:
        >>> mod = TileGroupedLinear.from_plan(plan, "model.layers.0.mlp.experts.down_proj", w_enk)  # doctest: +SKIP
    """

    bias = None  # experts' biases are added by the caller (per row's expert)

    def __init__(self, stacked: Any, num_experts: int, shape: tuple[int, int], tuning: LayerTuning,
                 dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        bufs, per_row = packed_buffers(stacked, dtype, device)
        for bname, buf in zip(BUFFER_NAMES, bufs):
            self.register_buffer(bname, buf)
        self.name, self.num_experts = stacked.name, int(num_experts)
        self.out_features, self.in_features = shape
        self.block, self.per_row = tuple(stacked.block), tuple(per_row)
        tuning = _grouped_prefill(tuning, stacked, arch_of(device))
        self.decode_buckets, self.prefill_cfg, self.threshold = encode_tuning(tuning)
        self.tuning = tuning

    @classmethod
    def from_plan(cls, plan: Any, fqn: str, weight: torch.Tensor, tuning: LayerTuning | None = None, *,
                  dtype: torch.dtype | None = None, device: Any = None, batch_size: int = 16,
                  prefill_len: int = 128) -> TileGroupedLinear:
        """Pack expert slices ``plan.layers[f"{fqn}.{e}"]`` (the others from `weight` (E, N, K), as the
        slices are multiplied) at `tuning`'s block, or the architecture's block for the first plan tile."""
        num_experts, n, k = weight.shape
        layers = [plan.layers.get(f"{fqn}.{e}") for e in range(num_experts)]
        planned = [lp for lp in layers if lp is not None]
        if not planned:
            raise ValueError(f"{fqn}: no expert slice of this weight is planned ({fqn}.0 ... {fqn}.{num_experts - 1})")
        for e, lp in enumerate(layers):
            if lp is not None and tuple(lp.shape) != (n, k):
                raise ValueError(f"{fqn}.{e}: planned as {tuple(lp.shape)} (N, K) but the weight's slices are {(n, k)}")
        device = torch.device(device) if device is not None else weight.device
        dtype = dtype or weight.dtype
        arch = arch_of(device)
        block = tuple(tuning.block) if tuning is not None else choose_block(tuple(planned[0].tile), arch)
        packed = [pack(lp, block=block, allow_all_dense=True) if lp is not None
                  else pack_dense(weight[e].detach().cpu().to(dtype), block, f"{fqn}.{e}")
                  for e, lp in enumerate(layers)]
        first = next(p for p, lp in zip(packed, layers) if lp is not None)
        tuning = tuning or default_tuning(planned[0], first, batch_size, prefill_len, arch)
        stacked = stack_experts([p if p.dtype == dtype else _cast(p, dtype) for p in packed], name=fqn)
        return cls(stacked, num_experts, (n, k), tuning, dtype, device)

    def op_args(self) -> tuple[Any, ...]:
        """Everything the op takes after x and offs."""
        return (*(getattr(self, b) for b in BUFFER_NAMES), self.name, [self.out_features, self.in_features],
                self.num_experts, list(self.block), list(self.per_row), list(self.decode_buckets),
                list(self.prefill_cfg), self.threshold)

    def warmup(self, rows: Iterable[int]) -> TileGroupedLinear:
        """Run once per row count S (all rows to expert 0), compiling every kernel those S dispatch to (on a
        GPU all of them in parallel first): do it before capturing a CUDA graph."""
        rows = [int(s) for s in rows]
        compile_ahead([self], rows)
        return self._run_each(rows)

    def _run_each(self, rows: list[int]) -> TileGroupedLinear:
        with torch.no_grad():
            for s in rows:
                self(*self._zeros(s))
        return self

    def warmers(self, rows: Iterable[int]) -> list[Callable[[], None]]:
        """One compile-only call (`launch.warm_grouped`) per row count: what `forward` would launch."""
        bufs = tuple(getattr(self, b) for b in BUFFER_NAMES)
        return [functools.partial(warm_grouped, *self._zeros(s), bufs, (self.out_features, self.in_features),
                                  self.num_experts, self.block, self.per_row,
                                  grouped_config(list(self.decode_buckets), list(self.prefill_cfg), self.threshold, s,
                                                 self.num_experts))
                for s in rows]

    def _zeros(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x (S, K) of zeros and offsets sending every row to expert 0."""
        x = torch.zeros(s, self.in_features, dtype=self.values.dtype, device=self.values.device)
        return x, torch.full((self.num_experts,), s, dtype=torch.int32, device=x.device)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.ops.patchc.tile_grouped_mm(x, offs, *self.op_args())

    def extra_repr(self) -> str:
        return (f"{self.name!r}, experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, block={self.block}, threshold={self.threshold}")


def _cast(packed: Any, dtype: torch.dtype) -> Any:
    return replace(packed, dtype=dtype, dense=packed.dense.to(dtype), values=packed.values.to(dtype))


def _grouped_prefill(tuning: LayerTuning, stacked: Any, arch: str) -> LayerTuning:
    """`tuning` (tuned on one expert slice as a single layer), its prefill on the tiled GEMM's default config
    where it chose another route: unpacking every expert's weight for a grouped GEMM would hold E dense weights
    at once, and the decode kernel's win at prefill sizes was timed on one weight, not on E experts' rows."""
    kernel = tuning.prefill.kernel
    if kernel == "prefill":
        return tuning
    why = ("no unpacked route for grouped experts" if kernel == "unpacked"
           else "the decode kernel was timed on one slice")
    prefill = resolve_config(KernelConfig(kernel="prefill"), stacked, ARCH_TABLE[arch].prefill_block_m, arch)
    return replace(tuning, prefill=prefill, prefill_backend="triton",
                   notes=(*tuning.notes, f"prefill: the hybrid GEMM ({why})"))


__all__ = ["TileGroupedLinear", "tile_grouped_mm"]
