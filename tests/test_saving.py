"""`save_pretrained` of a compiled model writes the pruned model it serves (`patchc.runtime.saving`).

Before, it wrote each replaced linear's packed buffers: transformers loaded the folder with those weights
missing, initialised at random, and only printed a load report. The folder must load with transformers
alone and give the plan-applied model's logits: Llama (nn.Linear), GPT-2 (Conv1D, stored (K, N)), and
fused experts (Qwen3-MoE, Llama 4 stored (E, K, N), gpt-oss with biases), from the CPU fallback's W * M and
from the grouped kernels' stacked buffers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

import patchc
from patchc.codegen.reference import random_24_mask
from patchc.ir import TilePlan
from patchc.runtime.experts import TileExperts
from patchc.runtime.saving import dense_state_dict

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


def _pruned_plan(model: torch.nn.Module) -> TilePlan:
    """A plan of every decoder matrix, 2:4 along K of its (N, K) view; a Conv1D's (K, N) weight transposed."""
    g = torch.Generator().manual_seed(1)
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D") and "lm_head" not in name:
            conv = type(module).__name__ == "Conv1D"
            w = module.weight.data.t() if conv else module.weight.data
            w.mul_(random_24_mask(*w.shape, g).to(w.dtype))
    return TilePlan.from_linears(model, tile=(16, 16))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_compiled_model_saves_the_pruned_model_transformers_loads(family, tmp_path):
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
    else:
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plan = _pruned_plan(model)  # `model` now holds W * M
    assert len(plan.layers) == (14 if family == "llama" else 8)
    fast = patchc.compile(model, plan, tune=False)
    # each planned weight goes where it is asked as it is unpacked (save_pretrained: the host), the rest stays
    elsewhere = dense_state_dict(fast, "meta")
    assert sorted(k for k, v in elsewhere.items() if v.is_meta) == sorted(plan.layers)
    fast.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(k.endswith((".values", ".meta", ".dense_rowptr")) for k in keys)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
        torch.testing.assert_close(fast(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    again = TilePlan.from_linears(loaded, tile=(16, 16))  # the plan, read back off the saved zeros
    assert {n: lp.n_sparse for n, lp in again.layers.items()} == {n: lp.n_sparse for n, lp in plan.layers.items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4", "gpt_oss"])  # (E, N, K); (E, K, N); with biases
def test_fused_experts_save_as_their_3d_weights_from_either_form(family, tmp_path):
    from tests.test_families import TILE, exported

    case, ep = exported(family)
    plan = patchc.harden(patchc.transform(ep, patchc.PatchConfig(tile=TILE, sparsity=0.35, init_std=0.5)))
    pruned = plan.apply(copy.deepcopy(case.model))
    fast = patchc.compile(case.model, plan, tune=False)
    want = pruned.state_dict()
    experts = [(p, m) for p, m in fast.named_modules() if isinstance(m, TileExperts)]
    assert experts and all(m.kernels for _, m in experts)  # the interpreter builds the grouped kernels too
    for _ in range(2):  # the CPU fallback's W * M, then (without it) the kernels' stacked buffers
        got = dense_state_dict(fast)
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=key)
        for _, module in experts:
            for proj in module.names:
                setattr(module, f"{proj}_dense", None)
    fast.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(case.run(loaded), case.run(pruned), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the GPU memory a save holds")
def test_saving_a_model_on_a_gpu_unpacks_one_weight_at_a_time_there(tmp_path):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plan = _pruned_plan(model)
    fast = patchc.compile(model.cuda(), plan, tune=False)
    dense_bytes = sum(lp.shape[0] * lp.shape[1] * 4 for lp in plan.layers.values())  # fp32
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fast.save_pretrained(tmp_path)
    torch.cuda.synchronize()
    # all of them at once before; now the one being unpacked (the largest is 1/9 of them) and its temporaries
    assert torch.cuda.max_memory_allocated() - before < dense_bytes / 2
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, layer in plan.layers.items():
        torch.testing.assert_close(loaded.get_parameter(name), layer.to_dense(), atol=0, rtol=0)
