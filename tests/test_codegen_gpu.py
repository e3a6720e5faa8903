"""GPU correctness of the hybrid kernels against cuBLAS (F.linear on W*M) on LLaMA-2-7B shapes.

Skipped where no CUDA device is present. Tolerances (outputs are O(1): x is scaled by 1/sqrt(K)):
fp16 atol 1e-2 + rtol 1e-2, bf16 atol 4e-2 + rtol 2e-2 -- both sides accumulate in fp32, so the gap
is output rounding (an fp16/bf16 ulp) plus summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K) of LLaMA-2-7B linears
TOL = {torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def compiled_kernels():
    """Undo the interpreter if another module of this session switched it on."""
    import importlib
    import os

    from patchc.codegen import kernels

    old = os.environ.pop("TRITON_INTERPRET", None)
    importlib.reload(kernels)
    yield
    if old is not None:
        os.environ["TRITON_INTERPRET"] = old


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_cublas(compiled_kernels, shape, dtype):
    from patchc.codegen import KernelConfig, pack, tile_linear
    from patchc.codegen.reference import random_layer_plan

    n, k = shape
    layer = random_layer_plan(n, k, tile=(128, 128), kinds=0.1, dtype=dtype, bias=True, seed=0)  # 45% sparse
    packed = pack(layer, block=(64, 64)).to("cuda")
    w = layer.to_dense().to("cuda")
    bias = layer.bias.to("cuda")
    for m in (1, 3, 16, 64, 2048):
        x = (torch.randn(m, k, device="cuda") / k**0.5).to(dtype)
        ref = F.linear(x, w, bias)
        torch.testing.assert_close(tile_linear(x, packed), ref, **TOL[dtype])
        # above 64 tokens the decode kernel runs as the tuner may pick it for prefill: 128 tokens a program,
        # in grouped order
        wide = dict(block_m=128, split_k=1, num_warps=8, num_stages=3) if m > 64 else dict(split_k=4)
        for cfg in (KernelConfig(kernel="decode", **wide), KernelConfig(kernel="prefill", split_k=1 if m > 64 else 4)):
            torch.testing.assert_close(tile_linear(x, packed, config=cfg), ref, **TOL[dtype])


def test_split_k_fixup_is_exact_launch_after_launch_and_in_a_cuda_graph(compiled_kernels):
    """The in-kernel split-K reduction on a GPU (16 splits of a 4096 x 4096 mixed layer, M = 1 and 16): 50
    launches back to back and 20 replays of a captured graph, each bit-equal to the second-launch
    reduction (a counter left non-zero, or a partial sum read before it landed, would change bits), which
    itself matches cuBLAS on W*M; the counters end at zero."""
    from dataclasses import replace

    from patchc.codegen import KernelConfig, counters, pack, tile_linear
    from patchc.codegen.reference import random_layer_plan

    dtype = torch.float16
    layer = random_layer_plan(4096, 4096, tile=(128, 128), kinds=0.1, dtype=dtype, bias=True, seed=1)
    packed = pack(layer, block=(128, 64)).to("cuda")
    w, bias = layer.to_dense().to("cuda"), layer.bias.to("cuda")
    for m in (1, 16):
        x = (torch.randn(m, 4096, device="cuda") / 64).to(dtype)
        fixup = KernelConfig(kernel="decode", split_k=16, reduce="fixup")
        want = tile_linear(x, packed, config=replace(fixup, reduce="launch"))
        torch.testing.assert_close(want, F.linear(x, w, bias), **TOL[dtype])
        outs = [tile_linear(x, packed, config=fixup) for _ in range(50)]
        assert all(torch.equal(y, want) for y in outs), f"M={m}: a launch added its splits up differently"
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tile_linear(x, packed, config=fixup)  # warm on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            y = tile_linear(x, packed, config=fixup)
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, want), f"M={m}: a graph replay added its splits up differently"
    assert all(int(buf.abs().sum()) == 0 for buf in counters._BUFFERS.values())


def test_split_k_counters_made_in_a_cudagraph_trees_warm_up_stay_outside_its_pool(compiled_kernels, monkeypatch):
    """torch.compile(mode="reduce-overhead"): cudagraph trees send their eager warm-up's allocations to their
    pool, and the first split-K launch of the process makes the counters there. They must not come from that
    pool (which would hand their memory to the graphs' tensors): M = 1 and 4 in turn, ten replays each,
    all within tolerance of cuBLAS on W*M and equal to the first."""
    from patchc.codegen import counters
    from patchc.codegen.reference import random_layer_plan
    from patchc.runtime import TileLinear

    monkeypatch.setattr(counters, "_BUFFERS", {})  # the first split-K launch below, in the trees' warm-up, makes them
    dtype = torch.float16
    layer = random_layer_plan(4096, 4096, tile=(128, 128), kinds=0.1, dtype=dtype, bias=True, seed=2)
    mod = TileLinear.from_plan(layer, dtype=dtype, device="cuda")
    assert mod.config(1).split_k > 1 and mod.config(1).reduce == "fixup"
    w, bias = layer.to_dense().to("cuda"), layer.bias.to("cuda")
    xs = {m: (torch.randn(m, 4096, device="cuda") / 64).to(dtype) for m in (1, 4)}
    step = torch.compile(mod, mode="reduce-overhead")
    first = {}
    for _ in range(10):
        for m, x in xs.items():
            y = step(x).clone()
            first.setdefault(m, y)
            torch.testing.assert_close(y, F.linear(x, w, bias), **TOL[dtype])
            assert torch.equal(y, first[m]), f"M={m}: a replay differs from the first"
    assert all(int(buf.abs().sum()) == 0 for buf in counters._BUFFERS.values())
