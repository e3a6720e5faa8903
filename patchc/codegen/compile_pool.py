"""Offline compiles, each distinct one once, in parallel worker processes.

A compiled kernel's bytes depend only on what `triton.compile` is given: the kernel, the runtime
argument types (dtype-only; the CSR rowptr / cols and the weights are pointer arguments, not constants),
the 16-byte pointer hints (fixed: every pointer gets one), the constexprs that `specialisation` derives
from a layer (N, K, block sizes, blocks per row when uniform, HAS_DENSE / HAS_SPARSE / HAS_BIAS,
SPLIT_K, ...), num_warps / num_stages, the target and the FP-fusion switch. `CompileJob` holds exactly
these, so layers whose jobs compare equal share one compile (and one SASS profile): a 7B model's 224
layers have a handful of distinct shapes. `compile_all` runs the distinct jobs in a pool of spawned
processes (spawn, not fork: a forked child inherits torch's thread pools and Triton's state mid-use),
or in this process for one worker, and names the layers of a job that fails.

Example:
    >>> done = compile_all({job: ["fc.weight/decode_m1"]}, workers=2)   # doctest: +SKIP
    >>> done[job].cubin[:4]                                               # doctest: +SKIP
    b'\\x7fELF'
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from patchc.utils.progress import progress

KERNEL_NAMES = ("decode", "prefill", "splitk_reduce", "grouped_decode", "grouped_prefill", "unpack")
_ALIGN_HINT = ["tt.divisibility", 16]
_ELEM_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
_ERROR_CHARS = 3000  # Triton's compiler errors quote whole kernels: keep the end, where the cause is


class CompileError(RuntimeError):
    """A kernel failed to compile; the message names the layers and variants that needed it."""


@dataclass(frozen=True)
class CompileJob:
    """Everything that decides a compiled kernel's bytes: equal jobs compile to identical files.

    `signature` maps runtime arguments to Triton types, `constexprs` the specialising constants (both as
    ordered pairs, in kernel-argument order, so the manifest lists them as before).

    Example:
        >>> job = CompileJob("splitk_reduce", (("part_ptr", "*fp32"), ("M", "i32")),
        ...                  (("SPLIT_K", 2),), num_warps=4, num_stages=1, cc=90)
        >>> job == CompileJob(**job.__dict__), job.options["enable_fp_fusion"]
        (True, True)
    """

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    cc: int
    fp_fusion: bool = True

    def __post_init__(self) -> None:
        if self.kernel not in KERNEL_NAMES:
            raise ValueError(f"CompileJob.kernel must be one of {KERNEL_NAMES}, got {self.kernel!r}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"CompileJob.num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"CompileJob.num_stages must be >= 1, got {self.num_stages}")
        if not isinstance(self.cc, int) or self.cc < 70:
            raise ValueError(f"CompileJob.cc must be a compute capability like 80 or 90, got {self.cc!r}")

    @property
    def options(self) -> dict[str, Any]:
        """The `triton.compile` options, FP fusion set explicitly (Triton 3.9 warns when it is left unset)."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, "enable_fp_fusion": self.fp_fusion}

    @property
    def key(self) -> str:
        """sha256 of the job: the same for every layer that shares this compile (recorded in manifests)."""
        text = json.dumps([self.kernel, self.signature, self.constexprs, self.options, self.cc])
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class CompiledKernel:
    """What one compile produced: PTX, cubin, launch metadata and the static profile of its SASS."""

    entry: str  # the cubin's kernel symbol
    ptx: str
    cubin: bytes
    shared_bytes: int
    fp_fusion: bool  # as compiled (TRITON_FORCE_DISABLE_FP_FUSION can override the request)
    profile: dict[str, Any] | None  # registers, spills, instruction mix (None without cuobjdump); + unpack's cost
    loops: list[dict] | None  # weight-loop costs of decode / prefill kernels (None for the reduction)


def kernel_function(name: str) -> Any:
    """The @triton.jit function of a kernel name (`KERNEL_NAMES`; "grouped_*": fused MoE experts; "unpack":
    W * M unpacked for cuBLAS)."""
    from patchc.codegen import grouped_kernels, kernels, unpack_kernel

    if name == "unpack":
        return unpack_kernel.unpack_kernel
    if name.startswith("grouped_"):
        return grouped_kernels.GROUPED_KERNELS[name.removeprefix("grouped_")]
    return kernels.splitk_reduce_kernel if name == "splitk_reduce" else kernels.KERNELS[name]


def pointer_hints(arg_names: Sequence[str], signature: Mapping[str, str]) -> dict[tuple[int, ...], list]:
    """ASTSource attrs: every pointer 16-byte aligned (torch allocations and packed blocks are), so Triton
    vectorises the block loads to 128 bits."""
    return {(list(arg_names).index(a),): [list(_ALIGN_HINT)] for a, t in signature.items() if t.startswith("*")}


def compile_job(job: CompileJob) -> CompiledKernel:
    """Compile one job for its target (no GPU needed) and profile the cubin; raises what Triton raises.

    Example:
        >>> compile_job(job).entry   # doctest: +SKIP
        'decode_kernel'
    """
    return profile_all({job: _compile(job)})[job]


def _compile(job: CompileJob) -> CompiledKernel:
    """`triton.compile` of one job; the kernel's profile and loops are left to `profile_all`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_function(job.kernel)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("the kernels were imported as interpreted functions (TRITON_INTERPRET=1 in this "
                           "process's environment): unset it to compile")
    signature = dict(job.signature)
    consts = dict(job.constexprs)
    sig = signature | {name: "constexpr" for name in consts}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=pointer_hints(fn.arg_names, signature))
    compiled = triton.compile(src, target=GPUTarget("cuda", job.cc, 32), options=job.options)
    meta = compiled.metadata
    return CompiledKernel(
        entry=getattr(meta, "name", fn.__name__),
        ptx=compiled.asm["ptx"],
        cubin=compiled.asm["cubin"],
        shared_bytes=int(getattr(meta, "shared", 0) or 0),
        fp_fusion=bool(getattr(meta, "enable_fp_fusion", job.fp_fusion)),
        profile=None,
        loops=None,
    )


def profile_all(kernels: Mapping[CompileJob, CompiledKernel]) -> dict[CompileJob, CompiledKernel]:
    """Each kernel with its static profile and weight-loop costs, the SASS of all read together
    (`patchc.codegen.sass.disassemble_many`: one disassembler call per target, not one per kernel)."""
    from patchc.codegen import unpack_kernel
    from patchc.codegen.sass import disassemble_many, static_profile, weight_loops

    with tempfile.TemporaryDirectory(prefix="patchc-sass-") as tmp:  # the NVIDIA tools read files only
        # named by kernel, target and job key: a tool's error names the compile it was reading
        paths = [Path(tmp) / f"{job.kernel}_sm{job.cc}_{job.key[:12]}.cubin" for job in kernels]
        for path, kernel in zip(paths, kernels.values()):
            path.write_bytes(kernel.cubin)
        sasses = disassemble_many(paths)
        profiles = [static_profile(path, sass) for path, sass in zip(paths, sasses)]
    done = {}
    for (job, kernel), sass, profile in zip(kernels.items(), sasses, profiles):
        loops = None
        consts = dict(job.constexprs)
        block = (consts.get("BLOCK_N"), consts.get("BLOCK_K"))
        if job.kernel == "unpack" and profile is not None and sass is not None:  # no loop: one block a program
            elem = _ELEM_BYTES[dict(job.signature)["out_ptr"].lstrip("*")]
            profile = profile | unpack_kernel.code_cost(sass, elem, block, job.num_warps)
        elif job.kernel not in ("splitk_reduce", "unpack"):
            elem = _ELEM_BYTES[dict(job.signature)["x_ptr"].lstrip("*")]
            block_m = consts["BLOCK_M"] if job.kernel.endswith("prefill") else None  # bound by compute: per FLOP
            loops = weight_loops(sass, consts["HAS_DENSE"], consts["HAS_SPARSE"], block, elem, job.num_warps, block_m)
        done[job] = replace(kernel, profile=profile, loops=loops)
    return done


def compile_all(
    jobs: Mapping[CompileJob, Sequence[str]],
    workers: int | None = None,
    *,
    show_progress: bool = True,
) -> dict[CompileJob, CompiledKernel]:
    """Compile every job once; `jobs` maps each to the "layer/variant" labels that need it (for errors).

    `workers` processes (default: the CPUs this process may use; never more than there are jobs); 1, or a
    daemon caller, compiles in this process. The result does not depend on the worker count or on completion order.

    Example:
        >>> compile_all({job: ["fc.weight/decode"]}, workers=1, show_progress=False)   # doctest: +SKIP
    """
    todo = list(jobs)
    n = min(worker_count(workers), len(todo))
    bar = dict(total=len(todo), desc=f"compiling {len(todo)} kernels", unit="kernel", disable=not show_progress)
    if n <= 1 or multiprocessing.current_process().daemon:  # a daemon (a pool worker itself) may not fork
        return profile_all({job: _unwrap(job, _try_compile(job), jobs) for job in progress(todo, **bar)})
    done: dict[CompileJob, CompiledKernel] = {}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_init_worker) as pool:
        with _main_not_rerun():  # the workers start during these submits
            futures = {pool.submit(_try_compile, job): job for job in todo}
        try:
            for fut in progress(as_completed(futures), **bar):
                job = futures[fut]
                try:
                    outcome = fut.result()
                except BrokenProcessPool as exc:  # a worker died (killed, out of memory, crashed in C++)
                    outcome = f"the worker process died ({exc})"
                done[job] = _unwrap(job, outcome, jobs)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # do not keep compiling for a failed generate
            raise
    return profile_all({job: done[job] for job in todo})


def worker_count(workers: int | None) -> int:
    """`workers`, checked (ValueError unless a positive int), or the CPUs this process may use for None."""
    if workers is None:  # the CPUs this process may run on (a container's share, not the host's count)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int (processes compiling in parallel), got {workers!r}")
    return workers


@contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Spawned processes re-run the parent's __main__ script, unless it looks like it has none. Workers need
    nothing from it (jobs are data, the worker function lives here), and a script calling generate()
    without an `if __name__ == "__main__":` guard would otherwise kill every worker at start."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _init_worker() -> None:
    """Worker start: one torch thread (compiles are Triton/ptxas work; N workers x N threads oversubscribe)."""
    import torch

    torch.set_num_threads(1)


def _try_compile(job: CompileJob) -> CompiledKernel | str:
    """`_compile`, with a failure returned as text: Triton's exceptions do not all survive pickling."""
    try:
        return _compile(job)
    except Exception as exc:  # noqa: BLE001 - reported with the layer names by the caller
        return f"{type(exc).__name__}: {exc}"[-_ERROR_CHARS:]


def _unwrap(job: CompileJob, outcome: CompiledKernel | str, jobs: Mapping[CompileJob, Sequence[str]]) -> CompiledKernel:
    if isinstance(outcome, CompiledKernel):
        return outcome
    users = list(jobs[job])
    shown = ", ".join(users[1:4]) + (", ..." if len(users) > 4 else "")
    more = f" (needed as well by {len(users) - 1} more: {shown})" if len(users) > 1 else ""
    raise CompileError(f"compiling {users[0] if users else job.kernel} for sm_{job.cc} failed{more}: {outcome}")


__all__ = ["CompileError", "CompileJob", "CompiledKernel", "compile_all", "compile_job", "kernel_function",
           "pointer_hints", "profile_all", "worker_count"]
