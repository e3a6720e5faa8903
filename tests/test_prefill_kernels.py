"""Prefill sizes on either hybrid kernel: the tiled GEMM ("prefill") or the decode kernel (weights on the
product's M side), whichever the tuner times faster.

Tiers: the candidate tables and the search with an injected timer (no kernel runs); a TileLinear whose
prefill config is the decode kernel, under the Triton interpreter, against an independent float64 product
of the plan's own weight (fp32: 1e-5, fp16: 1e-3 relative and absolute), token tails included.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from patchc.codegen import KernelConfig, pack
from patchc.codegen.kernels import DECODE_GROUP_ROWS, swizzle
from patchc.codegen.reference import layerplan_to_dense, random_layer_plan
from patchc.runtime.candidates import PREFILL_KERNELS, CandidateSpace, candidate_space, candidates
from tests.conftest import tune_twice

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                 reason="runs the kernels in the Triton interpreter (a CPU machine)")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_prefill_candidates_hold_both_kernels_and_decode_only_its_own(arch):
    """At prefill sizes each GEMM config has its decode-kernel twin (same block, tokens, split-K, warps, stages),
    so the search's kernel axis always has a neighbour; decode sizes stay on the decode kernel."""
    pre = candidates("prefill", (4096, 4096), (128, 128), 2048, torch.float16, arch)
    dec = candidates("decode", (4096, 4096), (128, 128), 16, torch.float16, arch)
    assert {c.kernel for c in pre} == set(PREFILL_KERNELS) and {c.kernel for c in dec} == {"decode"}
    twins = {dataclasses.replace(c, kernel="decode") for c in pre if c.kernel == "prefill"}
    assert twins == {c for c in pre if c.kernel == "decode"}
    assert {c.block_m for c in pre} == set(candidate_space(arch).prefill_block_m)


def test_a_table_can_keep_prefill_on_the_gemm_and_refuses_unknown_kernels():
    space = dataclasses.replace(candidate_space("sm_90"), prefill_kernels=("prefill",))
    assert space.prefill_kernels == ("prefill",)
    with pytest.raises(ValueError, match="prefill_kernels must name some of"):
        dataclasses.replace(candidate_space("sm_90"), prefill_kernels=("unpacked",))
    with pytest.raises(ValueError, match="prefill_kernels must name some of"):
        CandidateSpace(**{**candidate_space("sm_80").__dict__, "prefill_kernels": ()})


def _timer(decode_per_token: float):
    """The GEMM 2 ms at any M; the decode kernel 1 ms + `decode_per_token` per token; unpacking 9 ms."""
    def time_fn(fn) -> float:
        cfg, m = fn.args[-1], fn.args[0].shape[0]
        if cfg.kernel == "unpacked":
            return 9.0
        return 1.0 + decode_per_token * m + 0.01 * cfg.num_warps if cfg.kernel == "decode" else 2.0
    return time_fn


@pytest.mark.parametrize("per_token,kernel", [(0.0, "decode"), (0.01, "prefill")])
def test_the_tuner_serves_prefill_on_whichever_kernel_times_faster(per_token, kernel, tmp_path):
    """The search walks from the GEMM's default config and takes the decode kernel where it times faster at the
    prefill M; the choice survives the cache, and the module built from it serves it on the "prefill" route."""
    from patchc.runtime import TileLinear

    plan, tuned, cached = tune_twice(tmp_path, _timer(per_token))
    for name, t in tuned.items():
        assert t.prefill.kernel == kernel and t.prefill_backend == "triton" and t.prefill.block_m >= 64, name
        assert cached[name].prefill == t.prefill
        mod = TileLinear.from_plan(plan.layers[name], t, dtype=torch.float16)
        assert mod.route(256) == "prefill" and mod.config(256).kernel == kernel


@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,tile", [(96, 128, (32, 32)), (176, 64, (16, 16))])
def test_the_decode_kernel_serves_prefill_sizes_with_token_tails(dtype, n, k, tile, monkeypatch):
    """A prefill config of the decode kernel at 64 tokens a program (split-K 2, added in the kernel): M = 67 and
    130 leave partial token blocks, taken in grouped order (176 rows in blocks of 16: a group of 8 block rows and
    a partial one of 3); M <= the threshold still goes to the decode buckets."""
    from patchc.runtime import TileLinear
    from patchc.runtime.tuner import default_tuning

    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    layer = random_layer_plan(n, k, tile, "mixed", dtype=torch.float32, bias=True, seed=7)
    packed = pack(layer)
    tuning = default_tuning(layer, packed, 4, 32, "sm_90")
    prefill = KernelConfig("decode", 64, *packed.block, 2, 4, 1, 8, "fixup")
    tuning = dataclasses.replace(tuning, prefill=prefill, threshold=16)
    mod = TileLinear.from_plan(layer, tuning, dtype=dtype)
    w64, b64 = layerplan_to_dense(layer, torch.float64), layer.bias.double()
    for m in (67, 130, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        assert mod.config(m).kernel == "decode" and mod.config(m).block_m == (64 if m > 16 else 16)
        y = mod(x)
        torch.testing.assert_close(y.double(), F.linear(x.double(), w64.to(dtype).double(), b64.to(dtype).double()),
                                   **TOL[dtype])


@triton.jit
def _order_kernel(out_ptr, rows, toks, GROUP: tl.constexpr):
    """Each program writes the (token block, block row) the decode kernel's grouped order gives it."""
    pid = tl.program_id(0)
    row, tok = swizzle(pid, rows, toks, GROUP)
    tl.store(out_ptr + 2 * pid, tok)
    tl.store(out_ptr + 2 * pid + 1, row)


@interpreter
@pytest.mark.interpreter
def test_grouped_order_visits_every_output_tile_once():
    """The decode kernel's grouped program order (from 64 tokens a program) is a bijection of the tiles, with
    each group of 8 block rows sweeping every token block before the next group starts."""
    for rows, toks in ((11, 3), (8, 16), (3, 5), (1, 1)):
        out = torch.full((rows * toks, 2), -1, dtype=torch.int32)
        _order_kernel[(rows * toks,)](out, rows, toks, DECODE_GROUP_ROWS)
        order = [tuple(p) for p in out.tolist()]
        assert sorted(order) == [(t, r) for t in range(toks) for r in range(rows)]
        group = min(rows, DECODE_GROUP_ROWS.value)
        assert {r for _, r in order[: group * toks]} == set(range(group))


def test_fused_experts_keep_the_gemm_where_their_slice_chose_the_decode_kernel():
    """Fused experts take their first slice's tuning, timed as one weight: a decode-kernel prefill there says
    nothing about E experts' rows, so their prefill runs the grouped GEMM's default config, and says why."""
    from patchc.ir import TilePlan
    from patchc.runtime.grouped_op import TileGroupedLinear
    from patchc.runtime.tuner import default_tuning

    layers = {f"w.{e}": random_layer_plan(32, 48, (16, 16), "mixed", seed=e, name=f"w.{e}") for e in range(2)}
    packed = pack(layers["w.0"])
    tuning = default_tuning(layers["w.0"], packed, 4, 32, "sm_90")
    tuning = dataclasses.replace(tuning, prefill=KernelConfig("decode", 64, *packed.block, 1, 4, 1, 8, "fixup"))
    weight = torch.stack([layerplan_to_dense(lp, torch.float32) for lp in layers.values()])
    mod = TileGroupedLinear.from_plan(TilePlan(layers=layers), "w", weight, tuning)
    assert mod.tuning.prefill.kernel == "prefill" and mod.tuning.prefill_backend == "triton"
    assert "decode kernel was timed on one slice" in mod.tuning.notes[-1]
    assert mod.tuning.decode == tuning.decode and mod.tuning.buckets == tuning.buckets


def test_the_bench_table_names_the_kernel_that_served_prefill():
    from patchc.bench.record import _kernel_cell

    row = {"route": "prefill", "config": {"kernel": "decode", "block_m": 128, "split_k": 1}}
    assert _kernel_cell(row) == "prefill on the decode kernel (128 tokens)"
    assert _kernel_cell({**row, "config": {"kernel": "prefill", "block_m": 128, "split_k": 2, "reduce": "fixup"}}) \
        == "prefill 2-way fixup"
