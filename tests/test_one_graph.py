"""A `patchc.compile`d model traces in one graph, as the dense one does: no graph break in patchc's modules on the
kernels' path (the GPU's; interpreted here), which a CUDA-graphed decode needs. torch 2.11's dynamo (the GPU
machines') broke a served MoE into 11 graphs at `bool()` of a ModuleDict, which torch 2.13's traces; a served
Llama 4 stopped at its shared expert's in-place add into `tile_linear`'s output, a view until it was made none."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import patchc
from patchc.codegen.reference import random_24_mask
from patchc.ir import TilePlan
from patchc.ir.targets import stored_kn
from patchc.runtime import op as rt_op

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SIZES),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SIZES, moe_intermediate_size=32, num_experts=4,
                                                     num_experts_per_tok=2),
    # experts stored (E, K, N) and multiplied at once (TileBmmExperts); a shared expert added into in place
    "llama4": lambda: transformers.Llama4TextConfig(**{**SIZES, "intermediate_size": 64}, intermediate_size_mlp=128,
                                                    num_local_experts=4, num_experts_per_tok=1, moe_layers=[0, 1],
                                                    no_rope_layers=[1, 1], attention_chunk_size=64),
}


def _model_and_plan(kind: str):
    """A tiny random model and a random 2:4 plan of every decoder weight, experts included (16 x 16 tiles)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    pruned, gen = copy.deepcopy(model), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pruned.named_parameters():
            if ".layers." in name and p.dim() in (2, 3) and "norm" not in name and not _router(name):
                kn = p.dim() == 3 and stored_kn(pruned.get_submodule(name.rsplit(".", 1)[0]))
                for w in p if p.dim() == 3 else [p]:
                    w.mul_(random_24_mask(w.shape[1], w.shape[0], gen).t() if kn else random_24_mask(*w.shape, gen))
    return model, TilePlan.from_linears(pruned, tile=(16, 16))


def _router(name: str) -> bool:
    return name.endswith("mlp.gate.weight") or ".router." in name


def _graphs(model, ids) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids, use_cache=False)
    return explained.graph_count, [f"{r.reason.splitlines()[0]} at {r.user_stack[-1]}" for r in explained.break_reasons]


@pytest.mark.parametrize("kind, planned", [("llama", 14), ("qwen3_moe", 8 + 2 * 2 * 4),
                                           ("llama4", 2 * (4 + 3 + 2 * 4))])
def test_the_compiled_model_traces_in_one_graph_as_the_dense_one_does(kind, planned, monkeypatch):
    if not rt_op.kernels_interpreted():
        pytest.skip("patchc's Triton kernels were not decorated under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")  # the kernels' path, as on a GPU
    model, plan = _model_and_plan(kind)
    assert len(plan.layers) == planned
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every planned weight is served
        fast = patchc.compile(model, plan, tune=False)
    # a decode step's one row (a prompt traces the same modules; the kernel a length dispatches to is the op's
    # own choice, inside it); explain runs the interpreted kernels too, which costs most of the test's time
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(1))
    count, breaks = _graphs(fast, ids)
    assert count == 1, (breaks, f"the dense model: {_graphs(model, ids)[0]} graph(s)")  # traced on failure only
