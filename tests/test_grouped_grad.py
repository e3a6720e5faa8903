"""The fused experts' backward to x on the kernels' path: nothing read on the host.

Tiers: `stack_transposed` against `stack_experts` of `pack_dense` transposes (no backend); the op's kernel
path in the Triton interpreter against an independent float64 product with each expert's plan weight
(`layerplan_to_dense`), with the reference path's host loop made to fail; the CUDA-graph capture is in
`tests/test_runtime_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from patchc.codegen import pack
from patchc.codegen.grouped_layout import pack_dense, stack_experts, stack_transposed
from patchc.codegen.layout import BUFFER_NAMES, PackError, kernel_buffers
from patchc.codegen.reference import layerplan_to_dense, random_layer_plan

# relative to |dL/dx| + 1: the kernels accumulate in fp32 and round once (bf16: within one unit in the last place)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("block", [(16, 16), (32, 64), (64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_transposed_is_the_stack_of_each_experts_transpose_packed_dense(block, dtype):
    w = torch.randn(3, 40, 24).to(dtype)  # neither side a multiple of the blocks: padded edges
    got = stack_transposed(w, block)
    want = stack_experts([pack_dense(w[e].t(), block) for e in range(3)])
    assert got.shape == want.shape and got.per_row == want.per_row and got.dtype == dtype
    assert torch.equal(got.kinds, want.kinds)
    for name, a, b in zip(BUFFER_NAMES, kernel_buffers(got), kernel_buffers(want)):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    with pytest.raises(PackError, match=r"needs \(E, N, K\) weights, got shape \(40, 24\)"):
        stack_transposed(w[0], block)


@pytest.mark.parametrize("shape", [(40, 24), (32, 48), (8, 40), (40, 8), (5, 3)])  # tails, only full, only tails
def test_dense_blocks_are_the_padded_weights_cut_into_blocks(shape):
    """Each block is the weight's (BN, BK) window at its block row and column, zeros past the edges: against
    plain slicing of a zero-padded copy, one block at a time (pack_dense and stack_transposed share it)."""
    from patchc.codegen.grouped_layout import _dense_blocks

    block, e = (16, 16), 3
    w = torch.randn(e, *shape)
    rb, cb = -(-shape[0] // 16), -(-shape[1] // 16)
    padded = torch.zeros(e, rb * 16, cb * 16)
    padded[:, : shape[0], : shape[1]] = w
    strided = w.transpose(1, 2).contiguous().transpose(1, 2)  # as the backward passes W_hat^T: a view
    got = _dense_blocks(strided, block)
    want = torch.stack([padded[i, r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16]
                        for i in range(e) for r in range(rb) for c in range(cb)])
    assert torch.equal(got, want)


def test_a_transposed_layout_filled_a_few_experts_at_a_time_is_the_whole_one():
    from patchc.codegen.grouped_layout import fill_transposed, transposed_layout

    w = torch.randn(5, 40, 24)
    whole = stack_transposed(w, (16, 32))
    parts = transposed_layout(5, (40, 24), (16, 32), w.dtype, w.device)
    for first in (0, 2, 4):  # experts 0-1, 2-3, 4
        fill_transposed(parts, w[first : first + 2], first)
    for name, a, b in zip(BUFFER_NAMES, kernel_buffers(parts), kernel_buffers(whole)):
        assert torch.equal(a, b), name


def _experts(n: int, k: int, tile: tuple[int, int], dtype: torch.dtype, num: int = 4):
    layers = [random_layer_plan(n, k, tile, kinds, dtype=dtype, seed=10 * n + e)
              for e, kinds in enumerate(["mixed", "sparse", "dense", "mixed"][:num])]
    # an all-dense expert is stored as TileGroupedLinear stores an unplanned one: dense blocks of its weight
    return layers, stack_experts([pack_dense(layerplan_to_dense(layer), tile) if bool((layer.kinds == 0).all())
                                  else pack(layer, block=tile) for layer in layers])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,tile", [(64, 96, (32, 32)), (48, 80, (16, 16)), (77, 104, (16, 16))])
@pytest.mark.parametrize("ends,chunks", [([5, 5, 12, 14], 8), ([0, 0, 3, 3], 2), ([2, 9, 9, 40], 1)])
def test_grad_x_on_the_kernels_path_is_each_experts_rows_times_its_weight(dtype, n, k, tile, ends, chunks,
                                                                         monkeypatch):
    """Expert 1 gets no rows in the first case, rows past the last offset stay zero ([0, 0, 3, 3] leaves rows
    3..13 to no expert), and offsets past the rows ([2, 9, 9, 40]) end at the last row; 77 x 104 cuts partial
    blocks in N and K. W_hat is unpacked one expert, two or all four at a time. The reference's host loop
    and its W_hat rebuild raise if called."""
    from patchc.runtime import grouped_op
    from patchc.runtime.op import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("patchc's Triton kernels were not decorated under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    monkeypatch.setattr(grouped_op, "UNPACK_CHUNKS", chunks)
    for name in ("_segments", "experts_from_buffers"):
        monkeypatch.setattr(grouped_op, name, lambda *a, name=name, **kw: pytest.fail(f"{name}: a host read"))
    layers, stacked = _experts(n, k, tile, dtype)
    s = 14
    grad = torch.randn(s, n, generator=torch.Generator().manual_seed(n + k)).to(dtype)
    offs = torch.tensor(ends, dtype=torch.int32)
    got = torch.ops.patchc.tile_grouped_mm_grad_x(grad, offs, *kernel_buffers(stacked), [n, k], len(layers),
                                                  list(tile))
    want = torch.zeros(s, k, dtype=torch.float64)
    start = 0
    for layer, end in zip(layers, ends):
        end = min(end, s)
        want[start:end] = grad[start:end].double() @ layerplan_to_dense(layer, torch.float64)
        start = max(start, end)
    assert got.shape == (s, k) and got.dtype == dtype
    assert not got[start:].any()
    assert float(((got.double() - want).abs() / (want.abs() + 1)).max()) <= TOL[dtype]


@pytest.mark.interpreter
def test_grad_x_of_no_rows_is_empty_on_both_paths(monkeypatch):
    layers, stacked = _experts(32, 32, (16, 16), torch.float32, num=2)
    for impl in ("triton", "reference"):
        monkeypatch.setenv("PATCHC_CPU_IMPL", impl)
        got = torch.ops.patchc.tile_grouped_mm_grad_x(torch.zeros(0, 32), torch.tensor([0, 0], dtype=torch.int32),
                                                      *kernel_buffers(stacked), [32, 32], 2, [16, 16])
        assert got.shape == (0, 32)
