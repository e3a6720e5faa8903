"""Property tests: random plans round-trip exactly, damaged plan files never load, NaNs never verify.

(The CLI mutation and kill-and-resume properties live in tests/test_cli_errors.py and tests/test_runs.py.)
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from patchc.ir import TILE_DENSE, TILE_SPARSE24, LayerPlan, PlanError, TilePlan
from tests.test_tile_plan import random_mask, small_plan

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@st.composite
def layers(draw) -> tuple[LayerPlan, torch.Tensor]:
    """A random LayerPlan (shape, tile, kinds, dtype, bias) and the dense weight it was made from."""
    b1 = 4 * draw(st.integers(1, 8))
    b2 = 4 * draw(st.integers(1, 8))
    n = draw(st.integers(1, 3 * b1))
    k = 4 * draw(st.integers(1, 3 * b2 // 4))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    grid = (math.ceil(n / b1), math.ceil(k / b2))
    kinds = torch.where(torch.rand(grid, generator=g) < draw(st.floats(0, 1)), TILE_DENSE, TILE_SPARSE24)
    kinds = kinds.to(torch.uint8)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if draw(st.booleans()) else None
    mask = random_mask((n, k), (b1, b2), kinds, seed)
    return LayerPlan.from_mask("fc.weight", w, kinds, mask, bias=bias, tile=(b1, b2)), w


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers())
def test_random_plans_round_trip_bit_exactly_and_apply(tmp_path, drawn):
    layer, w = drawn
    plan = TilePlan(layers={"fc.weight": layer}, meta={"seed": 1})
    path = tmp_path / "p.patch"
    plan.save(path)
    back = TilePlan.load(path)
    back.verify()
    for part, t in layer.tensors().items():
        u = back.layers["fc.weight"].tensors()[part]
        assert u.dtype == t.dtype and torch.equal(u.view(torch.uint8), t.view(torch.uint8)), part
    assert back.meta == plan.meta and back.density == plan.density
    model = nn.ModuleDict({"fc": nn.Linear(w.shape[1], w.shape[0], bias=layer.bias is not None).to(w.dtype)})
    with torch.no_grad():
        model.fc.weight.copy_(w)  # the plan's source weights (and bias): apply must accept them
        if layer.bias is not None:
            model.fc.bias.copy_(layer.bias)
    back.apply(model)
    assert torch.equal(model.fc.weight, layer.to_dense())
    if layer.bias is not None:
        assert torch.equal(model.fc.bias, layer.bias)


def test_random_byte_flips_in_a_plan_file_are_always_caught(tmp_path):
    path = tmp_path / "p.patch"
    small_plan().save(path)
    raw = path.read_bytes()
    rng = random.Random(0)
    bad = tmp_path / "bad.patch"
    for _ in range(400):
        i, bit = rng.randrange(len(raw)), rng.randrange(8)
        flipped = bytearray(raw)
        flipped[i] ^= 1 << bit
        bad.write_bytes(bytes(flipped))
        with pytest.raises(PlanError):
            TilePlan.load(bad)
            pytest.fail(f"byte {i} bit {bit} flipped and the plan still loaded")


def test_swapped_tiles_are_caught_by_the_checksum(tmp_path):
    import safetensors

    path = tmp_path / "p.patch"
    small_plan().save(path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    dense = tensors["blocks.0.b.weight::dense"]
    tensors["blocks.0.b.weight::dense"] = dense[torch.tensor([1, 0, *range(2, len(dense))])].contiguous()
    import safetensors.torch

    safetensors.torch.save_file(tensors, str(path), metadata=meta)
    with pytest.raises(PlanError, match=r"layer blocks\.0\.b\.weight: the dense buffer does not match its checksum"):
        TilePlan.load(path)


@pytest.mark.parametrize("part", ["dense", "values", "bias"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_never_verify(part, bad):
    layer = small_plan().layers["a.weight"]
    tensors = {k: v.clone() for k, v in layer.tensors().items()}
    tensors[part].view(-1)[3] = bad
    with pytest.raises(PlanError, match=rf"layer a\.weight: {part} holds 1 NaN/inf values"):
        LayerPlan(name="a.weight", shape=layer.shape, tile=layer.tile, dtype=layer.dtype,
                  bias=tensors.pop("bias"), **tensors)


def test_a_plan_of_non_finite_weights_is_refused_at_creation():
    w = torch.randn(16, 16)
    w[2, 3] = math.nan
    kinds = torch.zeros(1, 1, dtype=torch.uint8)
    with pytest.raises(PlanError, match=r"layer fc\.weight: dense holds 1 NaN/inf"):
        LayerPlan.from_mask("fc.weight", w, kinds, torch.ones(16, 16, dtype=torch.bool), tile=(16, 16))
    mask = torch.tensor([True, True, False, False]).repeat(16, 4)  # 2:4 tile keeping positions 0, 1
    layer = LayerPlan.from_mask("fc.weight", w, torch.ones(1, 1, dtype=torch.uint8), mask, tile=(16, 16))
    assert bool(torch.isfinite(layer.to_dense()).all())  # a NaN the mask drops is harmless
