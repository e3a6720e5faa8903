"""transformers' own compiled decoding (`generate(..., compile_config=CompileConfig(...))` with a static cache).

transformers compiles only the decode steps and runs the prompt uncompiled, so a dense model compiled with a plan
would read its prompt with dense weights: the two ways that give the pruned model's tokens are a model whose
linears patchc.compile swapped (then any backend), and a plan-applied model under `patchc.backend(plan)`.
CompileConfig deep-copies its fields: the bound backend survives that as itself, so `unserved(plan)` still
answers for the plan the user holds. On CPU, transformers compiles only with `_compile_all_devices`.
"""

from __future__ import annotations

import copy

import pytest
import torch

import patchc
from tests.conftest import tiny_llama_and_24_plan

transformers = pytest.importorskip("transformers")
CompileConfig = transformers.CompileConfig


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama, a 2:4 plan of its 14 decoder linears, the plan-applied copy and its greedy tokens."""
    model, plan = tiny_llama_and_24_plan()
    pruned = plan.apply(copy.deepcopy(model))
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = pruned.generate(input_ids=ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    return model, plan, pruned, ids, want


def _generate(model, ids, config: CompileConfig) -> torch.Tensor:
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    torch._dynamo.reset()
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                             compile_config=config)
    torch._dynamo.reset()
    return out


def test_a_patchc_compiled_model_decodes_the_pruned_models_tokens_under_any_backend(llama):
    model, plan, _, ids, want = llama
    fast = patchc.compile(model, plan, tune=False)
    assert torch.equal(_generate(fast, ids, CompileConfig(backend="aot_eager", mode=None)), want)


def test_the_bound_backend_serves_the_decode_steps_of_a_plan_applied_model(llama):
    _, plan, pruned, ids, want = llama
    counts = []
    backend = patchc.backend(plan, tune=False, strict=True, graph_callback=lambda gm, n: counts.append(n))
    assert copy.deepcopy(backend) is backend
    assert torch.equal(_generate(pruned, ids, CompileConfig(backend=backend)), want)  # mode: reduce-overhead
    assert counts == [14] and patchc.runtime.unserved(plan) == {}


def test_the_bound_backend_names_a_bad_option_and_refuses_options_beside_it(llama):
    _, plan, pruned, ids, _ = llama
    with pytest.raises(ValueError, match=r"patchc.backend: unknown option\(s\) \['stric'\]"):
        patchc.backend(plan, stric=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"its result is the backend: torch.compile\(model, backend=patchc.backend"):
        with torch.no_grad():
            torch.compile(pruned, backend=patchc.backend)(ids)  # the class itself, not called
    torch._dynamo.reset()
    cm = torch.compile(pruned, backend=patchc.backend(plan, tune=False), options={"strict": True})
    with pytest.raises(Exception, match=r"options are bound when it is made"), torch.no_grad():
        cm(ids)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: transformers' default inductor + "
                                                          "reduce-overhead and the Triton kernels run there")
@pytest.mark.parametrize("way", ["patchc.compile", "patchc.backend"])
def test_on_gpu_the_default_compile_config_decodes_the_pruned_models_tokens(llama, way):
    """fp32 on CUDA (Triton's ieee dots, cuBLAS without TF32): transformers compiles the decode step with
    inductor and CUDA graphs by itself; the reference is the plan-applied model run eagerly there."""
    model, plan, pruned, ids, _ = llama
    reference, ids = copy.deepcopy(pruned).cuda(), ids.cuda()
    with torch.no_grad():
        want = reference.generate(input_ids=ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    if way == "patchc.compile":
        got = _generate(patchc.compile(copy.deepcopy(model).cuda(), plan, tune=False), ids, CompileConfig())
    else:
        got = _generate(copy.deepcopy(pruned).cuda(), ids, CompileConfig(backend=patchc.backend(plan, tune=False)))
    assert torch.equal(got, want)
