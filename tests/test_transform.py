"""The mask-insertion pass and the masked program (no backend, CPU)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import patchc
from patchc.masking.hybrid_mask import HybridMask
from tests.conftest import TiedLinears, tiny_hf

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _export_hf(model, decompose: bool):
    ids = torch.randint(0, 128, (2, 8))
    ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    return (ep.run_decompositions() if decompose else ep), ids


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("decompose", [False, True], ids=["training-ir", "decomposed"])
def test_hf_models_mask_exactly_the_seven_projections(kind, decompose):
    model = tiny_hf(kind)
    ep, ids = _export_hf(model, decompose)
    prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35))
    expected = {f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight" for i in range(2) for p in PROJECTIONS}
    assert set(prog.layers) == expected
    assert not any("embed" in f or "lm_head" in f for f in prog.layers)
    # Qwen2's q/k/v have biases: in the decomposed graph they arrive through addmm.
    if kind == "qwen2":
        biased = {s.fqn for s in prog.sites if s.bias is not None}
        assert biased == {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "k_proj", "v_proj")}
    with prog.mask_mode("ones"):
        out = prog(ids, use_cache=False).logits
    assert torch.equal(out, ep.module()(ids, use_cache=False).logits)


def test_all_ones_mask_reproduces_the_original_exactly(tiny_mlp):
    ids = torch.randint(0, 32, (3, 7))
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8)), example_inputs=(ids,))
    with prog.mask_mode("ones"):
        assert torch.equal(prog(ids), tiny_mlp(ids))
    # Dynamic shapes: another batch and length work too.
    other = torch.randint(0, 32, (5, 11))
    with prog.mask_mode("ones"):
        assert torch.equal(prog(other), tiny_mlp(other))


def test_skips_are_explained(tiny_mlp):
    ids = torch.randint(0, 32, (2, 5))
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8)), example_inputs=(ids,))
    assert set(prog.layers) == {"up.weight", "down.weight"}
    assert "multiple of 4" in prog.skipped["odd.weight"]
    tied = prog.skipped.get("out.weight") or prog.skipped.get("embed.weight")
    assert tied is not None and ("embedding" in tied or "excluded" in tied)


def test_include_exclude_globs(tiny_mlp):
    ids = torch.randint(0, 32, (2, 5))
    cfg = patchc.PatchConfig(tile=(8, 8), include=("down*",))
    prog = patchc.transform(tiny_mlp, cfg, example_inputs=(ids,))
    assert set(prog.layers) == {"down.weight"}
    assert "include" in prog.skipped["up.weight"]
    cfg = patchc.PatchConfig(tile=(8, 8), exclude=("up.*",))
    prog = patchc.transform(tiny_mlp, cfg, example_inputs=(ids,))
    assert set(prog.layers) == {"down.weight"}


def test_gradients_reach_logits_only_and_weights_stay_bit_identical(tiny_mlp):
    ids = torch.randint(0, 32, (4, 9))
    before = {k: v.clone() for k, v in tiny_mlp.state_dict().items()}
    flags = {k: p.requires_grad for k, p in tiny_mlp.named_parameters()}
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8), steps=5), example_inputs=(ids,))
    params = prog.mask_parameters()
    assert params and all(p.dtype == torch.float32 for p in params)
    assert {id(p) for p in params} == {id(p) for p in prog.parameters()}
    opt = torch.optim.Adam(params, lr=0.1)
    prog.train()
    for _ in range(3):
        opt.zero_grad()
        loss = prog(ids).float().logsumexp(-1).mean() + prog.regularizer()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        opt.step()
        prog.step()
    for k, v in tiny_mlp.state_dict().items():
        assert torch.equal(v, before[k]), k
        assert v.grad is None if hasattr(v, "grad") else True
    assert all(p.grad is None for p in tiny_mlp.parameters())
    # The user's own parameters keep their requires_grad flags.
    assert {k: p.requires_grad for k, p in tiny_mlp.named_parameters()} == flags


def test_eval_mode_is_deterministic_and_equals_the_applied_plan(tiny_mlp):
    ids = torch.randint(0, 32, (2, 6))
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8), sparsity=0.25), example_inputs=(ids,))
    prog.eval()
    y1, y2 = prog(ids), prog(ids)
    assert torch.equal(y1, y2)
    plan = patchc.harden(prog)
    pruned = plan.apply(copy.deepcopy(tiny_mlp))
    assert torch.equal(pruned(ids), y1)


@pytest.mark.parametrize("decompose", [False, True])
def test_dropout_exported_in_train_mode_is_named(decompose):
    """A model exported in train mode (transformers models start there) keeps its dropout on in prog.eval():
    eval scores and hardened masks saw noise, without a word."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 32))
    x = torch.randn(4, 32)
    cfg = patchc.PatchConfig(tile=(16, 16))
    for train, warned in ((True, 1), (False, 0)):
        ep = torch.export.export(model.train(train), (x,))
        ep = ep.run_decompositions() if decompose else ep
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            patchc.transform(ep, cfg)
        found = [w for w in seen if "dropout op(s) in training mode (p = 0.1)" in str(w.message)]
        assert len(found) == warned, [str(w.message) for w in seen]


def test_casting_a_program_casts_its_weights_never_its_masks(tiny_mlp):
    """`prog.to(torch.bfloat16)` made the mask logits, tile counts and weight norms bf16 (the logits are fp32
    by design: Adam's small steps vanish in bf16); they stay fp32, and `.double()` (an fp64 reference) widens all."""
    ids = torch.randint(0, 32, (2, 6))
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8)), example_inputs=(ids,))
    before = {n: t.clone() for n, t in prog.named_parameters()}
    prog.to(torch.bfloat16)
    assert all(prog.weight(name).dtype == torch.bfloat16 for name in prog.layers)
    floats = [t for t in (*prog.parameters(), *prog.buffers()) if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float32 for t in floats)
    assert all(torch.equal(t, before[n]) for n, t in prog.named_parameters())  # never through bf16
    assert prog(ids).dtype == torch.bfloat16
    prog.double()
    assert all(t.dtype == torch.float64 for t in prog.parameters()) and prog.weight("up.weight").dtype == torch.float64


def test_a_model_torch_export_cannot_trace_is_named_by_its_layer():
    """`transform(module)` passed torch's data-dependent guard error (and its graph dumps) straight through; the
    job's own export already named the layer. Experts run in transformers' eager loop are such a layer."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model.set_experts_implementation("eager")
    with pytest.raises(ValueError, match=r"^Qwen3MoeForCausalLM: torch.export cannot trace model.layers.0.mlp.experts "
                                         r"\(Qwen3MoeExperts\).*set_experts_implementation\('grouped_mm'\)"):
        patchc.transform(model, patchc.PatchConfig(tile=(16, 16)), example_inputs=(torch.randint(0, 64, (2, 8)),),
                         example_kwargs={"use_cache": False})


def test_training_mode_is_seeded(tiny_mlp):
    ids = torch.randint(0, 32, (2, 6))
    outs = []
    for _ in range(2):
        prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8), seed=3), example_inputs=(ids,)).train()
        outs.append((prog(ids), prog(ids)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], outs[0][1])  # fresh noise per draw


def test_nm_and_tile_variants(tiny_mlp):
    ids = torch.randint(0, 32, (2, 6))
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8), variant="nm", sparsity=0.5), example_inputs=(ids,))
    assert all(m.tile_logits is None for m in prog.layers.values())
    plan = patchc.harden(prog)
    assert plan.density == pytest.approx(0.5)
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8), variant="tile", prior="magnitude"), example_inputs=(ids,))
    trainable = {id(p) for p in prog.mask_parameters()}
    assert trainable == {id(m.tile_logits) for m in prog.layers.values()}


def test_without_its_prior_a_program_needs_no_calibration_and_starts_from_its_seeded_init(tiny_mlp):
    """`prior=False`: what a resumed run transforms, its logits about to come from a checkpoint."""
    ids = torch.randint(0, 32, (2, 6))
    cfg = patchc.PatchConfig(tile=(8, 8), prior="sparsegpt")
    with pytest.raises(ValueError, match="needs calibration statistics"):
        patchc.transform(tiny_mlp, cfg, example_inputs=(ids,))
    bare = patchc.transform(tiny_mlp, cfg, example_inputs=(ids,), prior=False)
    unprimed = patchc.transform(tiny_mlp, cfg.replace(prior="random"), example_inputs=(ids,))
    magnitude = patchc.transform(tiny_mlp, cfg.replace(prior="magnitude"), example_inputs=(ids,))
    assert bare.cfg.prior == "sparsegpt"  # a checkpoint of this config loads into it
    for name, mask in bare.layers.items():
        assert torch.equal(mask.nm_logits, unprimed.layers[name].nm_logits)
        assert not torch.equal(mask.nm_logits, magnitude.layers[name].nm_logits)


def test_observe_inputs_sees_each_layer_and_restores_the_graph(tiny_mlp):
    ids = torch.randint(0, 32, (2, 6))
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8)), example_inputs=(ids,)).eval()
    code_before = prog.graph_module.code
    seen = {}
    with prog.observe_inputs(lambda fqn, x: seen.setdefault(fqn, x.shape)):
        prog(ids)
    assert seen == {"up.weight": torch.Size([2, 6, 24]), "down.weight": torch.Size([2, 6, 40])}
    assert prog.graph_module.code == code_before


def test_padded_grid_for_shapes_the_tile_does_not_divide(tiny_mlp):
    ids = torch.randint(0, 32, (2, 6))
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(16, 16)), example_inputs=(ids,))
    up = prog.layers["up.weight"]  # (40, 24): grid 3 x 2, edge tiles partial
    assert up.grid == (3, 2)
    assert up.tile_numel.sum() == 40 * 24 and up.tile_numel[-1, -1] == 8 * 8


def test_hybrid_mask_soft_sample_math():
    m = HybridMask("w", (4, 8), tile=(4, 4), variant="joint")
    m.tau_tile, m.tau_nm, m.kappa_tile, m.kappa_nm = 1.0, 1.0, 1.0, 1.0
    with torch.no_grad():
        m.tile_logits.copy_(torch.tensor([[50.0, -50.0]]))
    mask = m.mask()
    assert mask.shape == (4, 8)
    assert torch.allclose(mask[:, :4], torch.ones(4, 4), atol=1e-6)  # dense tile
    groups = mask[:, 4:].reshape(-1, 4)
    assert torch.allclose(groups.sum(-1), torch.full((4,), 2.0), atol=1e-5)  # soft 2:4 groups sum to 2
    assert m.expected_kept().item() == pytest.approx(16 + 8, abs=1e-4)


def test_regularizer_matches_the_formula(tiny_mlp):
    ids = torch.randint(0, 32, (2, 6))
    cfg = patchc.PatchConfig(tile=(8, 8), sparsity=0.3, lambda_density=7.0, lambda_norm=10.0, steps=10)
    prog = patchc.transform(tiny_mlp, cfg, example_inputs=(ids,)).train()
    prog(ids)
    masks = list(prog.layers.values())
    kept = sum(float(m.expected_kept()) for m in masks)
    numel = sum(m.numel for m in masks)
    w2 = sum(float(prog.weight(m.name).square().sum()) for m in masks)
    kept_norm = sum(float(m.last_sq_norm) for m in masks)
    expected = 7.0 * abs(kept / numel - 0.7) - 10.0 * 1.0 * kept_norm / w2
    assert float(prog.regularizer()) == pytest.approx(expected, rel=1e-5)


def test_schedules_are_linear_and_saved_in_state_dict(tiny_mlp):
    ids = torch.randint(0, 32, (2, 6))
    cfg = patchc.PatchConfig(tile=(8, 8), steps=4, tau=(2.0, 0.0 + 1.0), kappa_tile=(10.0, 50.0))
    prog = patchc.transform(tiny_mlp, cfg, example_inputs=(ids,))
    assert prog.schedule()["tau"] == 2.0
    prog.step(); prog.step()
    assert prog.schedule() == pytest.approx({"tau": 1.5, "tau_nm": 1.5, "kappa_tile": 30.0, "kappa_nm": 300.0})
    state = prog.state_dict()
    fresh = patchc.transform(tiny_mlp, cfg, example_inputs=(ids,))
    fresh.load_state_dict(state)
    assert fresh.schedule() == prog.schedule()
    for _ in range(5):
        prog.step()
    assert prog.schedule()["tau"] == 1.0  # held at the end value after T
    separate = patchc.transform(tiny_mlp, cfg.replace(tau_nm=(4.0, 2.0)), example_inputs=(ids,))
    separate.step(); separate.step()
    assert separate.schedule()["tau_nm"] == pytest.approx(3.0) and separate.schedule()["tau"] == pytest.approx(1.5)
    m = next(iter(separate.layers.values()))
    separate(ids)
    assert (m.tau_tile, m.tau_nm) == pytest.approx((1.5, 3.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sparsity": 0.6}, "outside \\[0, 0.5\\]"),
        ({"tile": (6, 8)}, "multiples of 4"),
        ({"variant": "blocky"}, "choose one of"),
        ({"variant": "nm", "sparsity": 0.35}, "sparsity 0.5"),
        ({"variant": "tile"}, "one-shot prior"),
        ({"steps": 0}, "steps"),
        # wrong types and NaN / inf failed later (a TypeError in training, 'loss is nan at step 1') or trained
        ({"steps": 2.5}, r"PatchConfig.steps=2.5 must be an int >= 1, e.g. steps=300"),
        ({"steps": True}, r"PatchConfig.steps=True must be an int"),
        ({"seed": 1.5}, r"PatchConfig.seed=1.5 must be an int in \[0, 2\*\*63\)"),
        ({"seed": 2**70}, r"PatchConfig.seed=1180591620717411303424 must be an int in \[0, 2\*\*63\)"),
        ({"sparsity": "0.3"}, r"PatchConfig.sparsity='0.3' must be a finite number \(an int or a float\)"),
        ({"hard": "yes"}, r"PatchConfig.hard='yes' must be True or False"),
        ({"init_std": float("nan")}, r"PatchConfig.init_std=nan must be a finite number.*e.g. init_std=0.014"),
        ({"lambda_norm": float("inf")}, r"PatchConfig.lambda_norm=inf must be a finite number"),
        ({"lambda_density": float("nan")}, r"PatchConfig.lambda_density=nan"),
        ({"prior_strength": float("nan")}, r"PatchConfig.prior_strength=nan"),
        ({"tau": (float("inf"), 1.0)}, r"PatchConfig.tau=\(inf, 1.0\) must be two finite numbers > 0 \(start, end\)"),
        ({"tau_nm": (1.0, float("nan"))}, r"PatchConfig.tau_nm=\(1.0, nan\)"),
        ({"kappa_nm": (float("inf"),) * 2}, r"PatchConfig.kappa_nm=\(inf, inf\).*e.g. kappa_nm=\(100.0, 500.0\)"),
        ({"kappa_tile": (25.0, 0)}, r"PatchConfig.kappa_tile=\(25.0, 0\) must be two finite numbers > 0"),
        ({"exclude": (None,)}, r"tuple of str globs"),
    ],
)
def test_config_errors_say_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        patchc.PatchConfig(**kwargs)


def test_config_takes_ints_where_floats_are_asked():
    cfg = patchc.PatchConfig(sparsity=0, tau=(2, 1), kappa_tile=(25, 350), lambda_norm=1, init_std=1, prior_strength=0)
    assert cfg.density == 1.0 and cfg.tau_nm == (2, 1)


def test_transform_refuses_a_model_without_linears():
    class NoLinear(torch.nn.Module):
        def forward(self, x):
            return x * 2

    with pytest.raises(ValueError, match="no maskable linear"):
        patchc.transform(NoLinear(), patchc.PatchConfig(tile=(8, 8)), example_inputs=(torch.ones(2, 4),))
    with pytest.raises(ValueError, match="example_inputs"):
        patchc.transform(NoLinear(), patchc.PatchConfig(tile=(8, 8)))


def test_hard_straight_through_forward_is_binary(tiny_mlp):
    ids = torch.randint(0, 32, (2, 6))
    prog = patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8), hard=True), example_inputs=(ids,)).train()
    m = prog.layers["up.weight"]
    mask = m.mask()
    assert set(torch.unique(mask.detach()).tolist()) <= {0.0, 1.0}
    groups = mask.detach().reshape(-1, 4).sum(-1)
    assert bool(((groups == 2) | (groups == 4)).all())
    mask.sum().backward()
    assert m.tile_logits.grad is not None and m.nm_logits.grad is not None


def test_block_scope_groups_by_transformer_block(tiny_mlp):
    from patchc.utils.names import block_index
    from patchc.masking.regularizer import density_groups

    assert block_index("model.layers.3.mlp.up_proj.weight") == 3
    assert block_index("transformer.h.11.attn.c_attn.weight") == 11
    assert block_index("encoder.block.2.layer.0.SelfAttention.q.weight") == 2
    assert block_index("fc.weight") is None
    model = tiny_hf("llama")
    prog = patchc.transform(_export_hf(model, False)[0], patchc.PatchConfig(tile=(16, 16), scope="block"))
    groups = density_groups(list(prog.layers.values()), "block")
    assert [len(g) for g in groups] == [7, 7]
    assert {block_index(m.name) for m in groups[1]} == {1}


def test_lm_loss_matches_cross_entropy(tiny_mlp):
    ids = torch.randint(0, 32, (2, 7))
    expected = F.cross_entropy(tiny_mlp(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    assert float(patchc.lm_loss(tiny_mlp, ids)) == pytest.approx(float(expected))


class GradRegions(torch.nn.Module):
    """HRM-style cycles: the first two under torch.no_grad(), the last under autocast(enabled=False) inside it
    nested; `cell` is read in every region and outside, `inner` only inside the no_grad region."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.cell, self.inner, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        with torch.no_grad():
            for _ in range(2):
                h = torch.tanh(self.cell(h) + self.inner(h))
            with torch.autocast("cpu", enabled=False):
                h = torch.tanh(self.cell(h))
        return self.head(torch.tanh(self.cell(h)))


def test_weights_read_inside_no_grad_and_autocast_regions_are_masked_there_too():
    """torch.export keeps such regions as subgraphs; a mask on only the reads outside them would train and
    evaluate a model that the plan does not describe (it did, for HRM)."""
    torch.manual_seed(0)
    model, ids = GradRegions().eval(), torch.randint(0, 32, (2, 5))
    prog = patchc.transform(model, patchc.PatchConfig(tile=(8, 8), sparsity=0.25, init_std=0.5), example_inputs=(ids,))
    assert set(prog.layers) == {"cell.weight", "inner.weight", "head.weight"} and not prog.skipped
    with prog.mask_mode("ones"):
        assert torch.equal(prog(ids), model(ids))
    prog.eval()
    y = prog(ids)
    assert torch.equal(patchc.harden(prog).apply(copy.deepcopy(model))(ids), y)
    assert not torch.allclose(y, model(ids), atol=1e-3)
    code = {n: m.code for n, m in prog.graph_module.named_modules() if isinstance(m, torch.fx.GraphModule)}
    seen: dict[str, int] = {}
    with prog.observe_inputs(lambda fqn, x: seen.update({fqn: seen.get(fqn, 0) + 1})):
        prog(ids)
    assert seen == {"cell.weight": 4, "inner.weight": 2, "head.weight": 1}  # every read, in every region
    assert {n: m.code for n, m in prog.graph_module.named_modules() if isinstance(m, torch.fx.GraphModule)} == code
    prog.train()
    prog(ids).logsumexp(-1).mean().backward()  # the model's own no_grad still holds: `inner` gets no gradient
    grads = {n: m.tile_logits.grad for n, m in prog.layers.items()}
    assert grads["inner.weight"] is None and grads["cell.weight"].abs().sum() > 0


def test_a_weight_also_read_inside_a_cond_branch_is_left_dense_and_says_why():
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.other = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.other(self.proj(x))
            return torch.cond(h.sum() > 0, lambda t: self.proj(t), lambda t: t * 2, (h,))

    x = torch.randn(3, 16)
    prog = patchc.transform(Branchy(), patchc.PatchConfig(tile=(8, 8)), example_inputs=(x,))
    assert set(prog.layers) == {"other.weight"}
    assert "cond" in prog.skipped["proj.weight"] and "does not rewrite" in prog.skipped["proj.weight"]


@pytest.mark.parametrize("b_first", [False, True], ids=["a-read-first", "b-read-first"])
@pytest.mark.parametrize("b_bias", [True, False], ids=["own-bias", "no-bias"])
def test_a_weight_two_linears_share_is_one_mask_under_its_first_name_on_every_read(b_bias, b_first):
    """ep.module() read the tied weight as `a.weight` in one place and `b.weight` in the other; the pass named
    both reads `b.weight` and masked only the second, so the program trained a model its plan did not
    describe (0.33 apart), and the backend, which sees the weight as `a.weight`, served none of it. Each
    read adds its own module's bias, in the plan (a's only) and under the backend (it added a's to b's
    read). Read through `b` first, dynamo names the weight `b.weight` (Zamba2's shared adapters): it is
    matched to `a.weight` by its values."""
    torch.manual_seed(0)
    model, x = TiedLinears(b_bias, b_first).eval(), torch.randn(3, 32)
    prog = patchc.transform(model, patchc.PatchConfig(tile=(16, 16), sparsity=0.35, init_std=0.5), example_inputs=(x,))
    assert list(prog.layers) == ["a.weight", "mid.weight"]  # named as model.named_parameters() names it
    seen: list[str] = []
    with torch.no_grad(), prog.observe_inputs(lambda fqn, _: seen.append(fqn)):
        prog(x)
    assert seen == ["a.weight", "mid.weight", "a.weight"]  # both reads go through the one mask, whichever first
    prog.eval()
    with torch.no_grad():
        y = prog(x)
        plan = patchc.harden(prog)
        assert torch.equal(plan.layers["a.weight"].bias, model.a.bias)
        assert torch.equal(plan.apply(copy.deepcopy(model))(x), y)
        torch._dynamo.reset()
        served = torch.compile(model, backend="patch", options={"plan": plan, "tune": False})(x)
    torch.testing.assert_close(served, y, atol=1e-5, rtol=1e-5)
    assert not patchc.runtime.unserved(plan)


LOOKUPS = {
    "index": lambda tok, ids: tok[ids],
    "index_select": lambda tok, ids: tok.index_select(0, ids.flatten()).view(*ids.shape, -1),
    "gather": lambda tok, ids: tok.gather(0, ids.flatten()[:, None].expand(-1, tok.shape[1])).view(*ids.shape, -1),
    "embedding": lambda tok, ids: F.embedding(ids, tok),
}


@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
def test_a_weight_a_lookup_also_reads_is_left_dense_and_says_why(lookup):
    """`self.tok[ids]` and `h @ self.tok.T`: the mask went on the matmul's read only, so training saw the dense
    table in the lookup while plan.apply wrote W * M into the one parameter (the applied model differed)."""
    class IndexTied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.mid = torch.nn.Parameter(torch.randn(64, 32) * 0.1), torch.nn.Linear(32, 32)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.mid(LOOKUPS[lookup](self.tok, ids)) @ self.tok.T

    torch.manual_seed(0)
    model, ids = IndexTied().eval(), torch.randint(0, 64, (2, 8))
    prog = patchc.transform(model, patchc.PatchConfig(tile=(16, 16), init_std=0.5), example_inputs=(ids,))
    assert list(prog.layers) == ["mid.weight"]
    assert "lookup" in prog.skipped["tok"] and "tied LM head" in prog.skipped["tok"]
    prog.eval()
    with torch.no_grad():
        assert torch.equal(patchc.harden(prog).apply(copy.deepcopy(model))(ids), prog(ids))


def test_a_model_whose_weights_are_not_loaded_is_refused_naming_a_layer():
    """A meta model was 'initialised' on meta, and harden failed later on torch's 'Cannot copy out of meta tensor'."""
    with torch.device("meta"):
        model, x = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)), torch.empty(4, 32)
    for program, inputs in ((model, (x,)), (torch.export.export(model, (x,)), None)):
        with pytest.raises(ValueError, match=r"'0.weight' \(and 3 more\) holds no values \(on the meta device\): "
                                             "load the weights first"):
            patchc.transform(program, patchc.PatchConfig(tile=(16, 16)), example_inputs=inputs)


def test_a_linear_weight_held_in_a_buffer_is_skipped_with_the_reason():
    """`F.linear(x, self.w)` over a registered buffer crashed transform: "'w' is not an nn.Parameter"."""
    class BufferWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(32, 32)
            self.register_buffer("w", torch.randn(32, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(self.a(x), self.w)

    model, x = BufferWeight().eval(), torch.randn(4, 32)
    prog = patchc.transform(torch.export.export(model, (x,)), patchc.PatchConfig(tile=(16, 16)))
    assert list(prog.layers) == ["a.weight"] and "buffer" in prog.skipped["w"]
    prog.eval()
    with torch.no_grad():
        assert torch.equal(patchc.harden(prog).apply(copy.deepcopy(model))(x), prog(x))


def test_globs_that_match_nothing_and_a_replaced_default_exclude_warn_and_select_as_before():
    """include=("*q_proj", ...) masked no q_proj (FQNs end in ".weight"), and exclude=("*self_atn*",), a typo, masked
    every projection and the LM head too (a user's exclude replaces the default), both without a word."""
    ep, _ = _export_hf(tiny_hf("llama"), decompose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults, or the defaults and more, say nothing
        patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), exclude=(*patchc.DEFAULT_EXCLUDE, "*q_proj*")))
        plain = set(patchc.transform(ep, patchc.PatchConfig(tile=(16, 16))).layers)
    with pytest.warns(UserWarning) as seen:
        prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), include=("*q_proj", "*mlp*")))
    assert len(seen) == 1 and "include glob '*q_proj' matched no matmul weight" in str(seen[0].message)
    assert "'*q_proj.weight' would match 'model.layers.0.self_attn.q_proj.weight'" in str(seen[0].message)
    assert set(prog.layers) == {n for n in plain if ".mlp." in n}
    with pytest.warns(UserWarning) as seen:
        prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), exclude=("*self_atn*",)))
    said = str(seen[0].message)
    assert len(seen) == 1 and "exclude glob '*self_atn*' matched no matmul weight; lm_head.weight is masked" in said
    assert "your exclude replaces the default" in said and "add '*lm_head*' to keep it dense" in said
    assert set(prog.layers) == plain | {"lm_head.weight"}
