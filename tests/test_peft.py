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


# --- LoRA over a compressed model (`patchc.register_lora`) ------------------------------------------
def _lora_config(**kw):
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **kw)


def _adapted_compressed(model, plan, device: str = "cpu"):
    """LoRA (seeded) on the model `patchc.compile` packed, and the same adapters on the pruned dense model."""
    from patchc.runtime.lora import TileLoraLinear

    pruned = plan.apply(copy.deepcopy(model)).to(device)
    torch.manual_seed(2)
    adapted = peft.get_peft_model(patchc.compile(copy.deepcopy(pruned), plan, tune=False),
                                  patchc.register_lora(_lora_config()))
    reference = peft.get_peft_model(copy.deepcopy(pruned), _lora_config())
    lora = {k: v for k, v in adapted.state_dict().items() if "lora_" in k}
    assert len(lora) == 8 and not reference.load_state_dict(lora, strict=False).unexpected_keys
    assert sum(isinstance(m, TileLoraLinear) for m in adapted.modules()) == 4
    return adapted, reference


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the packed layers' Triton kernels and their backward")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
def test_lora_trains_over_the_packed_layers_as_over_the_pruned_dense_model(device):
    """fp32 (Triton's ieee dots on a GPU): the reference is PEFT's own LoRA on the plan-applied model."""
    model, plan = tiny_llama_and_24_plan()
    adapted, reference = _adapted_compressed(model, plan, device)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert len(trainable) == 8 and all(".lora_" in n for n in trainable)  # the packed base has no parameters
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3)).to(device)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (adapted, reference)]
    for step in range(3):  # forward, backward through the packed kernels' input gradient, update
        losses = [m(ids, labels=ids).loss for m in (adapted, reference)]
        torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
        for loss, opt in zip(losses, opts):
            opt.zero_grad()
            loss.backward()
        grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (adapted, reference)]
        for name, grad in grads[0].items():
            torch.testing.assert_close(grad, grads[1][name], atol=1e-5, rtol=1e-4)
        for opt in opts:
            opt.step()
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
        assert losses[0] > adapted(ids, labels=ids).loss  # it trained
    # PEFT reads `.weight` for the adapters' dtype and device: a TileLinear would unpack and keep a dense copy
    assert all(m._weight_cache is None for m in adapted.modules() if isinstance(m, TileLinear))


def test_a_lora_adapter_on_packed_layers_saves_loads_and_refuses_to_merge(tmp_path):
    model, plan = tiny_llama_and_24_plan()
    adapted, _ = _adapted_compressed(model, plan)
    adapted.save_pretrained(tmp_path / "adapter")
    base = patchc.compile(plan.apply(copy.deepcopy(model)), plan, tune=False)
    config = patchc.register_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapter"))
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", config=config)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, adapted(ids).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight': cannot merge .* 2:4 zeros"):
        adapted.merge_and_unload()
    with pytest.raises(TypeError, match="expected a peft.LoraConfig"):
        patchc.register_lora({"r": 4})
