"""Offline kernel generation: per layer, specialised Triton source + PTX + cubin + a JSON manifest.

Compiles with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``: no GPU is needed.
Layout of `out_dir`::

    out_dir/manifest.json                      index: target, versions, layers -> manifest / route
    out_dir/<layer>/manifest.json              args, constexprs, grid rule, M range, files per variant
    out_dir/<layer>/<variant>.py               the kernel source + the constexprs that specialise it
    out_dir/<layer>/<variant>.ptx|.cubin       compiled for the target
    (each variant's manifest entry carries its static profile: registers, spill bytes, SASS instruction mix,
     and per weight loop its instructions, barriers and warp-instructions per weight byte)
    (variant = decode_m1, decode_m4, decode, prefill, and splitk_reduce_s<S> when a variant splits K)
    (each variant's "assumes": the argument dtypes, bias dtype, 16-byte aligned and contiguous pointers it
     was compiled for; a loader checks its tensors with `patchc.codegen.offline.check_launch` first)

All-dense layers get no kernel (route "F.linear": cuBLAS is the right kernel for them).

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
from pathlib import Path
from typing import Any

import torch
import triton

from patchc.codegen import kernels
from patchc.codegen.configs import ARCH_TABLE, KernelConfig, choose_block, normalize_target, resolve_config, variants
from patchc.codegen.launch import GRID_RULES, KERNEL_ARGS, REDUCE_BLOCK, specialisation
from patchc.codegen.layout import PackedLayer, pack
from patchc.codegen.offline import assumptions
from patchc.codegen.sass import disassemble, static_profile, weight_loops
from patchc.utils.files import write_bytes_atomic

MANIFEST_FORMAT = "patchc.kernels"
MANIFEST_VERSION = 1
_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def generate(
    plan: Any,
    out_dir: str | os.PathLike,
    target: str = "sm_90",
    *,
    block: tuple[int, int] | None = None,
    layers: list[str] | None = None,
) -> list[Path]:
    """Compile every planned layer's kernels for `target` ("sm_80" or "sm_90") into `out_dir`.

    `block` overrides the per-architecture block choice (it must divide each layer's tile);
    `layers` restricts generation to those FQNs. Returns the written files (the index manifest last).

    Example:
        >>> files = generate(plan, "kernels/", target="sm_80")   # doctest: +SKIP
        >>> [f.name for f in files if f.suffix == ".ptx"]        # doctest: +SKIP
    """
    _require_compiler()
    arch = normalize_target(target)
    cc = int(arch.split("_")[1])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    index: dict[str, Any] = {}
    names = list(plan.layers) if layers is None else layers
    for fqn in names:
        layer = plan.layers[fqn]
        blk = block or choose_block(tuple(layer.tile), arch)
        if bool((layer.kinds == 0).all()):
            index[fqn] = {"route": "F.linear", "reason": "all tiles dense: cuBLAS is the right kernel"}
            continue
        packed = pack(plan, fqn, block=blk)
        layer_dir = out / _safe_name(fqn)
        layer_dir.mkdir(parents=True, exist_ok=True)
        manifest, files = _generate_layer(packed, layer_dir, arch, cc)
        written += files
        index[fqn] = {"route": "patchc", "manifest": str(Path(layer_dir.name) / "manifest.json")}
        index[fqn]["variants"] = [v["name"] for v in manifest["variants"]]
    skipped = dict(getattr(plan, "skipped", {}) or {})
    header = _header(arch, cc) | {"layers": index, "skipped": skipped}
    written.append(_write_text(out / "manifest.json", json.dumps(header, indent=2)))
    return written


def summary(out_dir: str | os.PathLike) -> str:
    """Per variant, over every generated layer: the worst weight-loop cost and what limits it.

    Warp-instructions per weight byte of the dense and 2:4 loops (an H100 stops being memory bound above
    ~0.28), barriers per iteration, registers and spill bytes; "-" where the code has no such loop.

    Example:
        >>> print(summary("kernels/"))                                    # doctest: +SKIP
        variant     layers  warps  regs  spills  dense w-instr/B  2:4 w-instr/B  barriers
        decode_m1       35      4    64       0            0.045          0.132         2
    """
    out = Path(out_dir)
    index = json.loads((out / "manifest.json").read_text())
    rows: dict[str, dict[str, Any]] = {}
    for entry in index["layers"].values():
        if entry.get("route") != "patchc":
            continue
        for v in json.loads((out / entry["manifest"]).read_text())["variants"]:
            if v["kernel"] == "splitk_reduce":
                continue
            r = rows.setdefault(v["name"], {"layers": 0, "warps": set(), "regs": 0, "spills": 0, "dense": None,
                                            "2:4": None, "barriers": 0})
            r["layers"] += 1
            r["warps"].add(v["num_warps"])
            prof = v.get("profile") or {}
            r["regs"] = max(r["regs"], prof.get("registers", 0))
            r["spills"] += prof.get("spill_bytes", 0)
            for lp in v.get("loops") or []:
                r[lp["loop"]] = max(r[lp["loop"]] or 0.0, lp["warp_instr_per_byte"])
                r["barriers"] = max(r["barriers"], lp["barriers"])
    head = f"{'variant':<10} {'layers':>6} {'warps':>6} {'regs':>5} {'spills':>7} {'dense w-instr/B':>16} {'2:4 w-instr/B':>14} {'barriers':>9}"
    lines = [head]
    for name, r in rows.items():
        cost = {k: "-" if r[k] is None else f"{r[k]:.3f}" for k in ("dense", "2:4")}
        warps = "/".join(map(str, sorted(r["warps"])))
        lines.append(f"{name:<10} {r['layers']:>6} {warps:>6} {r['regs']:>5} {r['spills']:>7} {cost['dense']:>16} "
                     f"{cost['2:4']:>14} {r['barriers']:>9}")
    return "\n".join(lines)


def _generate_layer(packed: PackedLayer, layer_dir: Path, arch: str, cc: int) -> tuple[dict[str, Any], list[Path]]:
    dtype = packed.dtype
    has_bias = packed.bias is not None
    files: list[Path] = []
    entries = []
    reduce_splits: set[int] = set()
    for var in variants(arch):
        cfg = resolve_config(KernelConfig(kernel=var.kernel, block_m=var.block_m), packed, var.rep_m, arch)
        consts = specialisation(packed, cfg, dtype, has_bias)
        fn = kernels.KERNELS[var.kernel]
        signature = _signature(dtype)
        entry, new, sass = _compile_one(fn, signature, consts, cfg.num_warps, cfg.num_stages, layer_dir, var.name, cc)
        files += new
        # the weight loops' cost: warp-instructions per weight byte decide whether decode can be memory bound
        entry["loops"] = weight_loops(sass, consts["HAS_DENSE"], consts["HAS_SPARSE"], packed.block, dtype.itemsize,
                                      cfg.num_warps)
        entry.update(
            name=var.name,
            layer=packed.name,
            kernel=var.kernel,
            m_min=var.m_min,
            m_max=var.m_max,
            grid=GRID_RULES[var.kernel],
            split_k=cfg.split_k,
            reduce=f"splitk_reduce_s{cfg.split_k}" if cfg.split_k > 1 else None,
        )
        entries.append(entry)
        if cfg.split_k > 1:
            reduce_splits.add(cfg.split_k)
    for s in sorted(reduce_splits):
        consts = {"SPLIT_K": s, "HAS_BIAS": has_bias, "BLOCK": REDUCE_BLOCK}
        signature = {"part_ptr": "*fp32", "y_ptr": f"*{_TRITON_TYPES[dtype]}",
                     "bias_ptr": f"*{_TRITON_TYPES[dtype]}", "M": "i32", "N": "i32"}
        entry, new, _ = _compile_one(kernels.splitk_reduce_kernel, signature, consts, 4, 1, layer_dir,
                                     f"splitk_reduce_s{s}", cc)
        entry.update(name=f"splitk_reduce_s{s}", layer=packed.name, kernel="splitk_reduce",
                     grid=GRID_RULES["splitk_reduce"])
        entries.append(entry)
        files += new
    manifest = _header(arch, cc) | {
        "layer": packed.name,
        "shape": list(packed.shape),
        "block": list(packed.block),
        "dtype": str(dtype).replace("torch.", ""),
        "has_bias": has_bias,
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


def _compile_one(fn, signature, consts, num_warps, num_stages, layer_dir: Path, stem: str, cc: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({name: "constexpr" for name in consts})
    # every pointer is 16-byte aligned (torch allocations; packed blocks are multiples of 16 bytes):
    # the hint lets Triton vectorise the block loads to 128 bits
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    except Exception as exc:  # name the file being generated: compiler errors are long
        raise RuntimeError(f"compiling {layer_dir.name}/{stem} for sm_{cc} failed: {exc}") from exc
    cubin = _write_bytes(layer_dir / f"{stem}.cubin", compiled.asm["cubin"])
    files = [
        _write_text(layer_dir / f"{stem}.py", _specialised_source(fn, sig, consts, options, stem)),
        _write_text(layer_dir / f"{stem}.ptx", compiled.asm["ptx"]),
        cubin,
    ]
    meta = compiled.metadata
    sass = disassemble(cubin)  # once: the profile and the caller's loop costs both read it
    entry = {
        "function": fn.__name__,
        "entry": getattr(meta, "name", fn.__name__),
        "args": [{"name": a, "type": t} for a, t in signature.items()],
        "constexprs": consts,
        # what the cubin takes for granted about its tensors, from the signature and hints compiled in
        "assumes": assumptions(fn.arg_names, signature, attrs, consts),
        "num_warps": num_warps,
        "num_stages": num_stages,
        "shared_bytes": int(getattr(meta, "shared", 0) or 0),
        "files": {f.suffix.lstrip("."): f.name for f in files},
        "cubin_sha256": hashlib.sha256(compiled.asm["cubin"]).hexdigest(),
        # registers, spills and the SASS instruction mix: the first things to look at when it is slow
        "profile": static_profile(cubin, sass),
    }
    return entry, files, sass


def _signature(dtype: torch.dtype) -> dict[str, str]:
    t = _TRITON_TYPES[dtype]
    types = {
        "x_ptr": f"*{t}", "y_ptr": f"*{t}", "part_ptr": "*fp32", "bias_ptr": f"*{t}",
        "dense_ptr": f"*{t}", "vals_ptr": f"*{t}", "meta_ptr": "*u8",
        "dense_rowptr_ptr": "*i32", "dense_cols_ptr": "*i32", "sparse_rowptr_ptr": "*i32", "sparse_cols_ptr": "*i32",
        "M": "i32",
    }
    assert tuple(types) == KERNEL_ARGS
    return types


def _specialised_source(fn, sig, consts, options, stem: str) -> str:
    """The kernels module (self-contained: every helper it calls) + the bindings that specialise it."""
    body = inspect.getsource(kernels)
    return (
        f"{body}\n\n# ---- specialisation (generated by patchc.codegen.generate: {stem}) ----\n"
        f"KERNEL = {fn.__name__}\n"
        f"SIGNATURE = {json.dumps(sig, indent=4)}\n"
        f"CONSTEXPRS = {json.dumps(consts, indent=4)}\n"
        f"OPTIONS = {json.dumps(options)}\n"
        "# recompile: triton.compile(ASTSource(KERNEL, SIGNATURE, CONSTEXPRS), target=..., options=OPTIONS)\n"
    ).replace(": true", ": True").replace(": false", ": False").replace(": null", ": None")


def _header(arch: str, cc: int) -> dict[str, Any]:
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
