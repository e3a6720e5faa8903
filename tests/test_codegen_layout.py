"""Structure of the packed layout: counts, CSR, alignment, exact round trip to the plan."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from patchc.codegen import PackError, pack, packed_to_dense
from patchc.codegen.configs import ARCH_TABLE, KernelConfig, choose_block, groups_per_load, normalize_target, resolve_config
from patchc.codegen.reference import layerplan_to_dense, random_layer_plan, random_tile_plan


@pytest.mark.parametrize("tile,block", [((16, 16), None), ((64, 32), (16, 16)), ((64, 64), (32, 16)), ((128, 128), (64, 128))])
@pytest.mark.parametrize("preset", ["mixed", "sparse", "rows_no_dense", "rows_no_sparse"])
def test_pack_structure_and_round_trip(tile, block, preset):
    n, k = 2 * tile[0] + 5, 3 * tile[1] - 4  # partial edge tiles on both sides
    layer = random_layer_plan(n, k, tile=tile, kinds=preset, bias=True, seed=2)
    p = pack(layer, block=block)
    bn, bk = p.block
    assert p.block == (block or tile)
    rb, cb = -(-n // bn), -(-k // bk)
    assert p.grid == (rb, cb) and tuple(p.kinds.shape) == (rb, cb)
    # counts: every block of the padded grid is stored exactly once, in its kind's buffer
    assert p.n_dense == int((p.kinds == 0).sum()) and p.n_sparse == int((p.kinds == 1).sum())
    assert p.dense.shape == (p.n_dense, bn, bk)
    assert p.values.shape == (p.n_sparse, bn, bk // 2)
    assert p.meta.shape == (p.n_sparse, bn, bk // 8) and p.meta.dtype == torch.uint8
    for rowptr, cols, kind in [(p.dense_rowptr, p.dense_cols, 0), (p.sparse_rowptr, p.sparse_cols, 1)]:
        assert rowptr.dtype == torch.int32 and cols.dtype == torch.int32
        assert rowptr[0] == 0 and rowptr[-1] == cols.numel() and bool((rowptr.diff() >= 0).all())
        for r in range(rb):  # CSR order: row-major, columns increasing, matching the kinds grid
            got = cols[rowptr[r] : rowptr[r + 1]].tolist()
            assert got == torch.nonzero(p.kinds[r] == kind).flatten().tolist()
    # 16-byte alignment of every block (128-bit vector loads)
    for t in (p.dense, p.values, p.meta):
        assert t.is_contiguous()
        assert t.data_ptr() % 16 == 0 or t.numel() == 0
        assert (t[0].numel() * t.element_size() if t.shape[0] else 0) % 16 == 0
    # exact round trip: packed -> dense equals the plan's W*M
    assert torch.equal(packed_to_dense(p), layer.to_dense())
    assert torch.equal(packed_to_dense(p, torch.float64), layerplan_to_dense(layer, torch.float64))
    assert torch.equal(p.bias, layer.bias)


def test_meta_is_the_ir_packing_when_block_equals_tile():
    layer = random_layer_plan(32, 64, tile=(32, 64), kinds="sparse", seed=4)
    p = pack(layer)
    assert torch.equal(p.meta, layer.meta) and torch.equal(p.values, layer.values)


def test_uniform_rows_are_detected():
    kinds = torch.tensor([[0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.uint8)
    p = pack(random_layer_plan(48, 48, tile=(16, 16), kinds=kinds, seed=1))
    assert (p.dense_per_row, p.sparse_per_row) == (1, 2)
    kinds[0, 0] = 1
    p = pack(random_layer_plan(48, 48, tile=(16, 16), kinds=kinds, seed=1))
    assert p.dense_per_row is None and p.sparse_per_row is None
    assert p.all_sparse is False
    allsp = pack(random_layer_plan(48, 48, tile=(16, 16), kinds="sparse", seed=1))
    assert allsp.all_sparse and allsp.dense_per_row == 0 and allsp.sparse_per_row == 3



def _counted(rowptr: torch.Tensor) -> int:
    """Blocks per row read off the CSR row pointers (-1 = rows differ): what launches used to compute."""
    counts = rowptr.long().diff().tolist()
    return counts[0] if len(set(counts)) == 1 else -1


@pytest.mark.parametrize("preset", ["mixed", "sparse", "rows_no_dense", "rows_no_sparse"])
@pytest.mark.parametrize("tile,block", [((16, 16), None), ((64, 32), (16, 16)), ((32, 64), (32, 16))])
def test_per_row_counts_are_fixed_at_pack_time_and_read_no_tensor(preset, tile, block):
    import dataclasses

    from patchc.codegen.layout import per_row_counts

    p = pack(random_layer_plan(3 * tile[0] - 3, 2 * tile[1] + 8, tile=tile, kinds=preset, bias=True, seed=6),
             block=block, allow_all_dense=True)
    expect = (_counted(p.dense_rowptr), _counted(p.sparse_rowptr))
    assert per_row_counts(p) == expect and all(type(c) is int for c in p.per_row)
    assert (p.dense_per_row, p.sparse_per_row) == tuple(None if c < 0 else c for c in expect)
    # rowptrs whose data cannot be read (meta device): the counts come from the stored ints
    blind = dataclasses.replace(p, dense_rowptr=torch.empty_like(p.dense_rowptr, device="meta"),
                                sparse_rowptr=torch.empty_like(p.sparse_rowptr, device="meta"))
    assert per_row_counts(blind) == expect
    assert per_row_counts(p.to("meta")) == expect  # .to() carries them
    assert dataclasses.replace(p, per_row=None).per_row == expect  # built without them: counted once


def test_per_row_counts_must_be_two_ints():
    import dataclasses

    p = pack(random_layer_plan(32, 32, tile=(16, 16), kinds="mixed", seed=1))
    for bad in ((1,), (1, -2), (1.0, 2)):
        with pytest.raises(PackError, match="per_row must be two ints"):
            dataclasses.replace(p, per_row=bad)

def test_bytes_follow_the_ceiling_formula():
    layer = random_layer_plan(128, 128, tile=(16, 16), kinds="sparse", dtype=torch.float16, seed=1)
    p = pack(layer)
    assert p.weight_bytes == int(p.dense_bytes * 1.125 / 2)  # 2:4 = 1.125 bytes per fp16 weight


def test_pack_from_tile_plan_and_errors():
    plan = random_tile_plan({"a.weight": dict(n=32, k=48, tile=(16, 16)), "d.weight": dict(n=32, k=32, kinds="dense")})
    assert pack(plan, "a.weight").name == "a.weight"
    with pytest.raises(PackError, match="'d.weight' is entirely dense.*linear"):
        pack(plan, "d.weight")
    assert pack(plan, "d.weight", allow_all_dense=True).all_dense
    with pytest.raises(PackError, match="not in the plan"):
        pack(plan, "missing.weight")
    with pytest.raises(PackError, match="does not divide the plan tile"):
        pack(plan, "a.weight", block=(32, 16))
    with pytest.raises(PackError, match="powers of two >= 16"):
        pack(plan, "a.weight", block=(8, 16))
    odd = random_layer_plan(24, 24, tile=(12, 12), seed=0)
    with pytest.raises(PackError, match="powers of two"):
        pack(odd)


def test_groups_per_load_by_triton_version():
    assert groups_per_load("3.6.0") == 2 and groups_per_load("3.6.1+gitabc") == 2
    assert groups_per_load("3.7.0") == groups_per_load("3.9.0") == groups_per_load("3.10.0") == 1
    assert groups_per_load("3.9.0", override="2") == 2 and groups_per_load("3.6.0", override="1") == 1
    assert groups_per_load("3.6.0", override="") == 2  # an empty variable is no override
    with pytest.raises(ValueError, match="PATCHC_GROUPS_PER_LOAD must be 1 or 2"):
        groups_per_load("3.9.0", override="4")


def test_config_table_and_resolution():
    assert normalize_target("sm_90a") == "sm_90" and normalize_target("80") == "sm_80"
    with pytest.raises(ValueError, match="unknown target"):
        normalize_target("sm_75")
    assert choose_block((128, 128), "sm_90") == ARCH_TABLE["sm_90"].block
    assert choose_block((48, 32), "sm_80") == (16, 32)
    p = pack(random_layer_plan(256, 256, tile=(64, 64), seed=0))
    small = resolve_config(None, p, 1, "sm_80")
    assert (small.kernel, small.block_m) == ("decode", 1) and small.split_k >= 1
    assert resolve_config(None, p, 16, "sm_90").block_m == 16
    big = resolve_config(None, p, 4096, "sm_90")
    assert (big.kernel, big.block_m, big.split_k, big.num_warps) == ("prefill", 128, 1, 8)
    assert resolve_config(KernelConfig(split_k=3, num_warps=2), p, 2, "sm_80").split_k == 3
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(block_m=24)
    with pytest.raises(ValueError, match="kernel"):
        KernelConfig(kernel="gemv")
