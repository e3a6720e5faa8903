"""Split-K added up in the kernel (`kernels.fixup`) against the second launch (`splitk_reduce_kernel`).

Both add the partial sums in split order, so their outputs must be equal bit for bit (not within a
tolerance); both must match a float64 reference within the interpreter tests' tolerances; and the
counters must be back at zero after every launch, or the next launch would finish its tiles early.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():  # CPU-only machine: the interpreter is the only way to run Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from patchc.codegen import KernelConfig, pack, reference_tile_linear, tile_linear
from patchc.codegen import counters as counters_mod
from patchc.codegen import launch as launch_mod
from patchc.codegen.grouped_layout import stack_experts
from patchc.codegen.layout import kernel_buffers
from patchc.codegen.reference import random_layer_plan
from patchc.runtime.candidates import candidates

pytestmark = pytest.mark.interpreter

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=8e-3, atol=1e-2)}


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch):
    """Each test starts without counter buffers (they are per process)."""
    monkeypatch.setattr(counters_mod, "_BUFFERS", {})
    monkeypatch.setattr(counters_mod, "_OUTGROWN", [])


def _kinds_run(monkeypatch) -> list[str]:
    """The kinds of kernel each launch runs, in order."""
    ran, real = [], launch_mod._run

    def spy(kind, *args, **kwargs):
        ran.append(kind)
        return real(kind, *args, **kwargs)

    monkeypatch.setattr(launch_mod, "_run", spy)
    return ran


def _counters_are_zero() -> bool:
    return all(int(buf.abs().sum()) == 0 for buf in counters_mod._BUFFERS.values())


@pytest.mark.parametrize("kernel,m,block_m,split_k,kinds,dtype,bias", [
    ("decode", 1, 1, 3, "mixed", torch.float32, True),  # uneven shares of each row's blocks
    ("decode", 3, 4, 4, "sparse", torch.float16, False),  # all 2:4: no dense loop
    ("decode", 17, 16, 2, "mixed", torch.bfloat16, True),  # two token tiles, the second one row
    ("decode", 5, 16, 7, "rows_no_sparse", torch.float16, True),  # more splits than some rows have blocks
    ("prefill", 40, 16, 3, "mixed", torch.float32, True),
])
def test_fixup_equals_the_reduce_launch_bit_for_bit(kernel, m, block_m, split_k, kinds, dtype, bias, monkeypatch):
    layer = random_layer_plan(70, 200, tile=(16, 16), kinds=kinds, bias=bias, dtype=dtype, seed=split_k)
    packed = pack(layer)  # 70 rows: a partial block row; 200 columns: a ragged K
    x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m)).to(dtype)
    ran = _kinds_run(monkeypatch)
    cfg = KernelConfig(kernel=kernel, block_m=block_m, split_k=split_k)
    fixed = tile_linear(x, packed, config=cfg)  # the table's default: fixup
    assert ran == [kernel] and _counters_are_zero()
    ran.clear()
    launched = tile_linear(x, packed, config=replace(cfg, reduce="launch"))
    assert ran == [kernel, "splitk_reduce"]
    assert torch.equal(fixed, launched)
    torch.testing.assert_close(fixed.double(), reference_tile_linear(x, layer), **TOL[dtype])
    again = tile_linear(x, packed, config=cfg)  # the counters the first launch left serve the next
    assert torch.equal(again, fixed) and _counters_are_zero()


def test_whichever_split_finishes_last_adds_them_all(monkeypatch):
    """On a GPU any split of a tile may finish last; the interpreter runs them in grid order, so the last is
    always the highest. Run the splits (and the block rows) in reverse: the last one in is now split 0,
    and it must still add every split's partial sum, in split order."""
    from triton.runtime.interpreter import InterpreterBuilder

    layer = random_layer_plan(70, 200, tile=(16, 16), kinds="mixed", bias=True, seed=8)
    packed = pack(layer)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(8))
    cfg = KernelConfig(kernel="decode", block_m=4, split_k=5, reduce="fixup")
    want = tile_linear(x, packed, config=replace(cfg, reduce="launch"))
    real, ran = InterpreterBuilder.set_grid_idx, []

    def reversed_order(self, px, py, pz):
        ran.append((self.grid_dim[0] - 1 - px, self.grid_dim[1] - 1 - py))
        return real(self, *ran[-1], pz)

    monkeypatch.setattr(InterpreterBuilder, "set_grid_idx", reversed_order)
    assert torch.equal(tile_linear(x, packed, config=cfg), want) and _counters_are_zero()
    assert ran[:2] == [(4, 4), (4, 3)] and ran[-1] == (0, 0)  # 5 block rows x 5 splits, last to first


def test_fused_experts_fixup_equals_the_reduce_launch(monkeypatch):
    """Grouped decode: programs past the last token tile count in nowhere, and the rows no expert owns
    stay zero (the reduce launch read them from zeroed partial sums)."""
    experts = [random_layer_plan(48, 128, tile=(16, 16), kinds="mixed", seed=e, name=f"w.{e}") for e in range(3)]
    stacked = stack_experts([pack(layer) for layer in experts])
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 gets no rows; rows 7-8 belong to none
    outs = {}
    for reduce in ("fixup", "launch"):
        cfg = KernelConfig("decode", 4, 16, 16, 3, 4, 1, 8, reduce)
        outs[reduce] = launch_mod.launch_grouped(x, offs, kernel_buffers(stacked), (48, 128), 3, stacked.block,
                                                 stacked.per_row, cfg)
        assert _counters_are_zero()
    assert torch.equal(outs["fixup"], outs["launch"])
    want = torch.cat([reference_tile_linear(x[0:2], experts[0]), reference_tile_linear(x[2:7], experts[2]),
                      torch.zeros(2, 48, dtype=torch.float64)])
    torch.testing.assert_close(outs["fixup"].double(), want, **TOL[torch.float32])


def test_counters_grow_outside_capture_and_refuse_to_under_it(monkeypatch):
    """A launch with more tiles than the buffer holds gets a larger one (the old one kept alive for what
    may still point at it); under capture nothing may be allocated, so it asks for the warm-up."""
    monkeypatch.setattr(counters_mod, "MIN_COUNTERS", 4)
    layer = random_layer_plan(80, 128, tile=(16, 16), kinds="mixed", seed=5, name="fc.weight")
    packed = pack(layer)
    cfg = KernelConfig(kernel="decode", block_m=16, split_k=2)
    small = tile_linear(torch.randn(1, 128), packed, config=cfg)  # 5 block rows x 1 token tile
    first = counters_mod._BUFFERS["cpu"]
    assert small.shape == (1, 80) and first.numel() == 5
    x = torch.randn(40, 128)  # 5 x 3 tiles
    monkeypatch.setattr(launch_mod, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"layer 'fc.weight': split-K needs 15 tile counters .*warm-up"):
        tile_linear(x, packed, config=cfg)
    monkeypatch.setattr(launch_mod, "_capturing", lambda: False)
    y = tile_linear(x, packed, config=cfg)
    assert counters_mod._BUFFERS["cpu"].numel() == 15 and counters_mod._OUTGROWN == [first]
    torch.testing.assert_close(y.double(), reference_tile_linear(x, layer), **TOL[torch.float32])
    monkeypatch.setattr(launch_mod, "_capturing", lambda: True)  # warmed up: the same M now runs under capture
    assert torch.equal(tile_linear(x, packed, config=cfg), y) and _counters_are_zero()


def test_split_k_1_and_workspace_lowered_launches_use_no_counters(monkeypatch):
    layer = random_layer_plan(32, 256, tile=(16, 16), kinds="mixed", seed=2)
    x = torch.randn(2, 256)
    tile_linear(x, pack(layer), config=KernelConfig(kernel="decode", block_m=16, split_k=1))
    monkeypatch.setattr(launch_mod, "MAX_WORKSPACE_BYTES", 4 * 2 * 32)  # room for one split: split_k 4 -> 1
    y = tile_linear(x, pack(layer), config=KernelConfig(kernel="decode", block_m=16, split_k=4))
    assert counters_mod._BUFFERS == {}
    torch.testing.assert_close(y.double(), reference_tile_linear(x, layer), **TOL[torch.float32])


def test_tuner_times_both_reductions_for_split_k_only():
    cands = candidates("decode", (4096, 4096), (128, 128), 1, torch.float16, "sm_90")
    split = {c.reduce for c in cands if c.split_k > 1}
    single = {c.reduce for c in cands if c.split_k == 1}
    assert split == {"fixup", "launch"} and single == {"fixup"}  # no duplicate compiles at split_k 1
    assert len([c for c in cands if c.split_k > 1 and c.reduce == "launch"]) == len(
        [c for c in cands if c.split_k > 1 and c.reduce == "fixup"])


def test_reduce_is_validated():
    with pytest.raises(ValueError, match=r"KernelConfig.reduce must be one of \('fixup', 'launch'\)"):
        KernelConfig(reduce="atomic")
