"""What an offline cubin assumes about its launch arguments, and the check a loader runs before launching it.

`generate()` compiles each variant once, for fixed argument dtypes, with a 16-byte divisibility hint on
every pointer (so Triton emits 128-bit loads) and without stride arguments (every buffer is addressed as
a dense row-major array). Launched with a tensor that breaks one of these, a cubin does not fail: it
reads the wrong bytes. `assumptions()` writes them into each variant's manifest entry, derived from the
signature and hints the compile used; `check_launch(entry, **tensors)` refuses tensors that break them.

Example:
    >>> entry = json.load(open("kernels/fc.weight/manifest.json"))["variants"][0]    # doctest: +SKIP
    >>> check_launch(entry, x=x, y=y, bias=bias, dense=packed.dense)                 # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

# Triton pointer element types -> torch dtype names (what the manifest records).
_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "u8": "uint8", "i32": "int32",
                "i64": "int64"}
_ALIGN = 16


def assumptions(arg_names: list[str], signature: dict[str, str], attrs: dict[tuple[int, ...], list],
                consts: dict[str, Any]) -> dict[str, Any]:
    """The launch assumptions of one compiled variant, from the `signature` / `attrs` given to ASTSource.

    `arg_names` are the kernel's parameters (indices in `attrs` point into them).

    Example:
        >>> assumptions(["x_ptr", "M", "HAS_BIAS"], {"x_ptr": "*fp16", "M": "i32"},
        ...             {(0,): [["tt.divisibility", 16]]}, {"HAS_BIAS": False})
        {'aligned_16': ['x_ptr'], 'dtypes': {'x_ptr': 'float16'}, 'bias_dtype': None, 'contiguous': ['x_ptr']}
    """
    pointers = [a for a, t in signature.items() if t.startswith("*")]
    strided = [a for a in signature if "stride" in a]
    if strided:  # the contiguity rule below would be wrong: say which pointers the strides belong to
        raise ValueError(f"kernel takes stride arguments {strided}: teach patchc.codegen.offline which "
                         f"pointers they describe before recording 'contiguous'")
    hinted = {arg_names[idx[0]] for idx, hints in attrs.items() if ["tt.divisibility", _ALIGN] in hints}
    dtypes = {a: _DTYPE_NAMES[signature[a][1:]] for a in pointers}
    return {
        "aligned_16": [a for a in pointers if a in hinted],
        "dtypes": dtypes,
        # read only when HAS_BIAS: a no-bias variant ignores bias_ptr (any valid pointer will do)
        "bias_dtype": dtypes.get("bias_ptr") if consts.get("HAS_BIAS") else None,
        # no stride arguments: the kernel computes every address as for a dense row-major buffer
        "contiguous": list(pointers),
    }


def check_launch(entry: dict[str, Any], **tensors: torch.Tensor | None) -> None:
    """Raise ValueError unless every given tensor meets the variant's recorded assumptions.

    `entry` is one item of a layer manifest's "variants"; tensors are named like the kernel's pointer
    arguments, with or without "_ptr" (x, y, part, bias, dense, vals, meta, dense_rowptr, ...). Checked:
    dtype (the bias against "bias_dtype"), contiguity, 16-byte aligned data_ptr. Reads no tensor data.

    Example:
        >>> check_launch(entry, x=x, y=y, bias=bias)   # doctest: +SKIP
    """
    assumes = entry.get("assumes")
    where = f"offline kernel {entry.get('name', '?')!r} of layer {entry.get('layer', '?')!r}"
    if assumes is None:
        raise ValueError(f"{where}: the manifest entry states no launch assumptions ('assumes'); "
                         f"regenerate the kernels with this patchc (patchc.codegen.generate)")
    known = assumes["dtypes"]
    for name, t in tensors.items():
        arg = name if name in known else f"{name}_ptr"
        if arg not in known:
            raise ValueError(f"{where}: no pointer argument {name!r}; it takes {[a[:-4] for a in known]}")
        _check_one(where, name, arg, t, assumes)


def _check_one(where: str, name: str, arg: str, t: torch.Tensor | None, assumes: dict[str, Any]) -> None:
    if arg == "bias_ptr":
        want = assumes["bias_dtype"]
        if want is None and t is not None:
            raise ValueError(f"{where} was compiled without a bias (HAS_BIAS=False) and would ignore {name}; "
                             f"add the bias after the launch or generate from a plan whose layer has one")
        if want is not None and t is None:
            raise ValueError(f"{where} was compiled with a bias (HAS_BIAS=True): pass {name} ({want})")
    else:
        want = assumes["dtypes"][arg]
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if str(t.dtype) != f"torch.{want}":
        raise ValueError(f"{where}: {name} is {t.dtype}, the cubin was compiled for {want}; "
                         f"cast it ({name}.to(torch.{want}))")
    if arg in assumes["contiguous"] and not t.is_contiguous():
        raise ValueError(f"{where}: {name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
                         f"the cubin addresses it as a dense row-major buffer: pass {name}.contiguous()")
    if arg in assumes["aligned_16"] and t.data_ptr() % _ALIGN:
        raise ValueError(f"{where}: {name} starts {t.data_ptr() % _ALIGN} bytes past a 16-byte boundary; the "
                         f"cubin was compiled assuming 16-byte alignment (128-bit loads): pass {name}.clone() "
                         f"(a fresh allocation is aligned)")
