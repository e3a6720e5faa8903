"""Hybrid dense / 2:4 kernels under the Triton interpreter (CPU): exact against a float64 reference.

Tolerances: fp32 inputs -> |y - ref| <= 1e-4 + 1e-5 |ref| (fp32 accumulation over K <= 392 of O(1)
products gives errors ~1e-5; one misplaced 2:4 value gives O(1)); fp16 output -> 1e-3 + 1e-3 |ref|
(half an fp16 ulp is 4.9e-4 relative); bf16 output -> 1e-2 + 8e-3 |ref|.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU-only machine: the interpreter is the only way to run Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchc.codegen import KernelConfig, PackError, pack, reference_tile_linear, tile_linear
from patchc.codegen.reference import KIND_PRESETS, random_layer_plan

pytestmark = pytest.mark.interpreter

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-2),
}


def _is_interpreted(module) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(module.decode_kernel, InterpretedFunction)


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels():
    """Run this module's kernels in the interpreter even if another module imported them compiled."""
    from patchc.codegen import kernels

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    reloaded = not _is_interpreted(kernels)
    if reloaded:
        importlib.reload(kernels)  # re-decorates in place: launch/generate look kernels up on the module
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old
    if reloaded:
        importlib.reload(kernels)


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, **TOL[dtype])


def _shape(tile: tuple[int, int], i: int) -> tuple[int, int]:
    """2-3 tiles per dim; odd cases have a partial edge tile in N and a ragged K (K % BLOCK_K != 0)."""
    b1, b2 = tile
    if i % 2:
        return 2 * b1 + b1 // 2 + 3, 2 * b2 + 8
    return 2 * b1, 3 * b2


TILES = [(16, 16), (32, 32), (64, 64), (128, 128)]
MS = [1, 3, 16, 17, 64]
SPLITS = [None, 1, 2, 3]
CASES = [
    (preset, m, TILES[i % 4], SPLITS[(i // 2) % 4], bool(i % 3 == 0), i)
    for i, (preset, m) in enumerate(itertools.product(KIND_PRESETS, MS))
]


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize("preset,m,tile,split_k,bias,i", CASES)
def test_kernel_matches_float64_reference(kernel, preset, m, tile, split_k, bias, i):
    n, k = _shape(tile, i)
    layer = random_layer_plan(n, k, tile=tile, kinds=preset, bias=bias, seed=i)
    packed = pack(layer, allow_all_dense=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i))
    block_m = None if kernel == "decode" else (16 if m <= 16 else 32)
    y = tile_linear(x, packed, config=KernelConfig(kernel=kernel, split_k=split_k, block_m=block_m))
    _check(y, reference_tile_linear(x, layer), torch.float32)


@pytest.mark.parametrize("m", [256, 300])
def test_prefill_with_256_token_tiles(m):
    """sm_90's default prefill tile: 256 tokens a program, one whole tile or one and a partial (300 = 256 + 44)."""
    layer = random_layer_plan(72, 96, tile=(32, 32), kinds="mixed", bias=True, seed=11)
    packed = pack(layer)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    cfg = KernelConfig(kernel="prefill", block_m=256, num_warps=8, num_stages=3)
    _check(tile_linear(x, packed, config=cfg), reference_tile_linear(x, layer), torch.float32)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_explicit_bias_overrides_and_no_bias(kernel):
    layer = random_layer_plan(40, 48, tile=(16, 16), kinds="mixed", bias=True, seed=3)
    packed = pack(layer)
    x = torch.randn(5, 48)
    cfg = KernelConfig(kernel=kernel, block_m=16)
    other = torch.randn(40)
    _check(tile_linear(x, packed, bias=other, config=cfg), reference_tile_linear(x, layer, bias=other), torch.float32)
    no_bias = random_layer_plan(40, 48, tile=(16, 16), kinds="mixed", bias=False, seed=3)
    assert pack(no_bias).bias is None
    _check(tile_linear(x, pack(no_bias), config=cfg), reference_tile_linear(x, no_bias), torch.float32)


@pytest.mark.parametrize("block", [(16, 16), (16, 32), (32, 16), (64, 64)])
def test_retiled_blocks_give_the_same_result(block):
    layer = random_layer_plan(150, 136, tile=(64, 64), kinds="mixed", bias=True, seed=5)
    packed = pack(layer, block=block)
    assert packed.block == block
    x = torch.randn(6, 136)
    for kernel in ("decode", "prefill"):
        y = tile_linear(x, packed, config=KernelConfig(kernel=kernel, block_m=16, split_k=2))
        _check(y, reference_tile_linear(x, layer), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4, 17])
def test_half_precision_inputs(dtype, m):
    layer = random_layer_plan(48, 72, tile=(16, 16), kinds="mixed", bias=True, seed=7, dtype=dtype)
    packed = pack(layer)
    x = torch.randn(m, 72).to(dtype)
    ref = reference_tile_linear(x, layer)
    for kernel in ("decode", "prefill") if m > 4 else ("decode",):
        y = tile_linear(x, packed, config=KernelConfig(kernel=kernel, split_k=2))
        _check(y, ref, dtype)


GEMV_CASES = [  # every preset, block and dtype, several times each (the interpreter is slow: not the full product)
    (preset, block, dtype)
    for i, (preset, block, dtype) in enumerate(itertools.product(
        ["sparse", "mixed", "rows_no_dense"], [(16, 16), (32, 32), (64, 64), (32, 128)],
        [torch.float32, torch.float16, torch.bfloat16]))
    if i % 3 == (i // 3) % 3  # one dtype per (preset, block), cycling
]


@pytest.mark.parametrize("preset,block,dtype", GEMV_CASES)
def test_gemv_decode_every_token_count(preset, block, dtype):
    """decode with block_m 1, 2, 4: N and K tails, M that is not a multiple of block_m, split-K, bias."""
    n, k = 2 * block[0] + 5, 2 * block[1] + 12  # a partial edge block in N and a ragged K
    layer = random_layer_plan(n, k, tile=block, kinds=preset, bias=True, seed=sum(block), dtype=dtype)
    packed = pack(layer, block=block)
    for m, split_k in ((1, 3), (2, 1), (3, 3), (5, 1)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        block_m = min(4, 1 << (m - 1).bit_length())
        y = tile_linear(x, packed, config=KernelConfig(kernel="decode", block_m=block_m, split_k=split_k))
        _check(y, reference_tile_linear(x, layer), dtype)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("block,dtype", [((16, 16), torch.float16), ((32, 64), torch.bfloat16), ((64, 128), torch.float16)])
def test_both_kept_value_loads_expand_the_same_blocks(groups, block, dtype, monkeypatch):
    """`expand_groups` and `expand_group_pairs` (the one Triton 3.6 compiles to; `configs.GROUPS_PER_LOAD`) against
    float64: every column of every group lands in place, for a (16, 16) block's single pair of groups per row too,
    and x is read in the reordered columns of the latter (`sparse_columns`; in order it fails for BK >= 32)."""
    import triton.language as tl

    from patchc.codegen import kernels

    monkeypatch.setattr(kernels, "GROUPS_PER_LOAD", tl.constexpr(groups))
    n, k = 2 * block[0] + 3, 2 * block[1]
    layer = random_layer_plan(n, k, tile=block, kinds="sparse", bias=False, seed=groups + block[1], dtype=dtype)
    packed = pack(layer, block=block)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    for kernel in ("decode", "prefill"):
        _check(tile_linear(x, packed, config=KernelConfig(kernel=kernel, split_k=1)), reference_tile_linear(x, layer), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_programs_store_only_their_own_tokens(dtype):
    """block_m 2 / 8 with the tokens padded to 8 inside each program: M = 11 needs 6 / 2 programs, the last
    one partial; a program that stored its padding rows would overwrite the next program's tokens."""
    layer = random_layer_plan(48, 96, tile=(16, 32), kinds="mixed", bias=True, seed=5, dtype=dtype)
    packed = pack(layer)
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    for block_m, split_k in ((2, 1), (8, 2)):
        y = tile_linear(x, packed, config=KernelConfig(kernel="decode", block_m=block_m, split_k=split_k))
        _check(y, reference_tile_linear(x, layer), dtype)


def test_auto_config_and_leading_dims():
    layer = random_layer_plan(64, 64, tile=(32, 32), kinds="rows_no_dense", bias=True, seed=9)
    packed = pack(layer)
    for shape in [(2, 3, 64), (1, 64), (70, 64)]:  # decode block_m 16 / block_m 1 / prefill picked by M
        x = torch.randn(*shape)
        y = tile_linear(x, packed)
        assert y.shape == (*shape[:-1], 64)
        _check(y.reshape(-1, 64), reference_tile_linear(x.reshape(-1, 64), layer), torch.float32)
    assert tile_linear(torch.randn(0, 64), packed).shape == (0, 64)


def test_split_k_reduction_is_deterministic():
    layer = random_layer_plan(64, 256, tile=(16, 16), kinds="mixed", seed=11)
    packed = pack(layer)
    x = torch.randn(3, 256)
    cfg = KernelConfig(kernel="decode", block_m=16, split_k=5)
    a, b = tile_linear(x, packed, config=cfg), tile_linear(x, packed, config=cfg)
    assert torch.equal(a, b)
    one = tile_linear(x, packed, config=KernelConfig(kernel="decode", block_m=16, split_k=1))
    _check(a, one.double(), torch.float32)


def test_input_errors_are_clear():
    layer = random_layer_plan(32, 32, tile=(16, 16), kinds="mixed", seed=1)
    packed = pack(layer)
    with pytest.raises(ValueError, match="K=32"):
        tile_linear(torch.randn(2, 16), packed)
    with pytest.raises(TypeError, match="packed as torch.float32"):
        tile_linear(torch.randn(2, 32, dtype=torch.float16), packed)
    with pytest.raises(ValueError, match="re-pack"):
        tile_linear(torch.randn(2, 32), packed, config=KernelConfig(block_n=32, block_k=32))
    with pytest.raises(ValueError, match="bias must have shape"):
        tile_linear(torch.randn(2, 32), packed, bias=torch.randn(3))
    with pytest.raises(ValueError, match="exceeds the GPU's 65535"):  # grid axis 2 = M / block_m
        tile_linear(torch.randn(70000, 32), packed, config=KernelConfig(kernel="decode", block_m=1, split_k=1))
    dense = random_layer_plan(32, 32, tile=(16, 16), kinds="dense", seed=1)
    with pytest.raises(PackError, match="F.linear|functional.linear"):
        pack(dense)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tn=st.integers(1, 3),
    tk=st.integers(1, 3),
    tile=st.sampled_from([(16, 16), (32, 16), (16, 32), (32, 32)]),
    n_cut=st.integers(0, 15),
    k_cut=st.sampled_from([0, 4, 8, 12]),
    dense_p=st.floats(0.0, 1.0),
    m=st.integers(1, 40),
    kernel=st.sampled_from(["decode", "prefill"]),
    split_k=st.integers(1, 3),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_plans_and_shapes(tn, tk, tile, n_cut, k_cut, dense_p, m, kernel, split_k, bias, seed):
    n = max(1, tn * tile[0] - n_cut)
    k = max(4, tk * tile[1] - k_cut)
    g = torch.Generator().manual_seed(seed)
    kinds = (torch.rand(-(-n // tile[0]), -(-k // tile[1]), generator=g) >= dense_p).to(torch.uint8)
    layer = random_layer_plan(n, k, tile=tile, kinds=kinds, bias=bias, seed=seed)
    packed = pack(layer, allow_all_dense=True)
    x = torch.randn(m, k, generator=g)
    block_m = 16 if kernel == "prefill" else None
    y = tile_linear(x, packed, config=KernelConfig(kernel=kernel, block_m=block_m, split_k=split_k))
    _check(y, reference_tile_linear(x, layer), torch.float32)


def test_generate_refuses_to_run_under_the_interpreter(tmp_path):
    from patchc.codegen import generate
    from patchc.codegen.reference import random_tile_plan

    plan = random_tile_plan({"a.weight": dict(n=32, k=32, tile=(16, 16))})
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        generate(plan, tmp_path, target="sm_90")


def test_workspace_split_k_bounds_the_partial_sums(monkeypatch):
    from patchc.codegen import launch as launch_mod

    assert launch_mod.workspace_split_k(8, 16, 4096) == 8  # decode: 2 MiB of partial sums
    assert launch_mod.workspace_split_k(2, 2048, 4096) == 2  # exactly 64 MiB: kept
    assert launch_mod.workspace_split_k(2, 2049, 4096) == 1
    assert launch_mod.workspace_split_k(4, 1024, 4096) == 4 and launch_mod.workspace_split_k(8, 1024, 4096) == 4
    assert launch_mod.workspace_split_k(16, 2048, 11008) == 1  # a prefill split alone is 86 MiB
    monkeypatch.setattr(launch_mod, "MAX_WORKSPACE_BYTES", 3 * 4 * 10 * 10)
    assert [launch_mod.workspace_split_k(s, 10, 10) for s in (1, 2, 3, 4, 8)] == [1, 2, 3, 3, 3]


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_split_k_past_the_workspace_bound_splits_less_and_stays_exact(kernel, monkeypatch):
    """A split-K config at an M whose workspace exceeds the bound: fewer splits, same result."""
    from patchc.codegen import launch as launch_mod

    m, n, k = 40, 48, 256
    layer = random_layer_plan(n, k, tile=(16, 16), kinds="mixed", bias=True, seed=13)
    packed = pack(layer)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(13))
    real_empty, allocated = torch.empty, []

    def spy(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        allocated.append((tuple(t.shape), t.numel() * t.element_size()))
        return t

    monkeypatch.setattr(torch, "empty", spy)
    for bound, splits in ((2 * 4 * m * n, 2), (4 * m * n - 1, 1)):
        monkeypatch.setattr(launch_mod, "MAX_WORKSPACE_BYTES", bound)
        allocated.clear()
        y = tile_linear(x, packed, config=KernelConfig(kernel=kernel, block_m=16, split_k=5))
        _check(y, reference_tile_linear(x, layer), torch.float32)
        workspaces = [shape for shape, _ in allocated if len(shape) == 3]
        assert workspaces == ([(splits, m, n)] if splits > 1 else [])
        assert max(nbytes for _, nbytes in allocated) <= max(bound, 4 * m * n)  # y itself is M x N


def test_under_capture_only_kernels_that_already_ran_launch(monkeypatch):
    """A kernel's first launch compiles it, which fails inside CUDA-graph capture: the launcher refuses a
    never-run kernel with a message naming the layer, and replays an already-run one (exact results)."""
    from patchc.codegen import launch as launch_mod

    layer = random_layer_plan(40, 96, tile=(16, 32), kinds="mixed", bias=True, seed=17, name="fc.weight")
    packed = pack(layer)
    cfg = KernelConfig(kernel="decode", block_m=16, split_k=2)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(17))
    monkeypatch.setattr(launch_mod, "_LAUNCHED", set())
    monkeypatch.setattr(launch_mod, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"layer 'fc.weight': M=3 .*outside capture \(warm-up\)"):
        tile_linear(x, packed, config=cfg)
    monkeypatch.setattr(launch_mod, "_capturing", lambda: False)
    tile_linear(x, packed, config=cfg)  # warm-up
    monkeypatch.setattr(launch_mod, "_capturing", lambda: True)
    _check(tile_linear(x, packed, config=cfg), reference_tile_linear(x, layer), torch.float32)
    with pytest.raises(RuntimeError, match="TileLinear.warmup"):
        tile_linear(x, packed, config=KernelConfig(kernel="decode", block_m=16, split_k=3))


ISSUE_MS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 33, 64, 127, 2048)  # every dispatch bucket and its edges
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_m_against_float64_with_k_scaled_tolerance(dtype):
    """Auto config (small-block_m / block_m-16 decode / prefill by M) on a layer with N and K tails, block 32 x 64.

    Tolerance: one rounding of the output (u |ref|) plus fp32 accumulation over K terms of size
    |x||w| ~ 1/sqrt(K) (x is scaled so outputs are O(1)): 2 K u32 / sqrt(K) = 2 sqrt(K) u32. A misplaced
    2:4 value moves an output by ~1/sqrt(K) = 0.07 here, far above both.
    """
    n, k = 3 * 32 + 5, 3 * 64 + 12
    layer = random_layer_plan(n, k, tile=(32, 64), kinds="mixed", bias=True, seed=11, dtype=dtype)
    packed = pack(layer, block=(32, 64))
    # Triton's interpreter gets bf16 tl.dot wrong (raw uint16 bits): bf16 above 4 tokens is checked on the GPU
    ms = ISSUE_MS if dtype != torch.bfloat16 else tuple(m for m in ISSUE_MS if m <= 4)
    # ... and casts fp32 -> bf16 by truncation (the GPU rounds to nearest): up to 2u there, not u
    ulps = 2 if dtype == torch.bfloat16 else 1
    for m in ms:
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) / k**0.5).to(dtype)
        ref = reference_tile_linear(x, layer)
        y = tile_linear(x, packed)
        bound = ulps * UNIT_ROUNDOFF[dtype] * ref.abs() + 2 * k**0.5 * 2.0**-24 + 1e-7
        excess = ((y.double() - ref).abs() - bound).max().item()
        assert y.dtype == dtype and excess <= 0, f"M={m} {dtype}: error exceeds the bound by {excess:.3g}"
