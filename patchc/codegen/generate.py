"""Offline kernel generation: per layer, specialised Triton source + PTX + cubin + a JSON manifest.

Compiles with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``: no GPU is needed.
Layout of `out_dir`::

    out_dir/manifest.json                      index: target, versions, layers -> manifest / route
    out_dir/<layer>/manifest.json              args, constexprs, grid rule, M range, files per variant
    out_dir/<layer>/<variant>.py               the kernel source + the constexprs that specialise it
    out_dir/<layer>/<variant>.ptx|.cubin       compiled for the target
    (each variant's manifest entry carries its static profile: registers, spill bytes, SASS instruction mix,
     and per weight loop its instructions, barriers and warp-instructions per weight byte)
    (variant = decode_m1, decode_m4, decode, prefill, unpack, and splitk_reduce_s<S> when a variant splits K
     and leaves its partial sums to a second launch; one that adds them itself (FIXUP) needs "counters";
     unpack writes W * M (N, K) for `F.linear`: the other prefill route, which the runtime times against
     the prefill variant at the prefill M, keeping the faster)
    (each variant's "assumes": the argument dtypes, bias dtype, 16-byte aligned and contiguous pointers it
     was compiled for; a loader checks its tensors with `patchc.codegen.offline.check_launch` first)

All-dense layers get no kernel (route "F.linear": cuBLAS is the right kernel for them).

Speed: a layer's kernels depend on its layout and specialisation only, never on weight values, so
generation reads the layout (`pack_skeleton`, no weight copies) and compiles each distinct
specialisation once (`compile_pool`: layers of equal shape and block counts share one compile, in
parallel worker processes); every layer still gets its own files, byte-identical to those a generate of
that layer alone writes. Each variant's "compile_key" says which ones share; the index's "kernels" counts
variants and distinct compiles. FP fusion is requested explicitly ("compile_options", per variant
"fp_fusion").

Example:
    >>> files = generate(plan, "kernels/", target="sm_90")   # doctest: +SKIP
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import inspect
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import triton

from patchc.codegen import kernels, unpack_kernel
from patchc.codegen.compile_pool import (CompiledKernel, CompileJob, compile_all, kernel_function, pointer_hints,
                                         worker_count)
from patchc.codegen.configs import ARCH_TABLE, KernelConfig, choose_block, normalize_target, resolve_config, variants
from patchc.codegen.launch import REDUCE_BLOCK
from patchc.codegen.layout import PackedLayer
from patchc.codegen.offline import assumptions
from patchc.codegen.sass import target_misses
from patchc.codegen.summary import summary
from patchc.codegen.skeleton import pack_skeleton
from patchc.codegen.specialise import GRID_RULES, fixes_up, specialisation
from patchc.codegen.specialise import signature as kernel_signature
from patchc.utils.files import write_bytes_atomic
from patchc.utils.progress import progress

MANIFEST_FORMAT = "patchc.kernels"
MANIFEST_VERSION = 1
_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_UNPACK_ROUTE = ("prefill, instead of the prefill variant: out = W * M, then y = F.linear(x, out, bias) (cuBLAS); "
                 "time both at the prefill M on the GPU and keep the faster, as patchc's tuner does")


def generate(
    plan: Any,
    out_dir: str | os.PathLike,
    target: str = "sm_90",
    *,
    block: tuple[int, int] | None = None,
    layers: list[str] | None = None,
    workers: int | None = None,
    show_progress: bool = True,
    fp_fusion: bool = True,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Compile every planned layer's kernels for `target` ("sm_80" or "sm_90") into `out_dir`.

    `block` overrides the per-architecture block choice (it must divide each layer's tile);
    `layers` restricts generation to those FQNs. Each distinct specialisation compiles once (layers that
    share one get identical files), in `workers` processes (default: the CPU count; 1 = this process);
    the files do not depend on the worker count. `fp_fusion` is Triton's `enable_fp_fusion` (fused
    multiply-adds; the kernels are tuned with it on), recorded in every manifest. `dtype`: the weights'
    dtype the kernels are compiled for (default: the plan's; a plan pruned on a CPU is fp32, which a GPU
    serves in bf16 or fp16). Progress bars on
    stderr unless `show_progress=False`. Returns the written files (the index manifest last).

    Example:
        >>> files = generate(plan, "kernels/", target="sm_80", workers=2)   # doctest: +SKIP
        >>> [f.name for f in files if f.suffix == ".ptx"]                  # doctest: +SKIP
    """
    worker_count(workers)  # a bad count is refused before the folder is made
    _require_compiler()
    arch = normalize_target(target)
    cc = int(arch.split("_")[1])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = _header(arch, cc, fp_fusion)  # one timestamp for every manifest of this run
    index: dict[str, Any] = {}
    planned: list[tuple[PackedLayer, list[tuple[Any, CompileJob]]]] = []
    names = list(plan.layers) if layers is None else list(layers)
    unknown = [fqn for fqn in names if fqn not in plan.layers]
    if unknown:
        raise KeyError(f"generate(layers=...): {unknown[:4]} not in the plan; planned layers include "
                       f"{list(plan.layers)[:4]}")
    for fqn in names:
        layer = plan.layers[fqn]
        if bool((layer.kinds == 0).all()):
            index[fqn] = {"route": "F.linear", "reason": "all tiles dense: cuBLAS is the right kernel"}
            continue
        # generation reads the layout only: packing the weights (GBs for a 7B model) would buy nothing
        skel = pack_skeleton(plan, fqn, block=block or choose_block(tuple(layer.tile), arch), dtype=dtype)
        planned.append((skel, _layer_jobs(skel, arch, cc, fp_fusion)))
    users: dict[CompileJob, list[str]] = {}
    for skel, jobs in planned:
        for item, job in jobs:
            users.setdefault(job, []).append(f"layer {skel.name!r} ({_stem(item)})")
    compiled = compile_all(users, workers, show_progress=show_progress)
    written: list[Path] = []
    for skel, jobs in progress(planned, desc="writing layers", unit="layer", disable=not show_progress):
        layer_dir = out / _safe_name(skel.name)
        manifest, files = _write_layer(skel, jobs, compiled, layer_dir, header)
        written += files
        index[skel.name] = {"route": "patchc", "manifest": str(Path(layer_dir.name) / "manifest.json"),
                            "variants": [v["name"] for v in manifest["variants"]]}
    index = {fqn: index[fqn] for fqn in names}  # plan order, whichever route a layer took
    skipped = dict(getattr(plan, "skipped", {}) or {})
    kernels_made = {"variants": sum(len(jobs) for _, jobs in planned), "compiled": len(compiled)}
    top = header | {"kernels": kernels_made, "layers": index, "skipped": skipped}
    written.append(_write_text(out / "manifest.json", json.dumps(top, indent=2)))
    return written


def serving_dtype(plan: Any, name: str = "auto") -> torch.dtype | None:
    """The `dtype` to generate a plan's kernels for, by name: "auto" serves an fp32 plan (pruned on a CPU)
    in bf16 and any other in its own dtype (None); else the named torch dtype.

    Example:
        >>> serving_dtype(TilePlan.load("runs/stories260K/plan.patch"))      # doctest: +SKIP
        torch.bfloat16
    """
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if {layer.dtype for layer in plan.layers.values()} == {torch.float32} else None


def _layer_jobs(packed: PackedLayer, arch: str, cc: int, fp_fusion: bool) -> list[tuple[Any, CompileJob]]:
    """(variant or split count, job) per kernel of a layer: its variants, then one reduction per split_k."""
    dtype = packed.dtype
    has_bias = packed.bias is not None
    signature = tuple(kernel_signature(_TRITON_TYPES[dtype]).items())
    jobs: list[tuple[Any, CompileJob]] = []
    splits: set[int] = set()
    for var in variants(arch):
        cfg = resolve_config(KernelConfig(kernel=var.kernel, block_m=var.block_m), packed, var.rep_m, arch)
        consts = tuple(specialisation(packed, cfg, dtype, has_bias).items())
        jobs.append(((var, cfg), CompileJob(var.kernel, signature, consts, cfg.num_warps, cfg.num_stages, cc,
                                            fp_fusion)))
        if cfg.split_k > 1 and not fixes_up(cfg):
            splits.add(cfg.split_k)
    t = _TRITON_TYPES[dtype]
    unpack_consts = unpack_kernel.constexprs(packed.shape, packed.block, packed.n_dense > 0, packed.n_sparse > 0)
    jobs.append(("unpack", CompileJob("unpack", unpack_kernel.signature(t), tuple(unpack_consts.items()), 4, 1, cc,
                                      fp_fusion)))
    reduce_sig = (("part_ptr", "*fp32"), ("y_ptr", f"*{t}"), ("bias_ptr", f"*{t}"), ("M", "i32"), ("N", "i32"))
    for s in sorted(splits):
        consts = (("SPLIT_K", s), ("HAS_BIAS", has_bias), ("BLOCK", REDUCE_BLOCK))
        jobs.append((s, CompileJob("splitk_reduce", reduce_sig, consts, 4, 1, cc, fp_fusion)))
    return jobs


def _stem(item: Any) -> str:
    """File stem of a layer's kernel: the variant name, "unpack", or splitk_reduce_s<S> for a reduction."""
    return f"splitk_reduce_s{item}" if isinstance(item, int) else item if isinstance(item, str) else item[0].name


def _write_layer(packed: PackedLayer, jobs: list[tuple[Any, CompileJob]], compiled: dict[CompileJob, CompiledKernel],
                 layer_dir: Path, header: dict[str, Any]) -> tuple[dict[str, Any], list[Path]]:
    files: list[Path] = []
    entries = []
    for item, job in jobs:
        stem = _stem(item)
        entry, new = _write_kernel(job, compiled[job], layer_dir, stem)
        files += new
        if isinstance(item, int):
            entry.update(name=stem, layer=packed.name, kernel="splitk_reduce", grid=GRID_RULES["splitk_reduce"])
        elif item == "unpack":
            entry.update(name=stem, layer=packed.name, kernel="unpack", grid=unpack_kernel.GRID_RULE,
                         output={"shape": list(packed.shape), "dtype": str(packed.dtype).replace("torch.", "")},
                         serves=_UNPACK_ROUTE)
        else:
            var, cfg = item
            # the weight loops' cost: warp-instructions per weight byte decide whether decode can be memory bound
            entry["loops"] = compiled[job].loops
            entry.update(
                name=var.name,
                layer=packed.name,
                kernel=var.kernel,
                m_min=var.m_min,
                m_max=var.m_max,
                grid=GRID_RULES[var.kernel],
                split_k=cfg.split_k,
                # the kernel to launch after this one, if its partial sums are left to one
                reduce=f"splitk_reduce_s{cfg.split_k}" if cfg.split_k > 1 and not fixes_up(cfg) else None,
            )
            if fixes_up(cfg):
                entry["counters"] = _COUNTERS
            if var.kernel == "decode":  # the decode issue's static targets (sass.LOOP_TARGETS): what it misses
                entry["target_misses"] = target_misses(var.m_min, entry["loops"], entry.get("profile"))
        entries.append(entry)
    dtype = packed.dtype
    manifest = header | {
        "layer": packed.name,
        "shape": list(packed.shape),
        "block": list(packed.block),
        "dtype": str(dtype).replace("torch.", ""),
        "has_bias": packed.bias is not None,
        "n_dense": packed.n_dense,
        "n_sparse": packed.n_sparse,
        "dense_per_row": packed.dense_per_row,
        "sparse_per_row": packed.sparse_per_row,
        "weight_bytes": packed.weight_bytes,
        "dense_bytes": packed.dense_bytes,
        "pack": f"patchc.codegen.pack(plan, {packed.name!r}, block={tuple(packed.block)})",
        "buffers": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                    for k, v in packed.tensors().items()},
        "variants": entries,
    }
    files.append(_write_text(layer_dir / "manifest.json", json.dumps(manifest, indent=2)))
    return manifest, files


def _write_kernel(job: CompileJob, kernel: CompiledKernel, layer_dir: Path, stem: str) -> tuple[dict[str, Any], list[Path]]:
    """One compiled kernel's files in a layer folder and its manifest entry (without the layer's fields)."""
    fn = kernel_function(job.kernel)
    signature = dict(job.signature)
    consts = dict(job.constexprs)
    sig = signature | {name: "constexpr" for name in consts}
    files = [
        _write_text(layer_dir / f"{stem}.py", _specialised_source(fn, sig, consts, job.options, stem)),
        _write_text(layer_dir / f"{stem}.ptx", kernel.ptx),
        _write_bytes(layer_dir / f"{stem}.cubin", kernel.cubin),
    ]
    entry = {
        "function": fn.__name__,
        "entry": kernel.entry,
        "args": [{"name": a, "type": t} for a, t in signature.items()],
        "constexprs": consts,
        # what the cubin takes for granted about its tensors, from the signature and hints compiled in
        "assumes": assumptions(fn.arg_names, signature, pointer_hints(fn.arg_names, signature), consts),
        "num_warps": job.num_warps,
        "num_stages": job.num_stages,
        "fp_fusion": kernel.fp_fusion,
        # equal keys = one compile shared by several layers / variants (identical files)
        "compile_key": job.key[:16],
        "shared_bytes": kernel.shared_bytes,
        "files": {f.suffix.lstrip("."): f.name for f in files},
        "cubin_sha256": hashlib.sha256(kernel.cubin).hexdigest(),
        # registers, spills and the SASS instruction mix: the first things to look at when it is slow
        "profile": kernel.profile,
    }
    return entry, files


# What count_ptr must hold for a variant that adds its split-K partial sums itself (`kernels.fixup`).
_COUNTERS = {"arg": "count_ptr", "dtype": "int32", "length": "at least cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M)",
             "values": "zeros before each launch; the kernel leaves them zero, so one buffer serves a stream's "
                       "launches one after another (not two at once)"}


def _specialised_source(fn, sig, consts, options, stem: str) -> str:
    """The kernels module (self-contained: every helper it calls; with the unpack kernel appended for it)
    + the bindings that specialise it."""
    body = _kernels_source(fn.__name__ == unpack_kernel.unpack_kernel.__name__)
    return (
        f"{body}\n\n# ---- specialisation (generated by patchc.codegen.generate: {stem}) ----\n"
        f"KERNEL = {fn.__name__}\n"
        f"SIGNATURE = {json.dumps(sig, indent=4)}\n"
        f"CONSTEXPRS = {json.dumps(consts, indent=4)}\n"
        f"OPTIONS = {json.dumps(options)}\n"
        "# recompile: triton.compile(ASTSource(KERNEL, SIGNATURE, CONSTEXPRS), target=..., options=OPTIONS)\n"
    ).replace(": true", ": True").replace(": false", ": False").replace(": null", ": None")


@lru_cache(maxsize=2)
def _kernels_source(with_unpack: bool = False) -> str:
    body = inspect.getsource(kernels)
    if not with_unpack:
        return body
    # its imports of the helpers defined above go, and the __future__ import that may only open a file
    drop = r"^from (patchc\.codegen\.kernels|__future__) import .*$\n"
    extra = re.sub(drop, "", inspect.getsource(unpack_kernel), flags=re.M)
    return f"{body}\n\n# ---- patchc/codegen/unpack_kernel.py ----\n{extra}"


def _header(arch: str, cc: int, fp_fusion: bool) -> dict[str, Any]:
    import patchc

    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "target": arch,
        "gpu_target": {"backend": "cuda", "arch": cc, "warp_size": 32},
        "triton": triton.__version__,
        "torch": torch.__version__,
        "patchc": getattr(patchc, "__version__", "?"),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "arch_defaults": ARCH_TABLE[arch].__dict__ | {"block": list(ARCH_TABLE[arch].block)},
        # requested triton.compile options beyond warps / stages (each variant records what it got)
        "compile_options": {"enable_fp_fusion": fp_fusion},
    }


def _require_compiler() -> None:
    if not isinstance(kernels.decode_kernel, triton.runtime.JITFunction):
        raise RuntimeError(
            "patchc.codegen.generate compiles GPU binaries and cannot run while TRITON_INTERPRET=1 "
            "(the kernels were imported as interpreted functions); unset TRITON_INTERPRET in a fresh process"
        )


def _safe_name(fqn: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", fqn)


def _write_text(path: Path, text: str) -> Path:
    return _write_bytes(path, text.encode("utf-8"))


def _write_bytes(path: Path, data: bytes) -> Path:
    return write_bytes_atomic(path, data)


__all__ = ["generate", "serving_dtype", "summary"]  # summary: patchc.codegen.summary, what `patchc generate` prints
