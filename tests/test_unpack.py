"""The unpacked prefill route: W * M unpacked on the device (`codegen.unpack_kernel`), then cuBLAS.

Tiers: the kernel under the Triton interpreter against the plan's own weight (`layerplan_to_dense`, not the
packed buffers) bit for bit; the route through `launch`, the custom op, `TileLinear` and the op's backward
against an independent dense product (fp32: 1e-5, fp16: 1e-3, bf16: 1e-2 relative and absolute); the tuner
with an injected timer; the compiled kernel's SASS for sm_80 / sm_90 (a subprocess without the interpreter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from patchc.codegen import KernelConfig, pack, tile_linear
from patchc.codegen.layout import kernel_buffers
from patchc.codegen.reference import layerplan_to_dense, random_layer_plan, random_tile_plan
from tests.conftest import older_triton_env, older_triton_params, tune_twice

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                 reason="runs the kernels in the Triton interpreter (a CPU machine)")


def _unpack(packed):
    from patchc.codegen.launch import unpack

    return unpack(kernel_buffers(packed), packed.shape, packed.block)


@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kinds", ["sparse", "mixed", "rows_no_dense", "rows_no_sparse"])
@pytest.mark.parametrize("n,k,tile,block", [(64, 96, (32, 32), (32, 32)), (77, 104, (16, 16), (16, 16)),
                                            (64, 128, (64, 64), (32, 64))])
def test_unpack_gives_the_plans_weight_bit_for_bit(dtype, kinds, n, k, tile, block):
    """Every block lands in place, 2:4 values at their kept positions, the edge blocks (77 x 104 cuts a
    partial block in N and K) cropped; blocks finer than the plan tile (32 x 64 in 64 x 64 tiles) too."""
    layer = random_layer_plan(n, k, tile, kinds, dtype=dtype, seed=n + k)
    w = _unpack(pack(layer, block=block))
    want = layerplan_to_dense(layer, dtype)
    assert w.shape == (n, k) and w.dtype == dtype and w.is_contiguous()
    assert torch.equal(w, want)
    if kinds == "sparse" and k % 4 == 0:  # structural: at most 2 of every 4
        assert int((w.reshape(n, -1, 4) != 0).sum(-1).max()) <= 2


@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("groups", [1, 2])
def test_both_kept_value_loads_unpack_in_place(groups, monkeypatch):
    """The two-groups-per-load expansion (Triton 3.6's, `configs.GROUPS_PER_LOAD`) hands its columns over in
    its own order (`sparse_columns`): stored in that order, every value still lands in its column."""
    import triton.language as tl

    from patchc.codegen import kernels

    monkeypatch.setattr(kernels, "GROUPS_PER_LOAD", tl.constexpr(groups))
    layer = random_layer_plan(67, 256, (32, 64), "mixed", dtype=torch.float16, seed=groups)
    assert torch.equal(_unpack(pack(layer, block=(32, 64))), layerplan_to_dense(layer, torch.float16))


@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpacked_config_runs_cublas_on_the_unpacked_weight(dtype):
    """`tile_linear` with an "unpacked" config: the product and bias of an independent dense F.linear (in
    float64), for a ragged M and leading dims."""
    layer = random_layer_plan(72, 80, (16, 16), "mixed", dtype=dtype, bias=True, seed=3)
    x = torch.randn(3, 7, 80, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = tile_linear(x, pack(layer), config=KernelConfig(kernel="unpacked"))
    ref = F.linear(x.double(), layerplan_to_dense(layer, torch.float64), layer.bias.double())
    assert y.shape == (3, 7, 72) and y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, **TOL[dtype])


def _unpacked_tuning(layer, packed, threshold=4):
    from patchc.runtime.tuner import default_tuning

    tuning = default_tuning(layer, packed, 4, 8, "sm_80")
    unpacked = KernelConfig("unpacked", 1, *packed.block, 1, 4, 1, 1, "fixup")
    return tuning.__class__(**{**tuning.__dict__, "prefill": unpacked, "prefill_backend": "unpacked",
                               "threshold": threshold})


@interpreter
@pytest.mark.interpreter
def test_tile_linear_serves_prefill_unpacked_forward_and_backward(monkeypatch):
    """A TileLinear whose tuning chose the unpacked route: M above the threshold goes through the custom op
    to unpack + F.linear, M below to the decode kernel; the op's backward unpacks on the kernels' path too.
    Outputs and input gradients against the plan's dense weight in float64."""
    from patchc.codegen import launch
    from patchc.runtime import TileLinear

    layer = random_layer_plan(48, 64, (16, 16), "mixed", dtype=torch.float32, bias=True, seed=4)
    packed = pack(layer)
    mod = TileLinear(packed, _unpacked_tuning(layer, packed))
    calls = []
    real = launch.unpack
    monkeypatch.setattr(launch, "unpack", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    import patchc.runtime.op as op
    monkeypatch.setattr(op, "unpack", launch.unpack)
    w64, b64 = layerplan_to_dense(layer, torch.float64), layer.bias.double()
    assert (mod.route(4), mod.route(5)) == ("decode", "unpacked")
    for m in (3, 9):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m), requires_grad=True)
        y = mod(x)
        torch.testing.assert_close(y.double(), F.linear(x.double(), w64, b64), **TOL[torch.float32])
        y.square().sum().backward()
        torch.testing.assert_close(x.grad.double(), (2 * y.detach().double()) @ w64, **TOL[torch.float32])
    # M = 9 forward unpacked once; both backwards unpack (M = 3's forward ran the decode kernel)
    assert calls == [(48, 64)] * 3


@interpreter
@pytest.mark.interpreter
def test_fused_experts_given_an_unpacked_tuning_prefill_on_the_hybrid_kernel(monkeypatch):
    """Fused experts take the tuning of their first slice, tuned as one layer: where it chose the unpacked route
    (which would unpack every expert at once), their prefill runs the grouped hybrid kernel, and says so."""
    from patchc.ir import TilePlan
    from patchc.runtime.grouped_op import TileGroupedLinear

    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    layers = {f"w.{e}": random_layer_plan(32, 48, (16, 16), "mixed", seed=e, name=f"w.{e}") for e in range(3)}
    tuning = _unpacked_tuning(layers["w.0"], pack(layers["w.0"]), threshold=2)
    weight = torch.stack([layerplan_to_dense(lp, torch.float32) for lp in layers.values()])
    mod = TileGroupedLinear.from_plan(TilePlan(layers=layers), "w", weight, tuning)
    assert mod.tuning.prefill.kernel == "prefill" and mod.tuning.prefill_backend == "triton"
    assert "no unpacked route" in mod.tuning.notes[-1]
    x, offs = torch.randn(20, 48, generator=torch.Generator().manual_seed(0)), torch.tensor([7, 7, 20])
    y = mod(x, offs.to(torch.int32))  # 20 rows > threshold: the grouped prefill kernel
    ref = torch.cat([x[:7].double() @ weight[0].double().T, x[7:].double() @ weight[2].double().T])
    torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])


@interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_a_tile_linears_weight_is_unpacked_where_the_op_runs_the_kernels(impl, monkeypatch):
    """`TileLinear.weight` (HF code reads it; saving writes it) is W * M either way: by the unpack kernel where
    the op runs the kernels, else by the indexing reference."""
    import patchc.runtime.op as op
    from patchc.runtime import TileLinear

    monkeypatch.setenv("PATCHC_CPU_IMPL", impl)
    calls = []
    monkeypatch.setattr(op, "unpack", lambda *a, _u=op.unpack, **k: calls.append(1) or _u(*a, **k))
    layer = random_layer_plan(40, 96, (16, 32), "mixed", dtype=torch.bfloat16, seed=8)
    mod = TileLinear.from_plan(layer, dtype=torch.bfloat16)
    assert torch.equal(mod.weight, layerplan_to_dense(layer, torch.bfloat16)) and mod.weight.dtype == torch.bfloat16
    assert len(calls) == (impl == "triton")  # once: the dense weight is cached


def _timer(unpacked_ms: float):
    """Decode 1 ms (+ 0.01 per token: at the prefill M it loses to the GEMM); the hybrid prefill 2 ms (+ a
    little per warp); the unpacked route `unpacked_ms`."""
    def time_fn(fn) -> float:
        cfg, m = fn.args[-1], fn.args[0].shape[0]
        if cfg.kernel == "unpacked":
            return unpacked_ms
        return 1.0 + m * 1e-2 if cfg.kernel == "decode" else 2.0 + 0.01 * cfg.num_warps + m * 1e-4
    return time_fn


def test_an_all_24_layer_where_cusparselt_wins_keeps_the_unpacked_route_for_the_op(monkeypatch):
    """cuSPARSELt faster still than the unpacked route: the tuning says semi_structured (the module's own path on
    a GPU) and keeps the unpacked config for the op, which serves where torch's 2:4 kernels cannot."""
    import patchc.runtime.tuner as tuner

    monkeypatch.setattr(tuner, "_semi_structured_ms", lambda t, m: 0.1)
    plan = random_tile_plan({"sparse.weight": dict(n=64, k=256, tile=(64, 64), kinds="sparse")})
    (t,) = tuner.tune_plan(plan, batch_size=4, prefill_len=64, dtype=torch.float16, device="cpu", progress=False,
                           arch="sm_90", cache=False, time_fn=_timer(1.5)).values()
    assert (t.prefill_backend, t.prefill.kernel, t.prefill_ms) == ("semi_structured", "unpacked", 0.1)


@pytest.mark.parametrize("unpacked_ms,route", [(1.5, "unpacked"), (3.0, "prefill")])
def test_tuner_serves_prefill_unpacked_only_where_it_is_faster(unpacked_ms, route, tmp_path):
    """The unpacked route is timed at the prefill M beside the hybrid kernel's best and kept when faster, for
    mixed and all-2:4 layers; the choice survives the cache, and the module built from it routes by it."""
    from patchc.runtime import TileLinear

    plan, tuned, cached = tune_twice(tmp_path, _timer(unpacked_ms))
    for name, t in tuned.items():
        assert t.prefill.kernel == route and t.prefill_backend == ("unpacked" if route == "unpacked" else "triton")
        assert cached[name].prefill == t.prefill and cached[name].prefill_backend == t.prefill_backend
        mod = TileLinear.from_plan(plan.layers[name], t, dtype=torch.float16)
        assert mod.route(256) == route


@interpreter
@pytest.mark.interpreter
def test_a_compiled_llama_tuned_to_the_unpacked_route_generates_the_pruned_models_tokens(monkeypatch):
    """`patchc.compile` with a timer under which cuBLAS wins at prefill: every layer prefills unpacked (the prompt's
    24 tokens are past the threshold), decodes on the hybrid kernels, and greedy generation gives the tokens
    and logits of the plan-applied model."""
    import copy

    import patchc
    from patchc.runtime import TileLinear
    from tests.conftest import tiny_llama_and_24_plan

    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    model, plan = tiny_llama_and_24_plan()
    fast = patchc.compile(model, plan, tune=True, time_fn=_timer(0.5), cache=False)
    layers = [m for m in fast.modules() if isinstance(m, TileLinear)]
    assert len(layers) == 14 and all(m.route(1) == "decode" and m.route(24) == "unpacked" for m in layers)
    pruned = plan.apply(copy.deepcopy(model))
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    got, want = fast.generate(ids, **kw), pruned.generate(ids, **kw)  # the prefill, then a decode step
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@interpreter
@pytest.mark.interpreter
def test_the_backend_tuned_to_the_unpacked_route_puts_it_in_the_graph(monkeypatch):
    """`torch.compile(backend="patch")` with the same timer: each planned weight's op in the graph carries the
    unpacked prefill config (op code 2), and a 24-token prompt gives the plan-applied model's logits."""
    import copy

    from tests.conftest import tiny_llama_and_24_plan

    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    torch._dynamo.reset()
    model, plan = tiny_llama_and_24_plan()
    pruned = plan.apply(copy.deepcopy(model))
    graphs = []
    cm = torch.compile(pruned, backend="patch", options={"plan": plan, "tune": True, "time_fn": _timer(0.5),
                                                         "cache": False, "inner": "eager",
                                                         "graph_callback": lambda gm, n: graphs.append(gm)})
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = cm(ids).logits, pruned(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    ops = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.patchc.tile_linear.default]
    # prefill_cfg of kernel "unpacked" (op code 2), and the 24 tokens above the threshold: that route ran
    assert len(ops) == 14 and all(n.args[14][0] == 2 and n.args[15] < 24 for n in ops)
    torch._dynamo.reset()


def test_layer_tuning_holds_the_unpacked_route_and_its_config_together():
    """prefill_backend "unpacked" and a prefill config of kernel "unpacked" go together; the op's int form of
    that config decodes back to it."""
    from patchc.runtime.op import decode_config, encode_config
    from patchc.runtime.tuner import LayerTuning

    layer = random_layer_plan(64, 64, (16, 16), "mixed", seed=0)
    packed = pack(layer)
    good = _unpacked_tuning(layer, packed)
    assert decode_config(encode_config(good.prefill)) == KernelConfig("unpacked", 1, None, None, 1, 4, 1, 1, "fixup")
    with pytest.raises(ValueError, match="'triton' does not go with a prefill config of kernel 'unpacked'"):
        LayerTuning(**{**good.__dict__, "prefill_backend": "triton"})
    with pytest.raises(ValueError, match="'unpacked' does not go with a prefill config of kernel 'prefill'"):
        LayerTuning(**{**good.__dict__, "prefill": dataclasses.replace(good.prefill, kernel="prefill", block_m=64)})
    assert LayerTuning(**{**good.__dict__, "prefill_backend": "semi_structured"}).prefill.kernel == "unpacked"
    # the decode kernel serves prefill sizes on the op's own route, where it timed faster than the GEMM
    on_decode = LayerTuning(**{**good.__dict__, "prefill": good.decode, "prefill_backend": "triton"})
    assert on_decode.prefill.kernel == "decode"
    with pytest.raises(ValueError, match="'unpacked' does not go with a prefill config of kernel 'decode'"):
        LayerTuning(**{**good.__dict__, "prefill": good.decode})


SASS_SCRIPT = r"""
import json, sys
from patchc.codegen.unpack_kernel import static_cost
print(json.dumps([static_cost(int(cc), dtype, block, dense) for cc in sys.argv[1:]
                  for dtype, block, dense in (("fp16", (128, 64), True), ("bf16", (128, 128), True),
                                              ("fp16", (64, 64), False))]))
"""


@pytest.mark.parametrize("triton_dir", [None, *older_triton_params()])
def test_unpack_compiles_to_wide_copies_within_the_bandwidth_budget(triton_dir):
    """Compiled for sm_80 and sm_90 (a subprocess: no interpreter): no spills, 128-bit loads and stores, and
    the whole kernel's code, both block kinds, issues under 0.1 warp-instructions per byte one block moves
    (a 2:4 block: its packed bytes read and its dense bytes written), far below the ~0.28 at which an H100
    stops being bound by memory: the unpacking is a copy at memory speed."""
    from patchc.codegen.sass import cuobjdump

    env = older_triton_env(triton_dir)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", SASS_SCRIPT, "80", "90"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in json.loads(proc.stdout.splitlines()[-1]):
        if not r["sass"]:
            assert cuobjdump() is None, "no SASS although cuobjdump is there"
            pytest.skip("this Triton ships no cuobjdump: no SASS to read")
        where = f"sm_{r['cc']} {r['dtype']} block {r['block']}"
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, where
        assert r["stg128"] > 0 and r["ldg128"] > 0, f"{where}: no 128-bit stores or loads"
        assert r["w_instr_per_byte"] < 0.1, f"{where}: {r['w_instr_per_byte']:.3f} warp-instructions per byte"


def test_unpack_records_leave_the_loop_table_of_their_triton_alone(tmp_path):
    """`static_profile.py --by-triton` tables the newest record with weight loops per Triton and target: an
    `--unpack` record appended after it (no loops) must not take its place and blank the row."""
    from tests.conftest import load_benchmark

    sp = load_benchmark("static_profile")
    loops = {"2:4": {"warp_instr_per_byte": 0.1, "barriers": 2}}
    path = tmp_path / "static_profile.jsonl"
    prefill = {"2:4": {"warp_instr_per_byte": 0.2, "barriers": 4, "warp_instr_per_kflop": 0.42}}
    path.write_text("\n".join(json.dumps({"triton": "3.9.0", "groups_per_load": 1, "results": results}) for results in (
        [{"target": "sm_90", "variant": "decode_m1", "loops": loops},
         {"target": "sm_90", "variant": "prefill", "loops": prefill}],
        [{"target": "sm_90", "kernel": "unpack", "w_instr_per_byte": 0.05}])) + "\n")
    # the prefill 2:4 loop per weight byte, then per kFLOP (its own column)
    assert "| 3.9.0 | 1 | sm_90 | 0.100–0.100, 2–2 | - | 0.200–0.200, 4–4 | 0.42–0.42 |" in sp.by_triton(path)
