"""einsum on a parameter (issue 14 item 2): the forms that are a (batched) matmul are masked like Linear /
Conv1D / fused experts; the others are listed as skipped with the reason.

One tiny module holds every form, so the whole file exports once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import patchc
from patchc.config import PatchConfig
from patchc.passes.einsum_forms import EinsumMatmul, parse_einsum, split_equation

TILE = (16, 16)
E = 4  # experts; the example's sequence axis is the expert axis of the batched-expert einsum


class Einsums(nn.Module):
    """h (B, E, 32) through five einsum weights, one per form."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_nk = nn.Parameter(torch.randn(64, 32, generator=g) / 6)       # "bsk,nk->bsn"   (N, K)
        self.w_kn = nn.Parameter(torch.randn(64, 32, generator=g) / 8)       # "...k,kn->...n" (K, N)
        self.w_first = nn.Parameter(torch.randn(32, 32, generator=g) / 6)    # "nk,bsk->bsn"   weight first
        self.experts = nn.Parameter(torch.randn(E, 32, 32, generator=g) / 6)  # "ebk,enk->ebn"
        self.w_sum = nn.Parameter(torch.randn(32, 16, generator=g))          # "bsk,kn->bs": not a matmul

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.einsum("bsk,nk->bsn", h, self.w_nk))
        h = torch.einsum("...k,kn->...n", h, self.w_kn)
        h = torch.einsum("nk,bsk->bsn", self.w_first, h)
        e = torch.einsum("ebk,enk->ebn", h.transpose(0, 1), self.experts).transpose(0, 1)
        return e + torch.einsum("bsk,kn->bs", h, self.w_sum)[..., None]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = Einsums().eval()
    x = torch.randn(2, E, 32, generator=torch.Generator().manual_seed(1))
    prog = patchc.transform(model, PatchConfig(tile=TILE, sparsity=0.35, init_std=0.5), example_inputs=(x,))
    return model, x, prog


def test_parse_einsum_forms_and_refusals():
    assert parse_einsum("bsk,nk->bsn", 1, 2) == EinsumMatmul(False, 2)
    assert parse_einsum("...k,kn->...n", 1, 2) == EinsumMatmul(True, -1)
    assert parse_einsum("nk,bsk->bsn", 0, 2) == EinsumMatmul(False, 2)
    assert parse_einsum("bkc,nk->bnc", 1, 2) == EinsumMatmul(False, 1)  # K need not be last in x
    assert parse_einsum("ebk,ekn->ebn", 1, 3) == EinsumMatmul(True, 2, 0)
    assert parse_einsum("bsk,kn", 1, 2) == EinsumMatmul(True, 2)  # implicit output "bns"
    assert split_equation("bsk,kn") == (["bsk", "kn"], "bns")
    assert "summed away" in parse_einsum("bsk,kn->bs", 1, 2)
    assert "summed away" in parse_einsum("bsk,nk->bn", 1, 2)  # x's s is summed before the matmul
    assert "repeated" in parse_einsum("bkk,nk->bn", 1, 2)
    assert "ellipsis on the weight" in parse_einsum("bk,...k->b...", 1, 2)
    assert "broadcast weight" in parse_einsum("bsk,nk->bsn", 1, 3)
    assert "expert letter first" in parse_einsum("bek,nek->ben", 1, 3)


def test_masked_layers_targets_and_skips(setup):
    _, _, prog = setup
    assert set(prog.layers) == {"w_nk", "w_kn", "w_first"} | {f"experts.{e}" for e in range(E)}
    assert prog.targets["w_kn"].transposed and not prog.targets["w_nk"].transposed
    assert prog.targets["experts.2"].expert == 2
    assert prog.layers["w_kn"].shape == (32, 64)  # (N, K) of a (K, N) weight
    assert "summed away" in prog.skipped["w_sum"] and "einsum" in prog.skipped["w_sum"]


def test_ones_mask_exact_and_plan_apply_equals_eval_program(setup):
    model, x, prog = setup
    with torch.no_grad(), prog.mask_mode("ones"):
        torch.testing.assert_close(prog(x), model(x), atol=1e-6, rtol=1e-6)
    prog.eval()
    with torch.no_grad():
        evald = prog(x)
    plan = patchc.harden(prog)
    kinds = torch.cat([lp.kinds.flatten() for lp in plan.layers.values()])
    assert 0 < int((kinds == 1).sum()) < kinds.numel()  # dense and 2:4 tiles
    applied = plan.apply(copy.deepcopy(model))
    with torch.no_grad():
        torch.testing.assert_close(applied(x), evald, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(applied(x), model(x), atol=1e-4)
    w = applied.w_kn.detach()
    assert int((w.t().reshape(32, -1, 4) != 0).sum(-1).max()) == 4  # dense tiles remain
    # The 2:4 groups of a (K, N) weight run along K (its rows), as in the plan's (N, K) matrix.
    assert torch.equal(w.t(), plan.layers["w_kn"].to_dense())


def test_calibration_sees_k_last_and_each_expert_on_its_rows(setup):
    model, x, prog = setup
    calib = patchc.calibrate(prog, [x], progress=False)
    assert set(calib) == set(prog.layers)
    assert calib["w_nk"].n_samples == x.shape[0] * x.shape[1]
    torch.testing.assert_close(calib["w_nk"].sq_norm, x.reshape(-1, 32).square().sum(0))
    # expert e reads its own slice of the sequence axis: 2 rows (the batch) each
    assert all(calib[f"experts.{e}"].n_samples == x.shape[0] for e in range(E))
    masks = patchc.oneshot(prog, "sparsegpt", "2:4", calib=calib, progress=False)
    assert set(masks) == set(prog.layers)
    for name, mask in masks.items():
        assert mask.shape == prog.layers[name].shape
        assert bool((mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all()), name


def test_compile_lists_einsum_layers_as_left_dense(setup):
    model, x, prog = setup
    plan = patchc.harden(prog)
    with pytest.warns(UserWarning, match="not replaced") as caught:
        fast = patchc.compile(model, plan, tune=False)
    text = str(caught[0].message)
    planned = [n for n, lp in plan.layers.items() if bool((lp.kinds == 1).any())]
    assert planned and all(n in text for n in planned)
    with torch.no_grad():  # left dense, with the plan's pruned values
        torch.testing.assert_close(fast(x), plan.apply(copy.deepcopy(model))(x))
    with pytest.raises(ValueError, match="not replaced"):
        patchc.compile(model, plan, tune=False, strict=True)
