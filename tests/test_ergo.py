"""Ergo's experts, whose own forward wraps transformers' decorated experts forward: each (token, expert) pair runs
alone with unit weight, goes through its expert's own RMSNorm (`post_expert_norm(y, expert_ids)`), and only then
is weighted and summed. `TileExperts` serves them with that norm on the same rows (`WRAPPED_EXPERTS`); a class
that wraps the decorated forward with steps the drop-in does not know stays dense, and says why."""

from __future__ import annotations

import copy

import pytest
import torch

import patchc
from patchc.ir.targets import expert_projections, post_expert_norm, why_experts_unserved
from patchc.models.hf_export import export_causal_lm
from tests.conftest import prune_24, prune_tiny_folder, train_and_harden
from tests.test_experts_runtime import _spy_grouped

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "ErgoConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no Ergo", allow_module_level=True)

EXPERTS = "model.layers.0.mlp.experts"


def _model(two_four: bool = False) -> torch.nn.Module:
    """A tiny Ergo (one sparse layer: 4 experts, top-2, a shared expert) with weights large enough that the
    router's picks differ per token and every expert norm scales differently; `two_four`: every weight 2:4 by
    magnitude along its rows (the expert weights are stored (E, K, N): along their N)."""
    cfg = transformers.ErgoConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_dense_blocks=0, moe_intermediate_size=32, shared_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("post_expert_norm.weight"):
                p.uniform_(0.5, 2.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.2)
                if two_four:
                    p.copy_(prune_24(p.transpose(-1, -2)).transpose(-1, -2) if p.dim() == 3 else prune_24(p))
    return model


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_ergo_experts_are_served_and_a_wrapper_with_other_steps_is_named():
    experts = _model().get_submodule(EXPERTS)
    assert expert_projections(experts) == ["up_proj", "down_proj"] and post_expert_norm(experts) == "per_expert"

    class Doubled(type(experts)):  # wraps the decorated forward with a step of its own
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    experts.__class__ = Doubled
    assert expert_projections(experts) == []
    assert "Doubled.forward wraps transformers' experts forward" in why_experts_unserved(experts)


def test_an_ergo_plan_compiles_to_the_plan_applied_model():
    """Masked per expert slice (up_proj, down_proj) and hardened: `patchc.compile` with the plan gives the
    logits of the plan applied to a copy, which runs the model's own experts forward."""
    model, ids = _model(), _ids(2, 16)
    prog = patchc.transform(export_causal_lm(model, fixed_len=16),
                            patchc.PatchConfig(tile=(16, 16), sparsity=0.35, init_std=0.5))
    assert {f"{EXPERTS}.{p}.{e}" for p in ("up_proj", "down_proj") for e in range(4)} <= set(prog.layers)
    masked, plan = train_and_harden(prog, ids)
    pruned = plan.apply(copy.deepcopy(model))
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids, use_cache=False).logits, masked, atol=2e-5, rtol=2e-5)
        fast = patchc.compile(model, plan, tune=False)
        assert fast.get_submodule(EXPERTS).post_norm == "per_expert"
        torch.testing.assert_close(fast(ids, use_cache=False).logits, masked, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_a_two_four_ergo_compiles_with_its_expert_norms(path, monkeypatch, tmp_path):
    """With no plan, `patchc.compile` serves the experts (planned off their zeros) with each expert's norm on
    its rows: the model's logits, on the grouped kernels' path (interpreted) and the reference one. The saved
    model holds the same weights, norms included, and loads back to the same logits."""
    from patchc.runtime.experts import TileExperts

    model, ids = _model(two_four=True), _ids(2, 6)
    launched = _spy_grouped(monkeypatch) if path == "triton" else monkeypatch.setenv("PATCHC_CPU_IMPL", path)
    with torch.no_grad():
        want = model(ids).logits
        fast = patchc.compile(model, tune=False)
        assert type(fast.get_submodule(EXPERTS)) is TileExperts
        torch.testing.assert_close(fast(ids).logits, want, atol=1e-5, rtol=1e-5)
    if path == "triton":
        assert f"{EXPERTS}.up_proj" in launched and f"{EXPERTS}.down_proj" in launched
        return
    fast.save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    for name in ("up_proj", "down_proj", "post_expert_norm.weight"):
        assert torch.equal(loaded.get_parameter(f"{EXPERTS}.{name}"), model.get_parameter(f"{EXPERTS}.{name}"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the grouped kernels run there")
def test_a_two_four_ergo_on_gpu_matches_its_own_forward():
    """fp16 on CUDA: the served experts (grouped kernels, then each expert's norm) against the model's own
    forward over its dense 2:4 weights."""
    model, ids = _model(two_four=True).cuda().half(), _ids(2, 6).cuda()
    with torch.no_grad():
        want = model(ids).logits.float()
        fast = patchc.compile(model, tune=False)
        assert type(fast.get_submodule(EXPERTS)).__name__ == "TileExperts"
        torch.testing.assert_close(fast(ids).logits.float(), want, atol=3e-2, rtol=3e-2)


def test_prune_runs_on_an_ergo_folder_with_every_baseline(tmp_path):
    """`patchc prune` on a saved Ergo: its expert slices are planned, and the baselines prune them 2:4."""
    plan = prune_tiny_folder(_model(), tmp_path, "ergo")
    assert {f"{EXPERTS}.{p}.{e}" for p in ("up_proj", "down_proj") for e in range(4)} <= set(plan.layers)
