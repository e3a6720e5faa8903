"""Runtime on a GPU: tuning on LLaMA-2-7B shapes, CUDA-graph capture, inductor. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import patchc.runtime as rt
from patchc.codegen.reference import random_tile_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tuning_differs_between_decode_and_prefill_on_llama7b_shapes(tmp_path):
    plan = random_tile_plan({
        "q.weight": dict(n=4096, k=4096, tile=(128, 128), kinds=0.3, dtype=torch.float16),
        "up.weight": dict(n=11008, k=4096, tile=(128, 128), kinds=0.3, dtype=torch.float16),
        "down.weight": dict(n=4096, k=11008, tile=(128, 128), kinds=0.3, dtype=torch.float16),
    })
    tunings = rt.tune_plan(plan, batch_size=16, prefill_len=128, cache=tmp_path / "t.json", progress=False)
    for fqn, t in tunings.items():
        assert t.decode.kernel == "decode" and t.prefill.kernel in ("prefill", "unpacked"), fqn
        assert (t.prefill.kernel == "unpacked") == (t.prefill_backend == "unpacked"), fqn  # cuBLAS where it won
        if t.prefill.kernel == "prefill":
            assert (t.decode.block_m, t.decode.split_k) != (t.prefill.block_m, t.prefill.split_k), fqn
        assert t.threshold >= 16


def model_of(plan, n: int, k: int) -> torch.nn.Module:
    """A one-linear model holding the plan's own kept weights (a plan refuses other weights)."""
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    model[0].weight.data.copy_(plan.layers["0.weight"].to_dense())
    return model.cuda().half()


def test_cuda_graph_capture_and_match():
    plan = random_tile_plan({"0.weight": dict(n=4096, k=4096, tile=(128, 128), kinds=0.3, dtype=torch.float16)})
    model = model_of(plan, 4096, 4096)
    fast = rt.compile(model, plan, batch_size=16, prefill_len=128, tune=False)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.float16)
    ref = torch.nn.functional.linear(x, plan.layers["0.weight"].to_dense().cuda().half())
    fast(x)  # compile the kernels outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fast(x)
    g.replay()
    torch.testing.assert_close(y, ref, atol=2e-2, rtol=2e-2)


def test_backend_inductor_reduce_overhead():
    plan = random_tile_plan({"0.weight": dict(n=1024, k=1024, tile=(64, 64), kinds="mixed", dtype=torch.float16)})
    model = model_of(plan, 1024, 1024)
    w = plan.layers["0.weight"].to_dense().cuda().half()
    x = torch.randn(16, 1024, device="cuda", dtype=torch.float16)
    torch._dynamo.reset()
    cm = torch.compile(model, backend="patch", options={"plan": plan, "tune": False, "mode": "reduce-overhead"})
    for _ in range(3):
        y = cm(x).clone()  # reduce-overhead's graph outputs are overwritten by the next replay
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), atol=2e-2, rtol=2e-2)


def test_cuda_graph_capture_after_warmup_and_refusal_without():
    plan = random_tile_plan({"0.weight": dict(n=1024, k=1024, tile=(64, 64), kinds="mixed", dtype=torch.float16)})
    model = model_of(plan, 1024, 1024)
    fast = rt.compile(model, plan, batch_size=16, prefill_len=128, tune=False)
    assert rt.warmup(fast, [1, 16, 200]) == 1  # M=1 bucket, M=16 bucket, prefill
    w = plan.layers["0.weight"].to_dense().cuda().half()
    xs = {m: torch.randn(m, 1024, device="cuda", dtype=torch.float16) for m in (1, 16, 200, 40)}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = {m: fast(xs[m]) for m in (1, 16, 200)}
        with pytest.raises(RuntimeError, match="'0.weight'.*M=40.*warm-up"):  # decode bucket 17-64: never run
            fast(xs[40])
    g.replay()
    for m, y in ys.items():
        torch.testing.assert_close(y, torch.nn.functional.linear(xs[m], w), atol=2e-2, rtol=2e-2)


def test_unpacked_prefill_is_the_plans_weight_and_captures_in_a_cuda_graph():
    """The unpack kernel writes the plan's own W * M bit for bit (an independent rebuild from the plan's tensors);
    a layer routed to it at prefill, warmed, runs inside a CUDA graph and matches F.linear on that weight."""
    import dataclasses

    from patchc.codegen import KernelConfig, pack
    from patchc.codegen.launch import unpack
    from patchc.codegen.layout import kernel_buffers
    from patchc.codegen.reference import layerplan_to_dense
    from patchc.runtime.tuner import default_tuning

    plan = random_tile_plan({"0.weight": dict(n=1000, k=3000, tile=(64, 64), kinds=0.35, dtype=torch.bfloat16)})
    layer = plan.layers["0.weight"]
    packed = pack(layer, block=(64, 64))
    w = layerplan_to_dense(layer, torch.bfloat16).cuda()
    assert torch.equal(unpack(kernel_buffers(packed.to("cuda")), packed.shape, packed.block), w)
    tuning = default_tuning(layer, packed, 16, 128, "sm_90")
    tuning = dataclasses.replace(tuning, prefill=KernelConfig("unpacked", 1, 64, 64, 1, 4, 1, 1, "fixup"),
                                 prefill_backend="unpacked")
    mod = rt.TileLinear(packed, tuning, dtype=torch.bfloat16, device="cuda").warmup([200])
    assert mod.route(200) == "unpacked"
    x = torch.randn(200, 3000, device="cuda", dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mod(x)
    g.replay()
    ref = torch.nn.functional.linear(x.double(), w.double())
    torch.testing.assert_close(y.double(), ref, atol=1e-2 * float(ref.abs().max()), rtol=1e-2)  # bf16 output


def test_fused_experts_backward_to_x_captures_in_a_cuda_graph():
    """dL/dx of fused experts reads nothing on the host: after one eager call (which compiles the kernels) the
    call captures in a CUDA graph, and gives each expert's rows of dL/dy times its plan weight (float64 from
    the plan's tensors); rows past the last offset stay zero."""
    from patchc.codegen import pack
    from patchc.codegen.grouped_layout import stack_experts
    from patchc.codegen.layout import kernel_buffers
    from patchc.codegen.reference import layerplan_to_dense, random_layer_plan

    n, k, tile = 1024, 768, (64, 64)
    layers = [random_layer_plan(n, k, tile, 0.35, dtype=torch.bfloat16, seed=e) for e in range(8)]
    stacked = stack_experts([pack(layer, block=tile) for layer in layers]).to("cuda")
    ends = [100, 100, 350, 400, 700, 701, 900, 1000]
    grad = torch.randn(1024, n, device="cuda", dtype=torch.bfloat16)
    args = (torch.tensor(ends, dtype=torch.int32, device="cuda"), *kernel_buffers(stacked), [n, k], 8, list(tile))
    torch.ops.patchc.tile_grouped_mm_grad_x(grad, *args)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = torch.ops.patchc.tile_grouped_mm_grad_x(grad, *args)
    g.replay()
    want = torch.zeros(1024, k, dtype=torch.float64, device="cuda")
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        want[start:end] = grad[start:end].double() @ layerplan_to_dense(layers[e], torch.float64).cuda()
    assert not got[1000:].any()
    torch.testing.assert_close(got.double(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)  # bf16 output
