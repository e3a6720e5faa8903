"""Plain launchers: check inputs, allocate, build the grid, launch (no autotuning, no custom op here).

Example:
    >>> packed = pack(plan, "layers.0.feed_forward.w1.weight")          # doctest: +SKIP
    >>> y = tile_linear(x, packed.to("cuda"))                             # doctest: +SKIP
    >>> y = tile_linear(x, packed, config=KernelConfig(kernel="decode", split_k=4))  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
import triton

from patchc.codegen import kernels
from patchc.codegen.configs import KernelConfig, arch_of, resolve_config
from patchc.codegen.counters import counters
from patchc.codegen.interpreter import reuse_launch_patches, skip_unasserted_overflow_checks
from patchc.codegen.layout import PackedLayer, kernel_buffers, per_row_counts
from patchc.codegen.specialise import constexprs, fixes_up, grid_of

if kernels.INTERPRETED.value:  # on a CPU: helper calls stop re-patching Triton's language (a third of the time),
    reuse_launch_patches()    # and integer ops stop computing overflow checks no assert reads (40% of the rest)
    skip_unasserted_overflow_checks()

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCE_BLOCK = 1024
MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions y and z
# Split-K keeps (split_k, M, N) fp32 partial sums; at prefill M that reaches GBs. Large M fills the GPU
# without splitting K, so the launcher lowers split_k to keep the workspace within this bound.
MAX_WORKSPACE_BYTES = 64 * 1024 * 1024

def workspace_split_k(split_k: int, m: int, n: int) -> int:
    """The split_k launched for an (M, N) output: `split_k`, lowered until the fp32 workspace fits
    MAX_WORKSPACE_BYTES (1 = no workspace). Shapes only: safe under CUDA-graph capture.

    Example:
        >>> workspace_split_k(8, 16, 4096)
        8
        >>> workspace_split_k(2, 8192, 4096)  # one split alone is 128 MiB
        1
    """
    per_split = 4 * max(1, m) * max(1, n)
    return max(1, min(split_k, MAX_WORKSPACE_BYTES // per_split))


def tile_linear(
    x: torch.Tensor,
    packed: PackedLayer,
    bias: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """y = x @ (W*M)^T (+ bias) with the hybrid dense / 2:4 kernels; x (..., K) -> (..., N) in x's dtype.

    `bias` defaults to the packed layer's own bias (from the plan), if any. `config` (KernelConfig)
    overrides the architecture defaults; with None the decode kernel serves small M and the prefill
    kernel large M. fp16 / bf16 / fp32 inputs, fp32 accumulation.

    Example:
        >>> y = tile_linear(torch.randn(3, 64), pack(plan, "fc.weight"))   # doctest: +SKIP
    """
    n, k = packed.shape
    where = f"tile_linear({packed.name!r})"
    if x.shape[-1] != k:
        raise ValueError(f"{where}: x has {x.shape[-1]} features, the layer expects K={k}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{where}: x dtype {x.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    if x.dtype != packed.dtype:
        raise TypeError(f"{where}: x is {x.dtype} but the layer was packed as {packed.dtype}; cast one of them")
    if x.device != packed.device:
        raise ValueError(f"{where}: x is on {x.device}, the packed weights on {packed.device}; use packed.to(...)")
    bias = packed.bias if bias is None else bias
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise ValueError(f"{where}: bias must have shape ({n},), got {tuple(bias.shape)}")
        bias = bias.to(device=x.device).contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n))
    cfg = resolve_config(config, packed, x2.shape[0], arch_of(x.device))
    y = launch(x2, kernel_buffers(packed), bias, packed.shape, packed.block, per_row_counts(packed), cfg,
               name=packed.name)
    return y.reshape(*lead, n)


def launch(
    x2: torch.Tensor,
    buffers: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
    shape: tuple[int, int],
    block: tuple[int, int],
    per_row: tuple[int, int],
    cfg: KernelConfig,
    *,
    name: str | None = None,
) -> torch.Tensor:
    """Allocate, build the grid and launch for a contiguous (M, K) x and a resolved config; returns (M, N).
    A config of kernel "unpacked" unpacks W * M (`unpack`) and hands it to F.linear (cuBLAS).

    Takes the packed layer as its seven tensors plus ints fixed at pack time, and never reads a
    tensor value on the host: the custom op calls it under CUDA-graph capture. `cfg.split_k` is lowered
    where its workspace would exceed MAX_WORKSPACE_BYTES (`workspace_split_k`). A kernel never run in
    this process raises under capture instead of compiling (`name`, the layer, goes into that error).

    Example:
        >>> y = launch(x2, kernel_buffers(packed), None, packed.shape, packed.block,
        ...            per_row_counts(packed), KernelConfig(kernel="decode"))   # doctest: +SKIP
    """
    n, m = shape[0], x2.shape[0]
    where = f"layer {name!r}" if name else f"layer of shape (N={n}, K={shape[1]})"
    if cfg.kernel == "unpacked":  # W * M unpacked on the device, then cuBLAS (`unpack_kernel`)
        return F.linear(x2, unpack(buffers, shape, block, num_warps=cfg.num_warps, name=name), bias)
    kernel, grid, cfg, y, part, consts, args = _prepare_layer(x2, buffers, bias, shape, block, per_row, cfg, where)
    _check_grid(grid, cfg, m)
    _run(cfg.kernel, kernel, grid, args, consts, where, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _reduce(part, y, bias, cfg, where)
    return y


def warm(
    x2: torch.Tensor,
    buffers: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
    shape: tuple[int, int],
    block: tuple[int, int],
    per_row: tuple[int, int],
    cfg: KernelConfig,
) -> None:
    """Compile what `launch` with these arguments would run, without running it (Triton's `warmup`): under
    Triton's AsyncCompileMode the compiles of many configs then run in parallel threads (the tuner).
    A no-op under the interpreter, which compiles nothing."""
    if cfg.kernel == "unpacked":  # compiled for the output's dtype and alignment: a small one will do
        kernel, grid, args, consts = _prepare_unpack(buffers, shape, block, (16,))
        return _warm(kernel, grid, replace(cfg, num_stages=1), args[0], None, consts, args, None)  # as `unpack` runs
    _warm(*_prepare_layer(x2, buffers, bias, shape, block, per_row, cfg), bias)


def unpack(buffers: tuple[torch.Tensor, ...], shape: tuple[int, int], block: tuple[int, int], *,
           num_warps: int = 4, name: str | None = None) -> torch.Tensor:
    """W * M (N, K) in the packed values' dtype, unpacked from the seven buffers on their device by
    `unpack_kernel.unpack_kernel` (reads no tensor value on the host: CUDA-graph safe).

    Example:
        >>> w = unpack(kernel_buffers(packed), packed.shape, packed.block)   # doctest: +SKIP
    """
    kernel, grid, args, consts = _prepare_unpack(buffers, shape, block)
    where = f"layer {name!r}" if name else f"layer of shape (N={shape[0]}, K={shape[1]})"
    _run("unpack", kernel, grid, args, consts, where, num_warps=num_warps, num_stages=1)
    return args[0]


def _prepare_unpack(buffers: tuple[torch.Tensor, ...], shape: tuple[int, int], block: tuple[int, int],
                    out_shape: tuple[int, ...] | None = None):
    """(kernel, grid, arguments with the output ((N, K); `out_shape` to compile only) first, constexprs)."""
    from patchc.codegen.unpack_kernel import constexprs as unpack_constexprs, unpack_grid, unpack_kernel

    dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols = buffers
    like = values if sparse_cols.numel() else dense
    out = torch.empty(out_shape or shape, dtype=like.dtype, device=like.device)
    args = [out, _or_dummy(dense, like), _or_dummy(values, like), _or_dummy(meta, like, torch.uint8), dense_rowptr,
            _or_dummy(dense_cols, like, torch.int32), sparse_rowptr, _or_dummy(sparse_cols, like, torch.int32)]
    consts = unpack_constexprs(shape, block, dense_cols.numel() > 0, sparse_cols.numel() > 0)
    return unpack_kernel, unpack_grid(shape, block), args, consts


def _prepare_layer(x2: torch.Tensor, buffers: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
                   shape: tuple[int, int], block: tuple[int, int], per_row: tuple[int, int], cfg: KernelConfig,
                   where: str = "a layer"):
    """(kernel, grid, config, y, split-K workspace or None, constexprs, arguments) of a single-layer launch."""
    m = x2.shape[0]
    cfg, y, part, consts, args = _prepare(x2, buffers, bias, shape, block, per_row, cfg, False, 0, where)
    return kernels.KERNELS[cfg.kernel], grid_of(cfg, math.ceil(shape[0] / block[0]), m), cfg, y, part, consts, [*args, m]


def _warm(kernel: Any, grid: tuple[int, ...], cfg: KernelConfig, y: torch.Tensor, part: torch.Tensor | None,
          consts: dict[str, Any], args: list[Any], bias: torch.Tensor | None) -> None:
    """Compile the kernel and split-K reduce a prepared launch runs (`_prepare_layer`, `_prepare_grouped`),
    without running them; nothing under the interpreter."""
    if not isinstance(kernel, triton.runtime.JITFunction):
        return
    kernel.warmup(*args, grid=grid, **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if part is not None and not consts["FIXUP"]:
        m, n = y.shape
        kernels.splitk_reduce_kernel.warmup(part, y, _or_dummy(bias, y), m, grid=(1,), N=n, SPLIT_K=cfg.split_k,
                                            HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK)


def launch_grouped(
    x2: torch.Tensor,
    offs: torch.Tensor,
    buffers: tuple[torch.Tensor, ...],
    shape: tuple[int, int],
    num_experts: int,
    block: tuple[int, int],
    per_row: tuple[int, int],
    cfg: KernelConfig,
    *,
    name: str | None = None,
) -> torch.Tensor:
    """`launch` for fused experts: rows ``offs[e-1]:offs[e]`` of the contiguous (S, K) x times expert e's
    (N, K) slice of the stacked buffers (`grouped_layout.stack_experts`); rows past ``offs[-1]`` are zeros.

    The kernels read `offs` on the device: nothing here reads a tensor value on the host (CUDA-graph safe).

    Example:
        >>> y = launch_grouped(x2, offs, kernel_buffers(stacked), (n, k), 8, stacked.block, stacked.per_row,
        ...                    KernelConfig("decode", 16, 64, 64, 1, 4, 1, 8))   # doctest: +SKIP
    """
    n, s = shape[0], x2.shape[0]
    where = f"experts {name!r}" if name else f"experts of shape (N={n}, K={shape[1]})"
    kernel, grid, cfg, y, part, consts, args = _prepare_grouped(x2, offs, buffers, shape, num_experts, block,
                                                                per_row, cfg, where)
    _check_grid(grid, cfg, s)
    _run(f"grouped_{cfg.kernel}", kernel, grid, args, consts, where, num_warps=cfg.num_warps,
         num_stages=cfg.num_stages)
    _reduce(part, y, None, cfg, where)
    return y


def warm_grouped(
    x2: torch.Tensor,
    offs: torch.Tensor,
    buffers: tuple[torch.Tensor, ...],
    shape: tuple[int, int],
    num_experts: int,
    block: tuple[int, int],
    per_row: tuple[int, int],
    cfg: KernelConfig,
) -> None:
    """`warm` for `launch_grouped`: compile what it would run with these arguments, without running it."""
    _warm(*_prepare_grouped(x2, offs, buffers, shape, num_experts, block, per_row, cfg), None)


def _prepare_grouped(x2: torch.Tensor, offs: torch.Tensor, buffers: tuple[torch.Tensor, ...], shape: tuple[int, int],
                     num_experts: int, block: tuple[int, int], per_row: tuple[int, int], cfg: KernelConfig,
                     where: str = "experts"):
    """(kernel, grid, config, y, split-K workspace or None, constexprs, arguments) of a grouped launch."""
    from patchc.codegen import grouped_kernels

    n, s = shape[0], x2.shape[0]
    # zeros: rows no expert owns stay zero in the output (and, for a reduce launch, in the partial sums)
    cfg, y, part, consts, args = _prepare(x2, buffers, None, shape, block, per_row, cfg, True, num_experts, where)
    consts.update(NUM_EXPERTS=num_experts, EXPERTS_P2=grouped_kernels.experts_pow2(num_experts))
    tiles = math.ceil(s / cfg.block_m) + num_experts  # token tiles: an upper bound for any routing
    rows = math.ceil(n / block[0])
    grid = (rows, cfg.split_k, tiles) if cfg.kernel == "decode" else (tiles * rows, cfg.split_k)
    return grouped_kernels.GROUPED_KERNELS[cfg.kernel], grid, cfg, y, part, consts, [*args, offs, s]


def _prepare(x2: torch.Tensor, buffers: tuple[torch.Tensor, ...], bias: torch.Tensor | None, shape: tuple[int, int],
             block: tuple[int, int], per_row: tuple[int, int], cfg: KernelConfig, zeros: bool, extra_tiles: int,
             where: str):
    """(config with split_k fitted to the workspace bound, y, split-K workspace or None, constexprs, the
    kernel's pointer arguments): what both launchers allocate and pass. The grids hold ceil(N / BN) x
    (ceil(M / BM) + extra_tiles) output tiles (`extra_tiles`: the experts' token tiles bound)."""
    dense, values, meta, dense_rowptr, dense_cols, sparse_rowptr, sparse_cols = buffers
    n, m = shape[0], x2.shape[0]
    if cfg.kernel == "prefill" and cfg.block_m < 16:
        raise ValueError(f"prefill config needs block_m >= 16 (tl.dot), got {cfg.block_m}")
    split_k = workspace_split_k(cfg.split_k, m, n)
    if split_k != cfg.split_k:
        cfg = replace(cfg, split_k=split_k)
    alloc = torch.zeros if zeros else torch.empty
    y = alloc((m, n), dtype=x2.dtype, device=x2.device)
    # the reduce launch adds every row of the partial sums; the fixup only the rows its programs wrote
    alloc = torch.zeros if zeros and not fixes_up(cfg) else torch.empty
    part = alloc((cfg.split_k, m, n), dtype=torch.float32, device=x2.device) if cfg.split_k > 1 else None
    consts = constexprs(shape, block, per_row, dense_cols.shape[0] > 0, sparse_cols.shape[0] > 0, cfg, x2.dtype,
                        bias is not None)
    count = None
    if consts["FIXUP"]:
        tiles = math.ceil(n / block[0]) * (math.ceil(m / cfg.block_m) + extra_tiles)
        count = counters(x2.device, tiles, _capturing(), where)
    args = [
        x2, y, _or_dummy(part, x2, torch.float32), _or_dummy(count, x2, torch.int32), _or_dummy(bias, x2),
        _or_dummy(dense, x2),
        _or_dummy(values, x2), _or_dummy(meta, x2, torch.uint8), dense_rowptr,
        _or_dummy(dense_cols, x2, torch.int32), sparse_rowptr, _or_dummy(sparse_cols, x2, torch.int32),
    ]
    return cfg, y, part, consts, args


def _check_grid(grid: tuple[int, ...], cfg: KernelConfig, m: int) -> None:
    if max(grid[1:]) > MAX_GRID_YZ:
        raise ValueError(f"launch grid {grid} exceeds the GPU's {MAX_GRID_YZ} programs on axes 1-2 "
                         f"(split_k={cfg.split_k}, M={m}, block_m={cfg.block_m}); use a smaller split_k or a larger block_m")


def _reduce(part: torch.Tensor | None, y: torch.Tensor, bias: torch.Tensor | None, cfg: KernelConfig, where: str) -> None:
    """y = the splits' partial sums (+ bias), in split order, when the kernel ran with split-K and left them."""
    if part is None or fixes_up(cfg):
        return
    m, n = y.shape
    _run("splitk_reduce", kernels.splitk_reduce_kernel, (triton.cdiv(m * n, REDUCE_BLOCK),),
         [part, y, _or_dummy(bias, y), m], {"N": n, "SPLIT_K": cfg.split_k, "HAS_BIAS": bias is not None,
                                             "BLOCK": REDUCE_BLOCK}, where)


# Keys of the kernels launched so far in this process: Triton has compiled and loaded those, so they can
# also be launched while a CUDA graph is captured (a first compile + module load then fails in the driver).
_LAUNCHED: set[tuple[Any, ...]] = set()


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (tests patch this on CPU)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _spec(arg: Any) -> tuple[Any, ...]:
    """What Triton compiles a runtime argument into: a tensor's dtype and 16-byte alignment; an int's
    being 1, its divisibility by 16 and whether it fits i32 (a data_ptr is an attribute: no sync)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return (arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31)


_WARMUP_HINT = {"grouped": "TileGroupedLinear.warmup(rows) (rows: tokens x experts per token)",
                "*": "TileLinear.warmup(ms) / patchc.runtime.warmup(model, ms)"}


def _run(kind: str, kernel: Any, grid: tuple[int, ...], args: list[Any], consts: dict[str, Any], where: str,
         **options: Any) -> None:
    """Launch `kernel`, refusing under CUDA-graph capture when this compiled variant never ran here."""
    key = (kind, str(args[0].device), tuple(_spec(a) for a in args), tuple(sorted(consts.items())),
           tuple(sorted(options.items())))
    if key not in _LAUNCHED and _capturing():
        m = f"M={args[-1]} " if isinstance(args[-1], int) else ""  # the token count, last of the hybrid kernels' args
        raise RuntimeError(
            f"{where}: {m}needs a {kind} kernel variant that has not run in this process, and the current "
            f"CUDA stream is capturing a graph (compiling and loading a kernel during capture fails with an "
            f"opaque CUDA error). Run the model once with the same M outside capture (warm-up) before "
            f"capturing, or call {_WARMUP_HINT.get(kind.split('_')[0], _WARMUP_HINT['*'])} for every M you capture."
        )
    kernel[grid](*args, **consts, **options)
    _LAUNCHED.add(key)


def _or_dummy(t: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Kernels need a valid pointer even for an unused or empty buffer (never dereferenced then)."""
    if t is not None and t.numel() > 0:
        return t
    return torch.empty(16, dtype=dtype or like.dtype, device=like.device)
