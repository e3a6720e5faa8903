"""DBRX's experts, which loop in Python over the experts the router picked, exported in their dense form
(`patchc.models.traceable.dbrx_experts_dense`): checked against transformers' loop, then through patchc's path,
where the hardened plan applied to the model is run by the model's own loop; calibration of the plain model
sees the flat weights as the program does, and `patchc prune` runs every baseline over them."""

from __future__ import annotations

import copy

import pytest
import torch

import patchc
from patchc.ir.targets import resolve
from patchc.models.hf_export import export_causal_lm
from patchc.models.traceable import dbrx_experts_dense
from tests.conftest import prune_tiny_folder, train_and_harden

transformers = pytest.importorskip("transformers")
dbrx = pytest.importorskip("transformers.models.dbrx.modeling_dbrx")

EXPERTS, FFN, HIDDEN, TOP_K = 4, 32, 64, 2


def _model(seed: int = 0, experts: int = EXPERTS, ffn: int = FFN) -> torch.nn.Module:
    config = transformers.DbrxConfig(
        d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # DBRX's own 8
        ffn_config={"ffn_hidden_size": ffn, "moe_num_experts": experts, "moe_top_k": TOP_K, "hidden_size": HIDDEN})
    torch.manual_seed(seed)
    model = transformers.DbrxForCausalLM(config).eval()
    with torch.no_grad():  # transformers leaves the flat expert weights as torch.empty made them
        for block in model.transformer.blocks:
            for w in (block.ffn.experts.mlp.w1, block.ffn.experts.mlp.v1, block.ffn.experts.mlp.w2):
                w.normal_(0, 0.1)
    return model


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_the_dense_form_computes_what_the_loop_computes(dtype, tol):
    """Every expert on every token, scaled by its routing weight: the loop's output, with experts that no token
    picked (expert 3 here) and tokens whose weights do not sum to one."""
    experts = _model().transformer.blocks[0].ffn.experts.to(dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, HIDDEN, generator=gen).to(dtype)
    index = torch.randint(0, EXPERTS - 1, (21, TOP_K), generator=gen)
    index[:, 1] = (index[:, 0] + 1) % (EXPERTS - 1)  # top-k picks distinct experts
    weights = torch.rand(21, TOP_K, generator=gen).to(dtype)
    with torch.no_grad():
        want = experts(x, index, weights)
        got = dbrx_experts_dense(experts, experts.forward, x, index, weights)
    assert got.shape == want.shape == x.shape and got.dtype == want.dtype
    scale = want.abs().max().item()
    assert scale > 0.1 and (got - want).abs().max().item() <= tol * max(scale, 1.0)


def test_a_dbrx_model_exports_masks_its_experts_and_its_plan_runs_in_the_loop():
    """Each block's flat w1, v1 (E * F, H) and w2 (read (K, N): masked as its transpose) are plan layers; the
    ones-mask program is the model; after a few steps the hardened plan, applied to a copy that runs its own
    loop over the experts, gives the eval program's logits, and its 2:4 groups lie along w2's E * F inputs."""
    model = _model()
    ep = export_causal_lm(model, fixed_len=16)
    assert "forward" not in model.transformer.blocks[0].ffn.experts.__dict__  # its own forward is back
    prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35, init_std=0.5))
    flat = [f"transformer.blocks.{b}.ffn.experts.mlp.{w}" for b in range(2) for w in ("w1", "v1", "w2")]
    assert set(flat) <= set(prog.layers)
    ids = _ids(2, 16)
    with torch.no_grad(), prog.mask_mode("ones"):
        torch.testing.assert_close(prog(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                   atol=2e-5, rtol=2e-5)
    masked, plan = train_and_harden(prog, ids)
    w2 = "transformer.blocks.0.ffn.experts.mlp.w2"
    assert plan.layers[w2].shape == (HIDDEN, EXPERTS * FFN) and resolve(model, w2, plan.meta["targets"]).transposed
    pruned = plan.apply(copy.deepcopy(model))
    layer, (b1, b2) = plan.layers[w2], plan.layers[w2].tile
    kept = (pruned.get_parameter(w2).t() != 0).reshape(HIDDEN // b1, b1, EXPERTS * FFN // b2, b2 // 4, 4).sum(-1)
    sparse = layer.kinds == patchc.ir.TILE_SPARSE24  # (Tn, Tk) tiles of the (H, E * F) transpose
    assert sparse.any() and bool((kept.permute(0, 2, 1, 3)[sparse] <= 2).all())  # 2 of each 4 of its E * F inputs
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids, use_cache=False).logits, masked, atol=2e-5, rtol=2e-5)


def test_calibrating_the_model_sees_each_flat_weight_as_the_program_reads_it():
    """The one-shot methods and the priors prune the plain model with statistics of its flat expert weights in
    the traced form (every token into w1 and v1, the routing-weighted (T, E * F) rows into w2), the same
    statistics the program gives; w2 resolves as its transpose, and the model's own loop is back after."""
    from patchc.pruning.observe import layer_matrix, plain_layers

    model = _model()
    layers = plain_layers(model)
    w1, w2 = "transformer.blocks.1.ffn.experts.mlp.w1", "transformer.blocks.1.ffn.experts.mlp.w2"
    assert (layers[w1], layers[w2]) == (HIDDEN, EXPERTS * FFN)
    assert layer_matrix(model, w2).shape == (HIDDEN, EXPERTS * FFN)
    batches = [_ids(1, 16, seed) for seed in range(2)]
    plain = patchc.calibrate(model, batches, progress=False)
    assert "forward" not in model.transformer.blocks[1].ffn.experts.__dict__
    prog = patchc.transform(export_causal_lm(model, fixed_len=16), patchc.PatchConfig(tile=(16, 16)))
    traced = patchc.calibrate(prog, batches, progress=False)
    for name in (w1, "transformer.blocks.0.ffn.experts.mlp.v1", w2):
        assert plain[name].n_samples == traced[name].n_samples == 32
        torch.testing.assert_close(plain[name].hessian, traced[name].hessian, atol=1e-4, rtol=1e-4)


def test_prune_runs_on_a_dbrx_folder_with_every_baseline_over_the_experts(tmp_path, monkeypatch):
    """`patchc prune` on a saved DBRX: the SparseGPT prior and the one-shot baselines have statistics for the
    flat expert weights, and every 2:4 baseline prunes them (50% of every planned weight). A SparseGPT recovery
    whose Hessian the host cannot hold is refused before it calibrates."""
    plan = prune_tiny_folder(_model(), tmp_path, "dbrx")
    assert "transformer.blocks.0.ffn.experts.mlp.w2" in plan.layers

    from patchc.job import memory
    from patchc.job.recover import run_recover

    monkeypatch.setattr(memory, "free_bytes", lambda device: 4 * (EXPERTS * FFN) ** 2 - 1)
    with pytest.raises(ValueError, match=r"SparseGPT \(--method sparsegpt\) needs the 128 x 128 .*use --method adam"):
        run_recover(tmp_path / "run", method="sparsegpt", progress=False)


def test_a_hessian_larger_than_the_host_is_refused_before_calibration(monkeypatch):
    """SparseGPT holds each layer's K x K Hessian in host memory; DBRX's flat w2 reads E * F inputs (118 GB at
    DBRX's size): where the host cannot hold it, `check_fits` says so and what runs instead."""
    from patchc.job import memory
    from patchc.job.options import PruneOptions

    model, cfg = _model(), patchc.PatchConfig(tile=(16, 16))
    need = 4 * (EXPERTS * FFN) ** 2
    monkeypatch.setattr(memory, "free_bytes", lambda device: need)
    memory.check_hessians(model, cfg, PruneOptions(tile=(16, 16)))  # exactly fits
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - 1)
    refusal = (r"SparseGPT \(--prior sparsegpt\) needs the 128 x 128 fp32 Hessian of "
               r"transformer\.blocks\.0\.ffn\.experts\.mlp\.w2.*--prior wanda --no-baselines")
    with pytest.raises(ValueError, match=refusal):
        memory.check_hessians(model, cfg, PruneOptions(tile=(16, 16)))
    with pytest.raises(ValueError, match=r"SparseGPT \(a baseline\)"):
        memory.check_hessians(model, cfg, PruneOptions(tile=(16, 16), prior="wanda"))
    memory.check_hessians(model, cfg, PruneOptions(tile=(16, 16), prior="wanda", baselines=False))
    monkeypatch.setattr(memory, "free_bytes", lambda device: 10**12 if device != "cpu" else need - 1)
    with pytest.raises(ValueError, match="Hessian .* the host has"):  # the job's check before text and calibration
        memory.check_fits(model, cfg, PruneOptions(tile=(16, 16), device="cuda"))
    monkeypatch.setattr(memory, "free_bytes", lambda device: 10**12 if device == "cpu" else need - 1)
    with pytest.raises(ValueError, match="Hessian .* cuda has"):  # built on the GPU first
        memory.check_hessians(model, cfg, PruneOptions(tile=(16, 16), device="cuda"))
