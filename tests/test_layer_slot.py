"""LayerSlot: a layer's header entry and buffer shapes, known from its tile kinds before it is packed.

A writer lays a file out from slots and then packs layer by layer (`patchc import`), so a slot must be
exactly what the packed layer holds: checked against `LayerPlan.slot()` and the packed buffers themselves,
for odd shapes (edge tiles), every tile width's metadata bytes, bias or not; and `survey_linears`' cheap
tile kinds (a count of nonzeros per group) against the kinds packing infers from the same zeros."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from patchc.ir import TILE_DENSE, TILE_SPARSE24, TilePlan
from patchc.ir.from_pruned import layer_from_linear, survey_linears
from patchc.ir.layer_slot import LayerSlot
from tests.conftest import prune_24
from tests.test_tile_plan import make_layer


@pytest.mark.parametrize("shape, tile", [((40, 24), (16, 16)), ((37, 20), (8, 12)), ((64, 64), (32, 8)),
                                         ((5, 4), (16, 16)), ((48, 72), (16, 24))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_slot_from_kinds_is_the_packed_layers(shape, tile, dtype, bias):
    _, kinds, _, layer = make_layer(shape, tile, dtype=dtype, p_dense=0.4, seed=sum(shape), bias=bias)
    slot = LayerSlot.from_kinds(shape, tile, dtype, kinds, has_bias=bias)
    assert slot == layer.slot()
    assert slot.parts() == {part: (t.dtype, tuple(t.shape)) for part, t in layer.tensors().items()}
    assert list(slot.parts()) == list(layer.tensors())  # the order a file lays them out in
    assert (slot.n_dense, slot.n_sparse, slot.n_kept) == (layer.n_dense, layer.n_sparse, layer.n_kept)
    assert slot.nbytes() == layer.nbytes() and slot.density == layer.density
    assert slot.header() == {"shape": list(shape), "tile": list(tile), "dtype": str(dtype)[6:], "has_bias": bias}


def pruned_model() -> nn.Module:
    """Linears whose zeros make every case of the tile-kind rule: 2:4 groups, groups of 3 nonzeros (dense
    tiles), all-zero rows and tiles, edge tiles, a bias or none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 36), nn.Linear(36, 24, bias=False), nn.Linear(24, 8), nn.Linear(8, 20))
    with torch.no_grad():
        a, b, c, _ = (m.weight for m in model)
        a.copy_(prune_24(a))
        a[:16, 16:32] = torch.randn(16, 16)  # one dense tile
        a[20, 4:8] = torch.tensor([1.0, 2.0, 0.0, 3.0])  # a group of 3: its tile turns dense
        b.copy_(prune_24(b))
        b[16:] = 0  # all-zero rows: 2:4 tiles
        c.copy_(prune_24(c))  # 3rd linear all 2:4; the 4th stays dense: "no 2:4 tile"
    return model


@pytest.mark.parametrize("tile", [(16, 16), (8, 8), (16, 12)])
def test_survey_finds_the_layers_and_kinds_that_packing_does(tile):
    model = pruned_model()
    where, slots, left = survey_linears(model, tile)
    assert left == {"3.weight": "no 2:4 tile"}
    packed = TilePlan.from_linears(model, tile)
    assert list(slots) == list(packed.layers) == ["0.weight", "1.weight", "2.weight"]
    for name, slot in slots.items():
        layer = layer_from_linear(model, name, where[name], tile)
        assert slot == layer.slot() == packed.layers[name].slot(), name
        assert torch.equal(layer.to_dense(), packed.layers[name].to_dense()), name
    assert slots["0.weight"].has_bias and not slots["1.weight"].has_bias
    kinds = packed.layers["0.weight"].kinds
    if tile == (16, 16):
        s, d = TILE_SPARSE24, TILE_DENSE  # rows 0-15: the dense tile; 16-31: the group of 3; 32-35: 2:4
        assert kinds.tolist() == [[s, d, s], [d, s, s], [s, s, s]]
