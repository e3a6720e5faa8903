"""The model-family matrix (issue 14): tiny random-initialised transformers 5 models, one per family.

Under transformers 4.x the families it lacks, and the MoE families it runs in a data-dependent loop over the
experts (they do not export), skip.

For each family: patchc masks exactly the weights it should (every projection and every expert slice;
embeddings, LM heads and MoE routers stay dense and are listed as skipped), the ones-mask program is the
original model, `harden` -> `plan.apply` equals the eval-mode program, and `patchc.compile` (CPU reference
kernels) equals the plan-applied model. Nothing is downloaded.

Speed (the whole suite has a time cap): each family is exported once (`exported`, shared with the tests
beyond the matrix and tests/test_calibrate_experts.py), and the compiled models run the plain-PyTorch CPU
path: under TRITON_INTERPRET=1 the interpreted kernels took ~30 s per family; they are checked against the
reference in tests/test_codegen_interp.py and tests/test_runtime.py.
"""

from __future__ import annotations

import copy
import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch import nn

import patchc
from patchc.config import PatchConfig
from patchc.models.hf import transformers_major
from patchc.runtime.dispatch import TileLinear
from patchc.runtime.experts import TileExperts

transformers = pytest.importorskip("transformers")

TRANSFORMERS_4 = transformers_major() < 5
TILE = (16, 16)
VOCAB, HIDDEN, HEADS = 128, 64, 4
BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
            max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, num_key_value_heads=2)


def _build(name: str) -> nn.Module:
    t = transformers
    cfgs = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(intermediate_size=64, num_key_value_heads=2, **BASE)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(intermediate_size=64, num_key_value_heads=2, **BASE)),
        "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(intermediate_size=64, num_key_value_heads=2, head_dim=16, **BASE)),
        "qwen2_moe": lambda: t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, **MOE, **BASE)),
        "qwen3_moe": lambda: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, head_dim=16, **MOE, **BASE)),
        "mixtral": lambda: t.MixtralForCausalLM(t.MixtralConfig(intermediate_size=64, num_local_experts=4, **MOE, **BASE)),
        "olmoe": lambda: t.OlmoeForCausalLM(t.OlmoeConfig(intermediate_size=32, num_experts=4, pad_token_id=0,
                                                          bos_token_id=1, eos_token_id=2, **MOE, **BASE)),
        "gemma3": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(intermediate_size=64, num_key_value_heads=2, head_dim=16,
                                                                 sliding_window=8, **BASE)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(intermediate_size=64, num_key_value_heads=2, **BASE)),
        "phi3": lambda: t.Phi3ForCausalLM(t.Phi3Config(intermediate_size=64, num_key_value_heads=2, pad_token_id=0, **BASE)),
        "opt": lambda: t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, ffn_dim=64,
                                                    num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN,
                                                    max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                                    eos_token_id=2)),
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(intermediate_size=64, **BASE)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=HEADS,
                                                       n_positions=64, bos_token_id=1, eos_token_id=2)),
        "falcon": lambda: t.FalconForCausalLM(t.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1,
                                                             num_attention_heads=HEADS)),
        "gemma2": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(intermediate_size=64, num_key_value_heads=2, head_dim=16,
                                                             sliding_window=8, **BASE)),
        "glm4": lambda: t.Glm4ForCausalLM(t.Glm4Config(intermediate_size=64, num_key_value_heads=2, head_dim=16,
                                                       pad_token_id=0, eos_token_id=2, **BASE)),
        "granite": lambda: t.GraniteForCausalLM(t.GraniteConfig(intermediate_size=64, num_key_value_heads=2, **BASE)),
        "olmo2": lambda: t.Olmo2ForCausalLM(t.Olmo2Config(intermediate_size=64, num_key_value_heads=2, pad_token_id=0,
                                                          eos_token_id=2, **BASE)),
        "smollm3": lambda: t.SmolLM3ForCausalLM(t.SmolLM3Config(intermediate_size=64, num_key_value_heads=2, pad_token_id=0,
                                                                bos_token_id=1, eos_token_id=2, **BASE)),
        "cohere": lambda: t.CohereForCausalLM(t.CohereConfig(intermediate_size=64, num_key_value_heads=2, pad_token_id=0,
                                                             eos_token_id=2, **BASE)),
        "stablelm": lambda: t.StableLmForCausalLM(t.StableLmConfig(intermediate_size=64, num_key_value_heads=2, **BASE)),
        "phi": lambda: t.PhiForCausalLM(t.PhiConfig(intermediate_size=64, **BASE)),
        "ernie4_5": lambda: t.Ernie4_5ForCausalLM(t.Ernie4_5Config(intermediate_size=64, num_key_value_heads=2, head_dim=16,
                                                                   **BASE)),
        "gpt_oss": lambda: t.GptOssForCausalLM(t.GptOssConfig(intermediate_size=32, num_local_experts=4, head_dim=16,
                                                              **MOE, **BASE)),
        "deepseek_v3": lambda: t.DeepseekV3ForCausalLM(t.DeepseekV3Config(  # MLA attention, shared + routed experts
            intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0,
            n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, **{**MOE, "num_key_value_heads": HEADS}, **BASE)),
        # Gated DeltaNet (chunked linear attention): one graph per sequence length
        "qwen3_5": lambda: t.Qwen3_5ForCausalLM(t.Qwen3_5TextConfig(
            intermediate_size=64, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention"], **BASE)),
        # Mamba-2 + attention + fused experts; its forward takes use_cache only through **kwargs
        "granitemoehybrid": lambda: t.GraniteMoeHybridForCausalLM(t.GraniteMoeHybridConfig(
            intermediate_size=32, shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
            num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
            layer_types=["mamba", "attention"], **{**BASE, "num_hidden_layers": 2})),
        # a vision-language checkpoint: the text decoder is pruned, the vision tower never runs on text
        "gemma3_vlm": lambda: t.Gemma3ForConditionalGeneration(t.Gemma3Config(
            text_config=dict(intermediate_size=64, num_key_value_heads=2, head_dim=16, **BASE),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)),
        "llama4": lambda: t.Llama4ForCausalLM(t.Llama4TextConfig(intermediate_size=32, intermediate_size_mlp=64,
                                                                 num_local_experts=4, num_experts_per_tok=1,
                                                                 num_key_value_heads=2, head_dim=16, **BASE)),
        "bert": lambda: t.BertModel(t.BertConfig(intermediate_size=64, **BASE)),
        "t5": lambda: t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=64,
                                                              num_layers=1, num_decoder_layers=1, num_heads=HEADS)),
    }
    torch.manual_seed(0)
    if TRANSFORMERS_4 and name in _LOOPED_IN_4:  # patchc names the layer in one line: tests/test_hf_models.py
        pytest.skip(f"transformers {t.__version__} runs {name}'s experts in a data-dependent Python loop, which "
                    "torch.export cannot trace")
    if TRANSFORMERS_4 and name in _CLASSES and not hasattr(t, _CLASSES[name]):
        pytest.skip(f"transformers {t.__version__} has no {name}")
    return cfgs[name]().eval()


# Families newer than transformers 4.57, the last 4.x (its other families build with the same configs).
_CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM"}
# MoE families whose transformers 4 layers loop over the experts the router picked (5 runs one grouped op).
_LOOPED_IN_4 = {"qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "granitemoehybrid"}


FAMILIES = ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gemma3", "mistral", "phi3",
            "opt", "gpt_neox", "gpt2", "falcon", "bert", "t5", "gemma2", "glm4", "granite", "olmo2", "smollm3", "cohere",
            "stablelm", "phi", "ernie4_5", "gpt_oss", "deepseek_v3", "llama4", "qwen3_5", "granitemoehybrid", "gemma3_vlm"]
# Dense decoders whose every planned weight is an nn.Linear of a kind the families above already cover
# (Llama's projections, Qwen3's q/k norms, Phi-3's fused ones): their larger form, `make test-full` (~25 s).
SAME_PATHS = {"mistral", "gemma2", "glm4", "granite", "olmo2", "smollm3", "cohere", "stablelm", "phi", "ernie4_5"}
# 3-D expert weights: one plan layer per expert slice (transformers 4's OLMoE: a ModuleList of Linears)
FUSED_EXPERTS = {"qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "llama4", "granitemoehybrid"}
if TRANSFORMERS_4:
    FUSED_EXPERTS.discard("olmoe")


class Case:
    """A family's model with how to export and call it."""

    def __init__(self, name: str) -> None:
        from patchc.models.hf import EncoderWrapper

        self.name = name
        model = _build(name)
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, VOCAB, (2, 9), generator=gen)
        self.kwargs: dict = {}
        self.args: tuple = ()
        if name == "bert":
            model = EncoderWrapper(model).eval()
            self.args = (torch.ones_like(self.ids),)  # attention mask, positional as exported
        elif name == "t5":
            self.kwargs = {"decoder_input_ids": torch.randint(3, VOCAB, (2, 5), generator=gen)}
        self.model = model

    def export(self) -> torch.export.ExportedProgram:
        from patchc.models.hf_export import export_causal_lm, export_encoder

        if self.name == "bert":
            return export_encoder(self.model)
        if self.name == "t5":
            return torch.export.export(self.model, (self.ids,), kwargs={**self.kwargs, "use_cache": False})
        return export_causal_lm(self.model, fixed_len=self.ids.shape[1])  # a per-length family: one graph, the one run

    def run(self, model) -> torch.Tensor:
        kwargs = dict(self.kwargs)
        if self.name != "bert" and not isinstance(model, patchc.MaskedProgram):
            kwargs["use_cache"] = False  # the program remembers it from the export
        with torch.no_grad():
            out = model(self.ids, *self.args, **kwargs)
        return out if isinstance(out, torch.Tensor) else out[0]


def expected_layers(model: nn.Module, cfg: PatchConfig) -> tuple[set[str], set[str]]:
    """(layer names patchc should mask, router weights it should skip), read off the module tree."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names, routers = set(), set()
    for path, module in model.named_modules():
        conv1d = type(module).__name__ == "Conv1D"
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) or conv1d:
            fqn = f"{path}.weight"
            shape = tuple(weight.shape[::-1] if conv1d else weight.shape)
            if any(g in (cfg.selects(fqn, shape) or "") for g in ("router",)):
                routers.add(fqn)
            elif id(weight) not in embedded and cfg.selects(fqn, shape) is None:
                names.add(fqn)
        elif isinstance(weight, nn.Parameter) and weight.dim() == 2 and path.endswith((".gate", ".router")):
            routers.add(f"{path}.weight")  # HF 5 routers are plain modules holding a weight
        for pname, p in module.named_parameters(recurse=False):
            fused = p.dim() == 3 and not isinstance(module, nn.Conv1d)
            if fused and cfg.selects(f"{path}.{pname}", tuple(p.shape[1:])) is None:  # one layer per expert slice
                names.update(f"{path}.{pname}.{e}" for e in range(p.shape[0]))
    return names, routers


@functools.lru_cache(maxsize=None)
def exported(name: str) -> tuple[Case, torch.export.ExportedProgram]:
    """The family's Case and its exported program, built once per test session (transform never changes
    either: it works on its own copy of `ep.module()` over the same, frozen, weights)."""
    case = Case(name)
    return case, case.export()


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.full) if n in SAME_PATHS else n
                                        for n in FAMILIES])
def family(request):
    case, ep = exported(request.param)
    cfg = PatchConfig(tile=TILE, sparsity=0.35, init_std=0.5)  # wide init: a plan with dense and 2:4 tiles
    prog = patchc.transform(ep, cfg)
    return case, cfg, prog


def test_masks_exactly_the_expected_layers(family):
    case, cfg, prog = family
    expected, routers = expected_layers(case.model, cfg)
    assert set(prog.layers) == expected
    assert routers <= set(prog.skipped), f"routers not listed as skipped: {routers - set(prog.skipped)}"
    assert all("router" in prog.skipped[r] for r in routers)
    experts = [n for n in prog.layers if n.rsplit(".", 1)[-1].isdigit()]
    assert bool(experts) == (case.name in FUSED_EXPERTS)


def test_ones_mask_is_the_original_model(family):
    case, _, prog = family
    ref = case.run(case.model)
    with prog.mask_mode("ones"):
        torch.testing.assert_close(case.run(prog), ref, atol=1e-5, rtol=1e-5)


def test_plan_apply_equals_eval_program_and_runtime_equals_plan(family):
    case, _, prog = family
    prog.eval()
    evald = case.run(prog)
    plan = patchc.harden(prog)
    assert set(plan.layers) == set(prog.layers)
    assert 0 < sum(int((lp.kinds == 1).sum()) for lp in plan.layers.values()) < sum(lp.kinds.numel() for lp in plan.layers.values())
    pruned = plan.apply(copy.deepcopy(case.model))
    applied = case.run(pruned)
    torch.testing.assert_close(applied, evald, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(applied, case.run(case.model), atol=1e-4)  # the plan really prunes
    fast = patchc.compile(case.model, plan, tune=False, strict=True)
    replaced = [m for m in fast.modules() if isinstance(m, (TileLinear, TileExperts))]  # TileBmmExperts too
    with_24 = {n.rsplit(".", 2)[0] if n.rsplit(".", 1)[-1].isdigit() else n
               for n, lp in plan.layers.items() if bool((lp.kinds == 1).any())}
    assert len(replaced) >= len(with_24) > 0
    torch.testing.assert_close(case.run(fast), applied, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- beyond the matrix


def test_expert_plan_names_slices_and_apply_writes_only_that_expert():
    from patchc.ir.targets import resolve

    case, ep = exported("mixtral")
    prog = patchc.transform(ep, PatchConfig(tile=TILE, init_std=0.5))
    plan = patchc.harden(prog)
    name = "model.layers.0.mlp.experts.down_proj.2"
    assert plan.layers[name].shape == (HIDDEN, 64)  # (out, in) of one expert, stored (E, N, K)
    assert plan.meta["targets"][name] == {"param": name[:-2], "expert": 2, "transposed": False}
    model = copy.deepcopy(case.model)
    before = model.get_parameter(name[:-2]).detach().clone()
    only = patchc.TilePlan(layers={name: plan.layers[name]}, meta={"targets": {name: plan.meta["targets"][name]}})
    only.apply(model, force=True)
    after = model.get_parameter(name[:-2])
    assert torch.equal(after[2], plan.layers[name].to_dense()) and not torch.equal(after[2], before[2])
    assert torch.equal(after[[0, 1, 3]], before[[0, 1, 3]])  # tiles never cross experts
    assert resolve(model, name).expert == 2  # also without the recorded target
    with pytest.raises(patchc.ir.PlanError, match="has no expert 9|out of range"):
        resolve(model, name[:-2] + ".9")


@pytest.mark.parametrize("impl", ["batched_mm", "eager"])
def test_experts_set_to_another_implementation_export_as_one_grouped_mm(impl):
    """A model set to batched_mm (a weight gathered per token) or eager (a loop over the experts hit) is
    exported with grouped_mm, the form masked slice by slice, and keeps its own setting afterwards."""
    from patchc.models.hf_export import export_causal_lm

    case, ep = exported("qwen3_moe")
    want = set(patchc.transform(ep, PatchConfig(tile=TILE)).layers)
    model = copy.deepcopy(case.model)
    model.set_experts_implementation(impl)
    prog = patchc.transform(export_causal_lm(model), PatchConfig(tile=TILE))
    assert set(prog.layers) == want and any(n.endswith("gate_up_proj.3") for n in want)
    assert model.get_experts_implementation()[""] == impl


def test_conv1d_is_masked_as_its_transpose_and_the_fingerprint_check_reads_it():
    case, ep = exported("gpt2")
    prog = patchc.transform(ep, PatchConfig(tile=TILE, init_std=0.5))
    plan = patchc.harden(prog)
    fc = "transformer.h.0.mlp.c_fc.weight"
    assert case.model.get_parameter(fc).shape == (HIDDEN, 4 * HIDDEN)  # Conv1D stores (in, out)
    assert plan.layers[fc].shape == (4 * HIDDEN, HIDDEN) and plan.meta["targets"][fc]["transposed"] is True
    other = copy.deepcopy(case.model)
    with torch.no_grad():
        other.get_parameter(fc).mul_(1.5)
    with pytest.raises(patchc.ir.PlanError, match=fc):
        plan.apply(other)


def test_router_exclusion_can_be_overridden_and_is_explained():
    cfg = PatchConfig(tile=TILE)
    assert "router" in cfg.selects("model.layers.0.mlp.gate.weight", (4, 64))
    assert cfg.selects("model.layers.0.mlp.gate_proj.weight", (64, 64)) is None  # not a router
    assert PatchConfig(tile=(4, 16), exclude=()).selects("model.layers.0.mlp.gate.weight", (4, 64)) is None


def test_llama4_experts_are_masked_per_expert_as_stored_k_by_n_on_their_routed_tokens():
    """Llama 4 multiplies every expert at once, `torch.bmm(x (E, T, K), W (E, K, N))`, every token scaled by
    its router score (0 where not picked); exported in its traced form (the picked pairs through grouped
    mms): one (N, K) layer per expert slice, recorded as transposed, and expert e sees the tokens routed to
    it only."""
    from patchc.ir.targets import META_KEY

    case, ep = exported("llama4")
    prog = patchc.transform(ep, PatchConfig(tile=TILE, init_std=0.5))
    gate_up = "model.layers.0.feed_forward.experts.gate_up_proj"
    down = gate_up.replace("gate_up", "down")
    assert prog.layers[f"{gate_up}.3"].shape == (64, 64) and prog.layers[f"{down}.0"].shape == (64, 32)
    targets = patchc.harden(prog).meta[META_KEY]
    assert targets[f"{gate_up}.1"] == {"param": gate_up, "expert": 1, "transposed": True}
    seen: dict[str, int] = {}
    with prog.observe_inputs(lambda fqn, x: seen.__setitem__(fqn, seen.get(fqn, 0) + x.shape[0])):
        with prog.mask_mode("ones"):  # the dense model's routing
            case.run(prog)
    moe = case.model.model.layers[0].feed_forward
    picked = []
    handle = moe.router.register_forward_hook(lambda m, args, out: picked.append(out[1].topk(m.top_k, dim=1).indices))
    with torch.no_grad():
        case.run(case.model)
    handle.remove()
    rows = {n: seen.get(n, 0) for n in prog.layers if n.startswith(gate_up)}
    assert rows == {f"{gate_up}.{e}": int((picked[0] == e).sum()) for e in range(4)}
    assert sum(rows.values()) == case.ids.numel()  # top-1: one row per token, not one per expert


def test_a_3d_weight_broadcast_by_bmm_is_skipped_not_taken_for_experts():
    class Shared(nn.Module):  # one (K, N) matrix for every batch entry: its dim 0 is not an expert axis
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(1, 32, 16))

        def forward(self, x):
            return torch.bmm(x, self.w.expand(x.shape[0], -1, -1))

    ep = torch.export.export(Shared(), (torch.randn(3, 5, 32),))
    with pytest.raises(ValueError, match="no maskable"):
        patchc.transform(ep, PatchConfig(tile=TILE))
    from patchc.passes.find_linears import find_linear_sites

    sites, skipped = find_linear_sites(ep.module(), PatchConfig(tile=TILE))
    assert not sites and "broadcast to another batch by bmm" in skipped["w"]


def test_transform_twice_is_a_clear_error():
    _, ep = exported("llama")
    prog = patchc.transform(ep, PatchConfig(tile=TILE))
    with pytest.raises(ValueError, match="already transformed"):
        patchc.transform(prog, PatchConfig(tile=TILE))
    with pytest.raises(ValueError, match="already transformed"):
        patchc.transform(prog.graph_module, PatchConfig(tile=TILE))


def test_readme_loop_lm_loss_on_an_hf_export():
    _, ep = exported("qwen2_moe")
    prog = patchc.transform(ep, PatchConfig(tile=TILE, steps=3))
    assert prog.call_kwargs == {"use_cache": False}
    opt = torch.optim.Adam(prog.mask_parameters(), lr=1e-2)
    ids = torch.randint(3, VOCAB, (2, 9))
    before = {n: m.nm_logits.detach().clone() for n, m in prog.layers.items()}
    for _ in range(2):
        loss = patchc.lm_loss(prog, ids) + prog.regularizer()
        opt.zero_grad()
        loss.backward()
        opt.step()
        prog.step()
    assert torch.isfinite(loss)
    moved = [n for n, m in prog.layers.items() if not torch.equal(m.nm_logits, before[n])]
    assert any(".experts." in n for n in moved)  # expert masks train too


def test_exact_budget_hits_the_target_and_moves_only_tiles_at_the_cut():
    _, ep = exported("llama")
    prog = patchc.transform(ep, PatchConfig(tile=TILE, sparsity=0.45, init_std=0.5))
    signs, exact = patchc.harden(prog), patchc.harden(prog, exact_budget=True)
    total = sum(lp.numel for lp in exact.layers.values())
    assert abs(exact.density - 0.55) <= 0.5 * TILE[0] * TILE[1] / total + 1e-12
    logits = torch.cat([m.tile_logits.detach().flatten() for m in prog.layers.values()])
    a = torch.cat([lp.kinds.flatten() for lp in signs.layers.values()])
    b = torch.cat([lp.kinds.flatten() for lp in exact.layers.values()])
    moved = a != b
    if moved.any():  # every moved tile lies between the cut and 0: the rest equal the eval-mode masks
        dense_exact = logits[b == 0]
        cut = float(dense_exact.min()) if dense_exact.numel() else float("inf")
        assert bool(((logits[moved] >= min(cut, 0)) & (logits[moved] <= max(cut, 0))).all())


def test_calibrating_the_program_sees_each_expert_on_its_own_tokens():
    case, ep = exported("olmoe")
    prog = patchc.transform(ep, PatchConfig(tile=TILE))
    seen: dict[str, int] = {}
    with prog.observe_inputs(lambda fqn, x: seen.__setitem__(fqn, seen.get(fqn, 0) + x.shape[0])):
        case.run(prog)
    experts = [n for n in prog.layers if ".experts.gate_up_proj." in n  # transformers 4: experts.<e>.gate_proj
               or (".experts." in n and n.endswith(".gate_proj.weight"))]
    assert len(experts) == case.model.config.num_experts
    tokens = case.ids.numel() * case.model.config.num_experts_per_tok
    assert sum(seen.get(n, 0) for n in experts) == tokens  # every routed token once, split by expert


# `patchc prune` on a MoE directory (with baselines): tests/test_calibrate_experts.py
# TileExperts / TileBmmExperts against the transformers modules: tests/test_experts_runtime.py


def test_chunked_mixers_export_per_length_and_kwargs_only_use_cache_exports_without_it():
    from patchc.models.per_length import PerLengthExport

    case, ep = exported("qwen3_5")  # Gated DeltaNet loops over 64-token chunks: one graph per length
    assert isinstance(ep, PerLengthExport) and "GatedDeltaNet" in ep.reason
    case, ep = exported("granitemoehybrid")
    assert isinstance(ep, PerLengthExport) and case.model.config.use_cache is True  # restored after the export
    out = ep.first.module()(torch.randint(3, VOCAB, (2, ep.length)))  # called without use_cache
    assert out.logits.shape == (2, ep.length, VOCAB)


def test_a_vision_language_checkpoint_loads_whole_and_prunes_its_text_decoder(tmp_path):
    from patchc.models.hf import hf_config, hf_kind, load_hf_causal
    from patchc.pruning.calibrate import default_layers

    case, _ = exported("gemma3_vlm")
    case.model.save_pretrained(tmp_path / "vlm")
    assert hf_kind(hf_config(tmp_path / "vlm")) == "causal"  # was refused as seq2seq (*ForConditionalGeneration)
    model, _ = load_hf_causal(tmp_path / "vlm")
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"  # whole: a pruned model still takes images
    layers = default_layers(model)  # what calibration and the one-shot baselines prune
    assert layers and all(name.startswith("model.language_model.") for name in layers), sorted(layers)[:4]
    assert "vision / audio side" in PatchConfig().selects("model.vision_tower.encoder.layers.0.mlp.fc1.weight", (64, 32))
