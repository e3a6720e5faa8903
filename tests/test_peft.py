"""A pruned model with LoRA adapters (PEFT, unmerged) served by patchc.compile and by backend="patch".

PEFT moves each wrapped linear's weight to "<linear>.base_layer.weight" and, in a `PeftModel`, the whole
model under "base_model.model."; dynamo names those weights through `__dict__['_modules']` (PEFT's modules
override __getattr__). A plan made on the model before wrapping must still find every weight, and the
adapters must keep adding their deltas: the reference is the wrapped model with the plan applied, run eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch

import patchc
from patchc.ir.targets import find_param, peft_free
from patchc.runtime.dispatch import TileLinear
from tests.conftest import tiny_llama_and_24_plan

peft = pytest.importorskip("peft", reason="peft is in the test extra: pip install -e '.[test]'")
transformers = pytest.importorskip("transformers")

OP = torch.ops.patchc.tile_linear.default


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA on q_proj and v_proj with non-zero B, so the adapters change the outputs."""
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(2)
    return peft.get_peft_model(copy.deepcopy(model), config).eval()


def _served_by_the_backend(dense_lora, pruned_lora, plan, seed: int) -> int:
    """The planned weights the backend's graphs of `dense_lora` served, once it gave `pruned_lora`'s logits
    (strict: none left dense) and `unserved(plan)` is empty."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(seed))
    counts = []
    torch._dynamo.reset()
    cm = torch.compile(dense_lora, backend="patch", options={"plan": plan, "strict": True, "tune": False,
                                                             "graph_callback": lambda gm, n: counts.append(n)})
    with torch.no_grad():
        torch.testing.assert_close(cm(ids).logits, pruned_lora(ids).logits, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    assert patchc.runtime.unserved(plan) == {}
    return sum(counts)


def test_plan_names_find_the_weights_peft_moved():
    model, plan = tiny_llama_and_24_plan()
    wrapped = _lora(model)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert find_param(wrapped, q) == "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert find_param(wrapped, "model.layers.0.self_attn.k_proj.weight") == \
        "base_model.model.model.layers.0.self_attn.k_proj.weight"  # not wrapped: only the prefix moves
    assert find_param(model, q) == q and find_param(wrapped, "model.layers.0.nope.weight") is None
    assert peft_free(find_param(wrapped, q)) == q
    applied = plan.apply(wrapped)  # writes W * M through the moved names
    assert torch.equal(applied.get_parameter(find_param(wrapped, q)), plan.layers[q].to_dense())


def test_patchc_compile_serves_the_base_weights_and_keeps_the_adapters():
    model, plan = tiny_llama_and_24_plan()
    pruned_lora = _lora(plan.apply(copy.deepcopy(model)))
    dense_lora = _lora(model)  # the same adapters (same seed) on the dense weights
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    fast = patchc.compile(dense_lora, plan, tune=False)
    with torch.no_grad():
        got, want, without = fast(ids).logits, pruned_lora(ids).logits, plan.apply(copy.deepcopy(model))(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, without, atol=1e-3)  # the adapters change the outputs
    assert sum(isinstance(m, TileLinear) for m in fast.modules()) == len(plan.layers) == 14
    assert isinstance(fast.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer"), TileLinear)


def test_the_backend_serves_the_base_weights_and_keeps_the_adapters():
    model, plan = tiny_llama_and_24_plan()
    pruned_lora = _lora(plan.apply(copy.deepcopy(model)))
    dense_lora = _lora(model)
    assert _served_by_the_backend(dense_lora, pruned_lora, plan, seed=3) == 14


def test_generate_through_the_backend_keeps_the_adapted_pruned_models_tokens():
    """generate() on the LoRA-wrapped dense model, its inner model's forward compiled with the plan: three
    graphs (prompt, first step, dynamic length), each serving all 14 planned weights by their PEFT names."""
    model, plan = tiny_llama_and_24_plan()
    wrapped, reference = _lora(model), _lora(plan.apply(copy.deepcopy(model)))
    inner = wrapped.base_model.model
    counts = []
    torch._dynamo.reset()
    inner.forward = torch.compile(inner.forward, backend="patch", options={
        "plan": plan, "strict": True, "tune": False, "graph_callback": lambda gm, n: counts.append(n)})
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = wrapped.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
        want = reference.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    torch._dynamo.reset()
    assert torch.equal(got, want) and counts == [14, 14, 14]


def test_a_graph_break_inside_each_lora_layer_still_serves_its_base_weight(monkeypatch):
    """A break in a LoRA layer's forward starts a graph inside it, which reads the base weight as
    "base_layer.weight" and is reused for all four wrapped linears: each is matched by its values and served."""
    model, plan = tiny_llama_and_24_plan()
    dense_lora, pruned_lora = _lora(model), _lora(plan.apply(copy.deepcopy(model)))
    lora_forward = peft.tuners.lora.layer.Linear.forward

    def forward_after_a_break(self, x, *args, **kwargs):
        torch._dynamo.graph_break()
        return lora_forward(self, x, *args, **kwargs)

    monkeypatch.setattr(peft.tuners.lora.layer.Linear, "forward", forward_after_a_break)
    assert _served_by_the_backend(dense_lora, pruned_lora, plan, seed=5) == 14  # 4 LoRA graphs serve one each
