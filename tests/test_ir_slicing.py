"""`take_block` and `stack_rows` against the same cut of W * M and M unpacked: odd shapes with partial edge
tiles, both dtypes the plans hold, and the refusals of a part that is not whole tiles."""

from __future__ import annotations

import pytest
import torch

from patchc.codegen.reference import random_layer_plan
from patchc.ir import TILE_SPARSE24, PlanError
from patchc.ir.slicing import stack_rows, take_block


def _same(part, dense: torch.Tensor, mask: torch.Tensor) -> None:
    part.verify()
    assert part.shape == tuple(dense.shape)
    assert torch.equal(part.to_dense(), dense) and torch.equal(part.mask(), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [((16, 40), None), (None, (8, 24)), ((32, 40), (16, 28)), (None, None)])
def test_a_block_of_whole_tiles_is_that_part_of_the_weight(dtype, rows, cols):
    """A (40, 28) weight in (16, 8) tiles: its last tile row and column are partial, and a block may end there."""
    layer = random_layer_plan(40, 28, tile=(16, 8), kinds=0.4, dtype=dtype, seed=3)
    r, c = rows or (0, 40), cols or (0, 28)
    part = take_block(layer, "part", rows=rows, cols=cols)
    _same(part, layer.to_dense()[r[0]:r[1], c[0]:c[1]], layer.mask()[r[0]:r[1], c[0]:c[1]])
    assert part.name == "part" and part.dtype == dtype
    assert torch.equal(part.kinds, layer.kinds[r[0] // 16:-(-r[1] // 16), c[0] // 8:-(-c[1] // 8)])
    assert 0 < part.n_sparse and part.n_dense + part.n_sparse == part.kinds.numel()


def test_rows_keep_their_bias_and_columns_of_a_biased_layer_are_refused():
    layer = random_layer_plan(48, 32, tile=(16, 16), bias=True, seed=1)
    part = take_block(layer, "rows", rows=(16, 48))
    assert torch.equal(part.bias, layer.bias[16:]) and part.bias.data_ptr() != layer.bias.data_ptr()
    with pytest.raises(PlanError, match="columns 0..16 of a biased layer"):
        take_block(layer, "cols", cols=(0, 16))


@pytest.mark.parametrize(("rows", "cols", "why"), [
    ((8, 32), None, r"rows 8..32 do not start and end on its 16-wide tiles"),
    ((16, 40), None, r"rows 16..40 do not start"),        # 40 is neither a tile boundary nor the edge (48)
    (None, (0, 20), r"columns 0..20 do not start"),
    ((32, 64), None, r"rows 32..64 are not inside its 48 rows"),
    ((16, 16), None, r"rows 16..16 are not inside"),
])
def test_a_part_that_is_not_whole_tiles_is_refused_by_name(rows, cols, why):
    layer = random_layer_plan(48, 32, tile=(16, 16), seed=2, name="mlp.w1")
    with pytest.raises(PlanError, match=r"layer mlp\.w1: " + why):
        take_block(layer, "part", rows=rows, cols=cols)


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_rows_are_the_concatenated_weights(bias):
    """Whole tile rows, then a last part with a partial tile row; kinds of every plan stay where they were."""
    parts = [random_layer_plan(n, 24, tile=(8, 8), kinds=kinds, bias=bias, seed=s, name=f"p{s}")
             for s, (n, kinds) in enumerate([(16, "sparse"), (8, "dense"), (12, "mixed")])]
    stacked = stack_rows(parts, "gate_up")
    _same(stacked, torch.cat([p.to_dense() for p in parts]), torch.cat([p.mask() for p in parts]))
    assert stacked.n_sparse == sum(p.n_sparse for p in parts) and bool((stacked.kinds[:2] == TILE_SPARSE24).all())
    assert (stacked.bias is None) != bias
    assert not bias or torch.equal(stacked.bias, torch.cat([p.bias for p in parts]))


def test_blocks_of_a_flat_experts_weight_stack_back_into_it():
    """DBRX's use: expert e's rows of w1 and v1 stacked, and its columns of w2's transpose, are the weights."""
    experts, f, h = 3, 32, 48
    w1, v1 = (random_layer_plan(experts * f, h, tile=(16, 16), seed=s) for s in (4, 5))
    w2t = random_layer_plan(h, experts * f, tile=(16, 16), seed=6)
    for e in range(experts):
        rows = (e * f, (e + 1) * f)
        gate_up = stack_rows([take_block(w1, "g", rows=rows), take_block(v1, "u", rows=rows)], f"gate_up.{e}")
        _same(gate_up, torch.cat([w1.to_dense()[rows[0]:rows[1]], v1.to_dense()[rows[0]:rows[1]]]),
              torch.cat([w1.mask()[rows[0]:rows[1]], v1.mask()[rows[0]:rows[1]]]))
        down = take_block(w2t, f"down.{e}", cols=rows)
        _same(down, w2t.to_dense()[:, rows[0]:rows[1]], w2t.mask()[:, rows[0]:rows[1]])


def test_plans_that_cannot_stack_are_refused_by_name():
    a = random_layer_plan(12, 16, tile=(8, 8), name="a")
    with pytest.raises(PlanError, match=r"layer s: a has 12 rows, not whole 8-row tiles"):
        stack_rows([a, a], "s")
    b = random_layer_plan(16, 24, tile=(8, 8), name="b")
    with pytest.raises(PlanError, match=r"cannot stack b \(K=24"):
        stack_rows([random_layer_plan(16, 16, tile=(8, 8), name="c"), b], "s")
    with pytest.raises(PlanError, match="some of .* have a bias"):
        stack_rows([random_layer_plan(16, 16, tile=(8, 8)), random_layer_plan(8, 16, tile=(8, 8), bias=True)], "s")
    with pytest.raises(PlanError, match="at least one"):
        stack_rows([], "s")
