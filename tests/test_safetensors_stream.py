"""patchc.utils.safetensors_stream: a file written one tensor at a time is an ordinary safetensors file.

Checked against safetensors' own reader, bit for bit, for every dtype the writer names; misuse (a tensor out
of order, of another dtype or shape, missing or extra) is refused naming the file and the tensor."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from patchc.utils.safetensors_stream import DTYPES, StreamError, header_bytes, write_streamed


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def layout_of(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def test_every_dtype_reads_back_bit_for_bit(tmp_path):
    shapes = [(3, 5), (7,), (2, 3, 4), (0, 4), ()]
    tensors = {f"t{i}.{str(d).removeprefix('torch.')}": sample(d, shapes[i % len(shapes)], i)
               for i, d in enumerate(DTYPES)}
    tensors["strided"] = torch.arange(24, dtype=torch.float32).view(4, 6).t()  # not contiguous
    path = tmp_path / "x.safetensors"
    size = write_streamed(path, layout_of(tensors), iter(tensors.items()), {"format": "pt", "k": "v"})
    assert size == path.stat().st_size
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(got.view(torch.uint8) if got.numel() and got.dim() else got,
                               t.contiguous().view(torch.uint8) if t.numel() and t.dim() else t), name
    head_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert head_len % 8 == 0, "header padded to 8 bytes, as safetensors' own writer does"


def test_same_data_as_safetensors_own_writer(tmp_path):
    tensors = {"a": sample(torch.bfloat16, (5, 3), 0), "b": sample(torch.uint8, (4, 2), 1),
               "c": sample(torch.float16, (9,), 2)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_streamed(ours, layout_of(tensors), iter(tensors.items()))
    save_file(tensors, str(theirs))
    a, b = load_file(str(ours)), load_file(str(theirs))
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in tensors)
    assert ours.stat().st_size == theirs.stat().st_size  # same data bytes, same padded header length


def test_the_writer_keeps_no_tensor_it_has_written(tmp_path):
    """When the producer builds tensor i, none of the earlier ones is referenced any more: a generator that
    builds each tensor as it is asked for holds one at a time."""
    import weakref

    layout = {f"t{i}": (torch.float32, (256,)) for i in range(4)}
    written: list[weakref.ref] = []
    alive_at_build = []

    def produce():
        for i in range(4):
            alive_at_build.append(sum(r() is not None for r in written))
            t = torch.full((256,), float(i))
            written.append(weakref.ref(t))
            yield f"t{i}", t
            del t

    write_streamed(tmp_path / "x.safetensors", layout, produce())
    assert alive_at_build == [0, 0, 0, 0]
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["t3"], torch.full((256,), 3.0))


@pytest.mark.parametrize("case, message", [
    ("order", "tensor 'b' came where 'a' was declared"),
    ("dtype", "tensor 'a' is torch.float16 (2, 2); the header declared torch.float32 (2, 2)"),
    ("shape", "tensor 'a' is torch.float32 (2, 3); the header declared torch.float32 (2, 2)"),
    ("missing", "tensor 'b' was declared but never given"),
    ("extra", "tensor 'c' was not declared"),
])
def test_misuse_names_the_file_and_the_tensor(tmp_path, case, message):
    layout = {"a": (torch.float32, (2, 2)), "b": (torch.float32, (3,))}
    a, b = torch.zeros(2, 2), torch.zeros(3)
    given = {
        "order": [("b", b), ("a", a)],
        "dtype": [("a", a.half()), ("b", b)],
        "shape": [("a", torch.zeros(2, 3)), ("b", b)],
        "missing": [("a", a)],
        "extra": [("a", a), ("b", b), ("c", b)],
    }[case]
    path = tmp_path / "x.safetensors"
    with pytest.raises(StreamError) as e:
        write_streamed(path, layout, iter(given))
    assert str(path) in str(e.value) and message in str(e.value)


def test_a_dtype_without_a_safetensors_name_is_refused():
    with pytest.raises(StreamError, match="complex64 has no safetensors name"):
        header_bytes({"z": (torch.complex64, (2,))})
