"""LongCat-Flash's experts, which loop in Python over the experts hit and route some tokens to zero-computation
experts (ids past the routed ones, giving the token back): exported as two grouped mms over the routed experts
(`patchc.models.traceable.longcat_experts_grouped`), checked against transformers' loop; masked and planned for
the routed experts only (gate_up_proj also holds rows for the others, which no token reads); served by
`TileExperts`, which adds the zero-computation tokens itself; and `patchc prune` on a saved LongCat.

That is LongCat as transformers 5.17-5.24 build it (`LOOP_FORM`). transformers 5.25 holds the routed experts
only, in its decorated experts module, and adds the zero-computation tokens in the MoE block: the tests of
the whole path run on it too, the tests of the traced loop only on the earlier form."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import patchc
from patchc.models.hf_export import export_causal_lm
from patchc.models.traceable import _is_longcat_experts, longcat_experts_grouped, traceable_layers
from tests.conftest import assert_close_fp32, prune_24, prune_tiny_folder, train_and_harden
from tests.test_experts_runtime import _spy_grouped

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "LongcatFlashConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no LongCat-Flash", allow_module_level=True)

ROUTED, ZERO, HIDDEN, FFN, TOP_K = 4, 4, 64, 32, 2
EXPERTS = "model.layers.0.mlp.experts"


def _model(seed: int = 0, two_four: bool = False) -> torch.nn.Module:
    """A tiny LongCat-Flash (one layer: two attentions, two dense MLPs, one MoE of 4 routed + 4 zero experts)
    with weights large enough that the router's picks differ per token; `two_four`: every weight 2:4 by
    magnitude along its rows."""
    cfg = transformers.LongcatFlashConfig(
        vocab_size=128, hidden_size=HIDDEN, num_layers=1, num_attention_heads=4, num_key_value_heads=4,
        ffn_hidden_size=64, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
        v_head_dim=16, n_routed_experts=ROUTED, zero_expert_num=ZERO, expert_ffn_hidden_size=FFN, moe_topk=TOP_K)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
                if two_four:
                    p.copy_(prune_24(p))
    return model


LOOP_FORM = _is_longcat_experts(_model().get_submodule(EXPERTS))
# the experts module itself serves the zero-computation ids (5.17-5.24), or the MoE block does (5.25)
EXPERT_ZEROS = ZERO if LOOP_FORM else 0
loop_form = pytest.mark.skipif(not LOOP_FORM, reason=f"transformers {transformers.__version__}'s LongCat experts are "
                               "its decorated fused experts, with no loop of their own to trace")


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _routing(model: torch.nn.Module, ids: torch.Tensor, picked: bool = True) -> torch.Tensor:
    """The experts the layer's router picks for `ids`, (T, top_k), zero-computation ones included; `picked`
    False: the ids the experts module is called with (5.25's MoE block sends the zero-computation pairs to
    routed experts, with weight 0)."""
    moe, seen = model.model.layers[0].mlp, []
    handle = (moe.router.register_forward_hook(lambda m, args, out: seen.append(out[-1])) if picked else
              moe.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1])))
    with torch.no_grad():
        model(ids, use_cache=False)
    handle.remove()
    return seen[0]


@loop_form
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_the_grouped_form_computes_what_the_loop_computes(dtype, tol):
    """Routed experts through two grouped mms, zero-computation ones giving the token, both scaled by their
    routing weight: the loop's output, with a routed expert no token picked (3) and weights not summing to 1."""
    experts = _model().model.layers[0].mlp.experts.to(dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(21, HIDDEN, generator=gen).to(dtype)
    index = torch.stack([torch.randperm(ROUTED + ZERO, generator=gen)[:TOP_K] for _ in range(21)])
    index[index == 3] = 5
    weights = torch.rand(21, TOP_K, generator=gen).to(dtype)
    assert (index >= ROUTED).any() and (index < ROUTED).any()
    with torch.no_grad():
        want = experts(x, index, weights)
        got = longcat_experts_grouped(experts, experts.forward, x, index, weights)
    assert got.shape == want.shape == x.shape and got.dtype == want.dtype
    scale = want.abs().max().item()
    assert scale > 0.1 and (got - want).abs().max().item() <= tol * max(scale, 1.0)


@loop_form
def test_the_grouped_form_passes_the_loops_gradients():
    """Masks train through this form: the gradients to the tokens and to every routed expert's weights are the
    loop's (the zero-computation pairs' rows reach the tokens through the identity only)."""
    experts = _model().model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, HIDDEN, generator=gen)
    index = torch.stack([torch.randperm(ROUTED + ZERO, generator=gen)[:TOP_K] for _ in range(9)])
    weights = torch.rand(9, TOP_K, generator=gen)
    grads = []
    for forward in (experts.forward, lambda *a: longcat_experts_grouped(experts, experts.forward, *a)):
        experts.zero_grad()
        xg = x.clone().requires_grad_(True)
        forward(xg, index, weights).square().sum().backward()
        grads.append((xg.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    for want, got in zip(*grads):
        assert_close_fp32(got, want)


@pytest.mark.skipif(LOOP_FORM, reason="transformers before 5.25 route the zero-computation pairs in the experts")
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_the_moe_blocks_form_gives_its_experts_the_routed_pairs_only(impl, monkeypatch):
    """5.25's MoE block sends each zero-computation pair to a routed expert at weight 0; its traced form (export
    and calibration) runs the grouped mms on the router's own picks: the block's output and gradients, with
    rows for the routed pairs only."""
    from transformers.integrations import moe as hf_moe

    model = _model()
    model.set_experts_implementation(impl)
    moe = model.model.layers[0].mlp
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(5))
    rows, grouped = [], hf_moe._grouped_mm
    monkeypatch.setattr(hf_moe, "_grouped_mm", lambda a, w, offs: rows.append(int(offs[-1])) or grouped(a, w, offs))
    sent = []
    moe.experts.register_forward_pre_hook(lambda m, args: sent.append(args[1:]))
    outs = []
    for traced in (False, True):
        moe.zero_grad()
        xg = x.clone().requires_grad_(True)
        with traceable_layers(model) if traced else contextlib.nullcontext():
            y = moe(xg)
        y.square().sum().backward()
        outs.append((y, xg.grad, moe.experts.gate_up_proj.grad.clone(), moe.experts.down_proj.grad.clone()))
    for want, got in zip(*outs):
        assert_close_fp32(got, want)
    picked, ((ids, weights),) = moe.router(x)[-1], sent  # the traced form does not call the experts module
    assert (picked >= ROUTED).any() and ((ids < ROUTED) & (weights == 0)).sum() == (picked >= ROUTED).sum()
    routed = int((picked < ROUTED).sum())
    assert rows[-2:] == [routed, routed] and (impl == "eager" or rows[:-2] == [ids.numel()] * 2)


def test_a_longcat_masks_its_routed_experts_only_and_its_plan_runs_in_the_loop():
    """gate_up_proj holds rows for all 8 experts, down_proj for the 4 routed ones: both are planned for those
    4, and the rows past them keep their values through masking and `plan.apply`; the hardened plan applied to
    a copy that runs its own loop gives the eval program's logits."""
    model = _model()
    ids = _ids(2, 16)
    assert (_routing(model, ids) >= ROUTED).any()  # some tokens go to zero-computation experts
    prog = patchc.transform(export_causal_lm(model, fixed_len=16),
                            patchc.PatchConfig(tile=(16, 16), sparsity=0.35, init_std=0.5))
    experts = sorted(n for n in prog.layers if n.startswith(EXPERTS))
    assert experts == sorted(f"{EXPERTS}.{p}.{e}" for p in ("gate_up_proj", "down_proj") for e in range(ROUTED))
    with torch.no_grad(), prog.mask_mode("ones"):
        torch.testing.assert_close(prog(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                   atol=2e-5, rtol=2e-5)
    masked, plan = train_and_harden(prog, ids)
    assert plan.meta["targets"][f"{EXPERTS}.gate_up_proj.3"] == {"param": f"{EXPERTS}.gate_up_proj", "expert": 3,
                                                                 "transposed": False}
    pruned = plan.apply(copy.deepcopy(model))
    gate_up = pruned.get_parameter(f"{EXPERTS}.gate_up_proj")
    assert torch.equal(gate_up[ROUTED:], model.get_parameter(f"{EXPERTS}.gate_up_proj")[ROUTED:])
    assert (gate_up[:ROUTED] == 0).any()
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids, use_cache=False).logits, masked, atol=2e-5, rtol=2e-5)


def test_calibrating_the_model_sees_each_routed_expert_as_the_program_does():
    """The plain model's own loop and the program's grouped mms give each routed expert the same tokens: the
    ones the router picked it for (5.25's MoE block also sends it zero-computation pairs at weight 0)."""
    from patchc.pruning.observe import plain_layers

    model = _model()
    layers = plain_layers(model)
    assert f"{EXPERTS}.gate_up_proj.3" in layers and f"{EXPERTS}.gate_up_proj.4" not in layers
    batches = [_ids(1, 16, seed) for seed in range(2)]
    plain = patchc.calibrate(model, batches, progress=False)
    prog = patchc.transform(export_causal_lm(model, fixed_len=16), patchc.PatchConfig(tile=(16, 16)))
    traced = patchc.calibrate(prog, batches, progress=False)
    routed = torch.cat([_routing(model, ids) for ids in batches])
    sent = torch.cat([_routing(model, ids, picked=False) for ids in batches])
    assert LOOP_FORM or (sent[routed >= ROUTED] < ROUTED).all()  # 5.25 hands the experts those pairs
    for e in range(ROUTED):
        name = f"{EXPERTS}.gate_up_proj.{e}"
        assert plain[name].n_samples == traced[name].n_samples == int((routed == e).sum())
        torch.testing.assert_close(plain[name].hessian, traced[name].hessian, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_a_two_four_longcat_compiles_with_its_experts_served(path, monkeypatch, tmp_path):
    """With no plan, `patchc.compile` serves the routed experts (`TileExperts`, planned off their zeros) and
    adds the zero-computation tokens itself: the model's logits, on the grouped kernels' path (interpreted)
    and the reference one. The saved model holds the same weights, the rows no token reads as zeros, and
    loads back to the same logits."""
    from patchc.runtime.experts import TileExperts

    model, ids = _model(two_four=True), _ids(2, 6)
    assert (_routing(model, ids) >= ROUTED).any()
    launched = _spy_grouped(monkeypatch) if path == "triton" else monkeypatch.setenv("PATCHC_CPU_IMPL", path)
    from patchc.runtime.compile import _leaving, plan_swaps

    plan = patchc.TilePlan.from_linears(model)  # off the zeros, as patchc.compile reads them
    # every routed slice planned: the weight leaves with the drop-in, and no copy of it is made
    assert f"{EXPERTS}.gate_up_proj.{ROUTED - 1}" in _leaving(model, plan, *plan_swaps(model, plan)[:2])
    with torch.no_grad():
        want = model(ids).logits
        fast = patchc.compile(model, tune=False)
        served = fast.get_submodule(EXPERTS)
        assert type(served) is TileExperts and (served.num_experts, served.zero_experts) == (ROUTED, EXPERT_ZEROS)
        assert_close_fp32(fast(ids).logits, want)
    if path == "triton":
        assert f"{EXPERTS}.gate_up_proj" in launched and f"{EXPERTS}.down_proj" in launched
        return
    fast.save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    gate_up = loaded.get_parameter(f"{EXPERTS}.gate_up_proj")
    assert torch.equal(gate_up[:ROUTED], model.get_parameter(f"{EXPERTS}.gate_up_proj")[:ROUTED])
    assert not gate_up[ROUTED:].any()
    with torch.no_grad():
        assert_close_fp32(loaded(ids).logits, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the grouped kernels run there")
def test_a_two_four_longcat_on_gpu_matches_its_own_loop():
    """fp16 on CUDA: the served experts (grouped kernels, zero-computation tokens added) against the model's
    own loop over its dense 2:4 weights, eagerly and replayed from a CUDA graph."""
    model, ids = _model(two_four=True).cuda().half(), _ids(2, 6).cuda()
    with torch.no_grad():
        want = model(ids).logits.float()
        fast = patchc.compile(model, tune=False)
        assert type(fast.get_submodule(EXPERTS)).__name__ == "TileExperts"
        torch.testing.assert_close(fast(ids).logits.float(), want, atol=3e-2, rtol=3e-2)
        experts, x = fast.get_submodule(EXPERTS), torch.randn(12, HIDDEN, device="cuda", dtype=torch.half)
        index = torch.randint(0, ROUTED + EXPERT_ZEROS, (12, TOP_K), device="cuda")
        weights = torch.rand(12, TOP_K, device="cuda", dtype=torch.half)
        expected = model.get_submodule(EXPERTS)(x, index, weights)
        torch.testing.assert_close(experts(x, index, weights).float(), expected.float(), atol=3e-2, rtol=3e-2)
        graph = torch.cuda.CUDAGraph()  # the eager call above compiled the kernels this capture launches
        with torch.cuda.graph(graph):
            out = experts(x, index, weights)
        graph.replay()
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_prune_runs_on_a_longcat_folder_with_every_baseline(tmp_path):
    """`patchc prune` on a saved LongCat-Flash: the routed experts are planned, the baselines prune them 2:4."""
    plan = prune_tiny_folder(_model(), tmp_path, "longcat")
    assert f"{EXPERTS}.down_proj.3" in plan.layers and f"{EXPERTS}.gate_up_proj.4" not in plan.layers


class _Sliced(torch.nn.Module):
    """Four experts' (N, K) = (16, 32) weights, of which a grouped mm reads `rows` (a dim-0 slice)."""

    def __init__(self, rows: slice) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0)))
        self.rows = rows

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.moe import _grouped_mm

        return _grouped_mm(x, self.w[self.rows].transpose(-2, -1), offs)


@pytest.mark.parametrize(("rows", "masked"), [(slice(0, 2), 2), (slice(None, 4), 4), (slice(1, 3), None),
                                              (slice(0, 4, 2), None)])
def test_a_grouped_read_of_the_first_experts_masks_those_experts_only(rows, masked):
    """`W[:R]` is R experts, each masked whole, and the rows past them pass through the mask unchanged; any
    other slice (another start, a step) is not one expert per group: left dense, and the skip says why."""
    from patchc.passes.find_linears import find_linear_sites

    module = _Sliced(rows)
    n = len(range(4)[rows])
    x, offs = torch.randn(6, 32), (torch.arange(1, n + 1) * 6 // n).to(torch.int32)
    gm = torch.export.export(module, (x, offs)).module()
    sites, skipped = find_linear_sites(gm, patchc.PatchConfig(tile=(16, 16)))
    if masked is None:
        assert not sites and "read by grouped_mm" in skipped["w"]
        return
    assert [s.names for s in sites] == [[f"w.{e}" for e in range(masked)]]
    prog = patchc.transform(torch.export.export(module, (x, offs)), patchc.PatchConfig(tile=(16, 16)))
    assert sorted(prog.layers) == [f"w.{e}" for e in range(masked)]
    mask = prog.masks["w"]  # the weight's mask: its experts masked, then the rest as it is
    with torch.no_grad():
        out = mask(module.w)
    assert out.shape == module.w.shape and torch.equal(out[masked:], module.w[masked:])
    assert not torch.equal(out[:masked], module.w[:masked])
