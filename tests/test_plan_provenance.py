"""Plans know which weights they belong to: `apply` refuses a model with other weights, names the layer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import patchc
from patchc.ir import PlanError, TilePlan
from patchc.ir.provenance import fingerprint, fingerprint_mismatch
from tests.test_tile_plan import random_mask


def model_and_masks(seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 48))
    masks = {}
    for name, (n, k) in (("0.weight", (32, 64)), ("2.weight", (48, 32))):
        kinds = (torch.arange((n // 16) * (k // 16)).view(n // 16, k // 16) % 2).to(torch.uint8)
        masks[name] = random_mask((n, k), (16, 16), kinds, seed)
    return model, masks


def noised(model: nn.Module, name: str, scale: float = 1e-2) -> nn.Module:
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_parameter(name).add_(scale * torch.randn_like(other.get_parameter(name)))
    return other


def test_from_masks_records_fingerprints_and_apply_accepts_its_source_in_any_dtype():
    model, masks = model_and_masks()
    plan = TilePlan.from_masks(model, masks, tile=(16, 16))
    assert set(plan.meta["fingerprints"]) == set(masks)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        target = copy.deepcopy(model).to(dtype)
        plan.apply(target)
        assert torch.equal(target[0].weight, plan.layers["0.weight"].to_dense().to(dtype))
        plan.apply(target)  # applying twice (or compiling an applied model) is fine: W * M is the plan's own


@pytest.mark.parametrize("scale", [1e-2, 1e-5])
def test_apply_refuses_other_weights_naming_the_layer_and_writes_nothing(scale):
    model, masks = model_and_masks()
    plan = TilePlan.from_masks(model, masks, tile=(16, 16))
    other = noised(model, "2.weight", scale)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(PlanError, match=r"layer 2\.weight: .*other weights.*force=True"):
        plan.apply(other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # nothing written half-way
    plan.apply(other, force=True)  # the expert's way out
    assert torch.equal(other[2].weight, plan.layers["2.weight"].to_dense())


def test_fingerprints_survive_the_plan_file(tmp_path):
    model, masks = model_and_masks()
    TilePlan.from_masks(model, masks, tile=(16, 16)).save(tmp_path / "p.patch")
    plan = TilePlan.load(tmp_path / "p.patch")
    plan.apply(copy.deepcopy(model))
    with pytest.raises(PlanError, match=r"layer 0\.weight"):
        plan.apply(noised(model, "0.weight"))


def test_plans_without_fingerprints_check_the_kept_weights():
    model, masks = model_and_masks()
    plan = TilePlan.from_masks(model, masks, tile=(16, 16))
    plan.meta.pop("fingerprints")  # as in plan files written before fingerprints existed
    plan.apply(copy.deepcopy(model))  # the dense source: kept weights equal
    pruned = plan.apply(copy.deepcopy(model))
    plan.apply(pruned)  # an already pruned copy: kept weights equal too
    inferred = TilePlan.from_weights(pruned.state_dict(), tile=(16, 16))
    inferred.apply(copy.deepcopy(model))
    with pytest.raises(PlanError, match=r"layer 0\.weight: .*kept weights differ"):
        plan.apply(noised(model, "0.weight"))


def test_hardened_plan_refuses_a_model_with_other_weights():
    model, _ = model_and_masks()
    ep = torch.export.export(model, (torch.randn(2, 64),))
    prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35))
    plan = patchc.harden(prog)
    assert set(plan.meta["fingerprints"]) == set(plan.layers)
    plan.apply(copy.deepcopy(model))
    with pytest.raises(PlanError, match=r"layer 0\.weight"):
        plan.apply(noised(model, "0.weight", 1e-3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fingerprint_is_the_fp64_norm_and_samples_in_any_chunking(dtype):
    """Summed a chunk at a time (no fp64 copy of the whole weight): the norm of the fp64 weight to fp64
    rounding, the samples exactly its values, whatever the chunk (here ragged: 7 does not divide 40 x 24)."""
    w = (torch.randn(40, 24, dtype=torch.float64) * 3).to(dtype)
    wide = w.to(torch.float64).flatten()
    from patchc.ir.provenance import _positions

    for chunk in (7, 960, 1 << 22):
        got = fingerprint(w, chunk=chunk)
        assert got["dtype"] == str(dtype).removeprefix("torch.")
        assert got["norm"] == pytest.approx(float(wide.norm()), rel=1e-12)
        assert got["sample"] == wide[_positions((40, 24))].tolist()
    assert fingerprint(w.t())["norm"] == pytest.approx(float(wide.norm()), rel=1e-12), "a transposed view"


def test_fingerprint_mismatch_tolerates_rounding_but_not_one_changed_sample():
    w = torch.randn(40, 24, dtype=torch.float64)
    rec = fingerprint(w.float())
    assert fingerprint_mismatch("fc.weight", rec, w.to(torch.bfloat16)) is None
    assert fingerprint_mismatch("fc.weight", rec, w.to(torch.float16)) is None
    changed = w.float().clone().flatten()
    from patchc.ir.provenance import _positions

    changed[_positions((40, 24))[0]] += 0.01
    why = fingerprint_mismatch("fc.weight", rec, changed.view(40, 24))
    assert why and why.startswith("layer fc.weight: ")
