"""The fused mask step as one compiled C loop per direction on the CPU (`native_mask.c`).

`patchc.masking.fused` states the step as torch ops: about 10 passes over the (groups, 6) logits each
way, which on a CPU costs more than the model's own GEMMs. `torch.compile` of the same functions still
ran at ~10 ns per logit. This module compiles `native_mask.c` (plain C, OpenMP, no torch headers:
~9 s with the system's C compiler) into `$PATCHC_CACHE_DIR/native/` once per source and machine,
and runs forward and backward as one pass each, from the same Gumbel windows as the torch path.
Where no C compiler works, `available()` is False and the torch path runs (one warning).

Layouts: a contiguous (N, K) weight in fp32 or bf16, fp32 logits (groups, 6) or scores (groups, 4),
the fp32 (Tn, Tk) tile mask; fp64 (the reference tests) and other dtypes use the torch path.

Example:
    >>> if available():
    ...     g = fused.gumbel(key, (w.numel() // 4, 6), 0, "cpu")
    ...     out, sq = native_masked_weight(w, logits, p_tiles, g, (16, 16), kappa=100.0, tau=1.0)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from patchc.utils.files import atomic_path, cache_root

SOURCE = Path(__file__).with_name("native_mask.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
_ENV = "PATCHC_NATIVE_MASK"  # "0" turns the native step off (the torch path runs)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str) -> Path:
    """The shared library for this source, flags and machine, compiled once (atomically) and reused."""
    text = SOURCE.read_bytes()
    tag = hashlib.sha256(text + " ".join((cc, *FLAGS, platform.machine(), platform.node())).encode()).hexdigest()[:16]
    lib = cache_root() / "native" / f"native_mask-{tag}.so"
    if not lib.exists():
        with atomic_path(lib) as tmp:
            res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
            if res.returncode:
                raise OSError(f"{cc} could not build {SOURCE.name}: {res.stderr.strip()[-400:]}")
    return lib


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    if os.environ.get(_ENV) == "0":
        return None
    cc = _compiler()
    try:
        if cc is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        lib = ctypes.CDLL(str(_build(cc)))
    except OSError as e:
        warnings.warn(f"patchc: the native CPU mask step is unavailable ({e}); mask training uses the slower "
                      f"torch path. Install a C compiler with OpenMP (e.g. gcc), or set {_ENV}=0 to silence this.",
                      stacklevel=3)
        return None
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.mask_forward.argtypes = [p, i32, p, i32, p, p, p, i64, i64, i64, i64, f32, f32, i32, p, p, i32]
    lib.mask_backward.argtypes = [p, f32, p, i32, p, i32, p, p, p, i64, i64, i64, i64, f32, f32, i32, p, p, i32]
    lib.mask_forward.restype = lib.mask_backward.restype = None
    return lib


def available() -> bool:
    """True when the compiled step can run here (compiles it on first call)."""
    return _library() is not None


def supports(w: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether `native_masked_weight` takes these tensors (CPU, contiguous, fp32/bf16 W, fp32 logits)."""
    return (w.device.type == "cpu" and logits.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and logits.dtype in (torch.float32, torch.bool) and w.is_contiguous() and logits.is_contiguous()
            and available())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _NativeMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, logits, mt, g, dims, kappa, tau, flags):  # noqa: D401 - autograd signature
        n, k, b1, b2 = dims
        hard, frozen = flags
        out = torch.empty_like(w)
        sq = ctypes.c_double(0.0)
        mt_c = None if mt is None else mt.detach().contiguous()
        _library().mask_forward(
            _ptr(w), int(w.dtype == torch.bfloat16), None if frozen else _ptr(logits), logits.shape[-1],
            _ptr(logits) if frozen else None, None if frozen else _ptr(g), _ptr(mt_c), n, k, b1, b2, kappa, tau,
            int(hard), _ptr(out), ctypes.addressof(sq), torch.get_num_threads())
        ctx.save_for_backward(w, logits, mt_c, g)
        ctx.args = (dims, kappa, tau, flags)
        return out, torch.tensor(sq.value, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out, grad_sq):
        w, logits, mt, g = ctx.saved_tensors
        (n, k, b1, b2), kappa, tau, (hard, frozen) = ctx.args
        want_logits = not frozen  # the C loop writes them whenever it samples
        want_mt = mt is not None and ctx.needs_input_grad[2]
        d_logits = torch.empty_like(logits) if want_logits else None
        d_mt = torch.empty_like(mt) if want_mt else None
        if want_logits or want_mt:
            _library().mask_backward(
                _ptr(grad_out.contiguous()), float(grad_sq), _ptr(w), int(w.dtype == torch.bfloat16),
                None if frozen else _ptr(logits), logits.shape[-1], _ptr(logits) if frozen else None,
                None if frozen else _ptr(g), _ptr(mt), n, k, b1, b2, kappa, tau, int(hard), _ptr(d_logits), _ptr(d_mt),
                torch.get_num_threads())
        return None, d_logits if ctx.needs_input_grad[1] else None, d_mt, None, None, None, None, None


def native_masked_weight(w: torch.Tensor, logits: torch.Tensor, mt: torch.Tensor | None, g: torch.Tensor | None,
                         tile: tuple[int, int], kappa: float, tau: float, hard: bool = False, frozen: bool = False):
    """(W * M in W's dtype, ||W * M||^2 as a 0-d fp32 tensor) of one draw, with gradients to `logits` and `mt`.

    Args:
        w: (N, K) contiguous weight (frozen); logits: (N*K/4, 6) pattern logits or (N*K/4, 4) scores, or
            the bool (N, K) keep mask when `frozen` (tile-only); mt: (Tn, Tk) fp32 tile mask or None;
        g: (N*K/4, 6) fp32 Gumbel noise of this draw (`fused.gumbel`), None when frozen.
    """
    n, k = w.shape
    if g is not None and not g.is_contiguous():
        raise ValueError(f"native_masked_weight: Gumbel noise must be contiguous, got strides {g.stride()}")
    return _NativeMask.apply(w.detach(), logits, mt, g, (n, k, *tile), float(kappa), float(tau), (hard, frozen))


__all__ = ["available", "supports", "native_masked_weight"]
