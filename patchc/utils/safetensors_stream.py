"""A safetensors file written one tensor at a time, so a file larger than memory can be written.

`safetensors.torch.save_file` takes every tensor at once and copies each into bytes before writing: a
model's worth of memory on top of the model. Here the caller declares every tensor's dtype and shape up
front (the header comes first in the file), then hands the tensors over one by one, in that order; each
is written as it comes and can be freed. What is written is an ordinary safetensors file (`safe_open`
reads it), its header padded to 8 bytes as safetensors' own writer does.

Example:
    >>> layout = {"a": (torch.float16, (2, 3)), "b": (torch.uint8, (4,))}
    >>> write_streamed("x.safetensors", layout, iter([("a", a), ("b", b)]), {"format": "pt"})
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping

import torch

Layout = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]

# safetensors' dtype names (its spec); the element sizes come from torch
DTYPES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64", torch.uint64: "U64", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class StreamError(ValueError):
    """A tensor that does not match the declared layout (name, order, dtype or shape); names the file."""


def header_bytes(layout: Layout, metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and the JSON header (offsets in layout order), padded with spaces to 8 bytes."""
    head: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape) in layout.items():
        if dtype not in DTYPES:
            raise StreamError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        size = dtype.itemsize
        for s in shape:
            size *= int(s)
        head[name] = {"dtype": DTYPES[dtype], "shape": [int(s) for s in shape], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_streamed(path: str | os.PathLike, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]],
                   metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` ((name, tensor) pairs, in `layout`'s order, each of its declared dtype and shape) to
    `path` as one safetensors file; returns the bytes written. Holds one tensor at a time: a generator
    that builds each tensor as it is asked for keeps memory at one tensor.

    Raises StreamError naming the file and the tensor on a missing, extra, reordered or misshapen tensor
    (the file is then incomplete: write it in a temporary place, as `atomic_path` does).
    """
    expected = iter(layout.items())
    with open(path, "wb") as f:
        f.write(header_bytes(layout, metadata))
        for name, t in tensors:
            want = next(expected, None)
            if want is None:
                raise StreamError(f"{path}: tensor {name!r} was not declared (the layout has no more tensors)")
            want_name, (dtype, shape) = want
            if name != want_name:
                raise StreamError(f"{path}: tensor {name!r} came where {want_name!r} was declared")
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise StreamError(f"{path}: tensor {name!r} is {t.dtype} {tuple(t.shape)}; the header declared "
                                  f"{dtype} {tuple(shape)}")
            if t.numel():
                # little-endian bytes of a contiguous CPU copy, viewed without another copy
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t  # held by nobody here while the producer builds the next one
        missing = next(expected, None)
        if missing is not None:
            raise StreamError(f"{path}: tensor {missing[0]!r} was declared but never given")
        return f.tell()


__all__ = ["DTYPES", "StreamError", "header_bytes", "write_streamed"]
