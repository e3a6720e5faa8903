"""Fused MoE experts at run time: `TileExperts` (routed, HF's fused-experts forward) and `TileBmmExperts`
(Llama 4: every expert's rows at once) against the original transformers modules, on the Triton
interpreter's kernel path and on a GPU when there is one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import patchc
from patchc.runtime.dispatch import TileLinear

transformers = pytest.importorskip("transformers")


def _tiny_experts(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A Mixtral fused-experts module (2 experts, hidden 32, intermediate 16) holding a random hybrid plan's
    weights, the plan, and a routing of 6 tokens (top-2)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from patchc.codegen.reference import random_layer_plan

    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=2, num_experts_per_tok=2)
    experts = MixtralExperts(cfg).eval()
    path, layers = "mlp.experts", {}
    for proj in ("gate_up_proj", "down_proj"):
        param = getattr(experts, proj)
        for e in range(param.shape[0]):
            name = f"{path}.{proj}.{e}"
            layers[name] = random_layer_plan(*param.shape[1:], kinds="mixed", seed=len(layers), name=name)
            with torch.no_grad():
                param[e] = layers[name].to_dense()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=gen)
    index = torch.stack([torch.randperm(2, generator=gen) for _ in range(6)])
    weights = torch.rand(6, 2, generator=gen).softmax(-1)
    to = dict(device=device, dtype=dtype)
    return experts.to(**to), patchc.TilePlan(layers=layers), path, (x.to(**to), index.to(device), weights.to(**to))


def test_tile_experts_kernel_path_in_the_triton_interpreter(monkeypatch):
    """TileExperts' GPU path (one hybrid TileLinear per expert) run by the Triton interpreter on CPU."""
    from patchc.runtime import op as rt_op
    from patchc.runtime.dispatch import TileExperts

    if not rt_op.kernels_interpreted():
        pytest.skip("patchc's Triton kernels were not decorated under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    experts, plan, path, (x, index, weights) = _tiny_experts()
    fast = TileExperts(experts, plan, path)
    assert not fast.kernels  # CPU: the dense fallback; build the per-expert kernels as the CUDA path does
    fast.kernels = nn.ModuleDict({proj: nn.ModuleList(
        [TileLinear.from_plan(plan.layers[f"{path}.{proj}.{e}"], dtype=torch.float32) for e in range(2)])
        for proj in fast.names})
    launched = []
    real = rt_op.launch
    monkeypatch.setattr(rt_op, "launch", lambda *a, **k: launched.append(k.get("name")) or real(*a, **k))
    with torch.no_grad():
        got, want = fast(x, index, weights), experts(x, index, weights)
    assert sorted(set(launched)) == sorted(plan.layers)  # every expert's projections ran a kernel
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: TileExperts builds its kernels on CUDA only")
def test_tile_experts_on_gpu_matches_the_dense_experts():
    from patchc.runtime.dispatch import TileExperts

    experts, plan, path, (x, index, weights) = _tiny_experts("cuda", torch.float16)
    fast = TileExperts(experts, plan, path)
    assert all(isinstance(k, TileLinear) for mods in fast.kernels.values() for k in mods)
    with torch.no_grad():
        torch.testing.assert_close(fast(x, index, weights), experts(x, index, weights), atol=2e-2, rtol=2e-2)


def _tiny_bmm_experts(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A Llama 4 experts module (2 experts, hidden 32, intermediate 16; weights stored (E, K, N)) holding a
    random hybrid plan's weights, the plan, and 5 rows per expert."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from patchc.codegen.reference import random_layer_plan

    cfg = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=2)
    experts = Llama4TextExperts(cfg).eval()
    path, layers = "feed_forward.experts", {}
    for proj in ("gate_up_proj", "down_proj"):
        param = getattr(experts, proj)
        for e in range(param.shape[0]):
            name = f"{path}.{proj}.{e}"
            k, n = param.shape[1:]
            layers[name] = random_layer_plan(n, k, kinds="mixed", seed=len(layers), name=name)
            with torch.no_grad():
                param[e] = layers[name].to_dense().t()
    x = torch.randn(2 * 5, 32, generator=torch.Generator().manual_seed(3))
    return experts.to(device=device, dtype=dtype), patchc.TilePlan(layers=layers), path, x.to(device=device, dtype=dtype)


def test_tile_bmm_experts_kernel_path_in_the_triton_interpreter(monkeypatch):
    """TileBmmExperts (Llama 4) with one hybrid TileLinear per expert, run by the Triton interpreter on CPU,
    against the original module's two bmm's; `experts_module` picks it by the forward's signature."""
    from patchc.runtime import op as rt_op
    from patchc.runtime.dispatch import TileBmmExperts, experts_module

    if not rt_op.kernels_interpreted():
        pytest.skip("patchc's Triton kernels were not decorated under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    experts, plan, path, x = _tiny_bmm_experts()
    fast = experts_module(experts, plan, path)
    assert type(fast) is TileBmmExperts and not fast.kernels  # CPU: the dense fallback
    with torch.no_grad():
        torch.testing.assert_close(fast(x), experts(x), atol=1e-5, rtol=1e-5)
    fast.kernels = nn.ModuleDict({proj: nn.ModuleList(  # the per-expert kernels the CUDA path builds
        [TileLinear.from_plan(plan.layers[f"{path}.{proj}.{e}"], dtype=torch.float32) for e in range(2)])
        for proj in fast.names})
    launched = []
    real = rt_op.launch
    monkeypatch.setattr(rt_op, "launch", lambda *a, **k: launched.append(k.get("name")) or real(*a, **k))
    with torch.no_grad():
        got, want = fast(x), experts(x)
    assert sorted(set(launched)) == sorted(plan.layers)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: TileBmmExperts builds its kernels on CUDA only")
def test_tile_bmm_experts_on_gpu_matches_the_dense_experts():
    from patchc.runtime.dispatch import TileBmmExperts, experts_module

    experts, plan, path, x = _tiny_bmm_experts("cuda", torch.float16)
    fast = experts_module(experts, plan, path)
    assert type(fast) is TileBmmExperts and all(isinstance(k, TileLinear) for mods in fast.kernels.values() for k in mods)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), experts(x), atol=2e-2, rtol=2e-2)
