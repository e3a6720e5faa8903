"""Runtime on CPU: patchc.compile, torch.compile(backend="patch"), torch.export, the custom op.

Tolerance: compiled vs pruned dense model in fp32, atol 1e-6 / rtol 1e-5. The CPU reference path runs
F.linear on W_hat rebuilt from the packed buffers, i.e. the same values and the same kernel as the pruned
model's F.linear, so the outputs agree to the last bit in practice; the margin only allows a different
reduction order. Triton-interpreter checks use the codegen tests' fp32 bound (atol 1e-4, rtol 1e-5).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types

import pytest
import torch
from torch import nn

import patchc
import patchc.runtime as rt
from patchc.codegen.reference import random_24_mask, random_kinds, random_layer_plan
from patchc.runtime import op as rt_op
from patchc.ir import LayerPlan, TilePlan
from patchc.ir.errors import PlanError
from patchc.pruning import oneshot
from tests.conftest import STORIES, needs_shared, prune_24, tiny_hf

TOL = dict(atol=1e-6, rtol=1e-5)
TOL_TRITON = dict(atol=1e-4, rtol=1e-5)
OP = torch.ops.patchc.tile_linear.default
# patchc.compile once the lead wires it into patchc/__init__ (_LAZY); the runtime's own name until then
compile_fn = getattr(patchc, "compile", None) or rt.compile


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    """Model-level tests use the plain-PyTorch CPU path, whatever other test modules did to Triton."""
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


def hybrid_masks(model: nn.Module, tile=(16, 16), p_dense: float = 0.5, seed: int = 0, skip=("lm_head",)):
    """Random hybrid masks: each tile dense (kept) with probability p_dense, else a random 2:4 pattern."""
    g = torch.Generator().manual_seed(seed)
    masks = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.split(".")[-1] not in skip:
            n, k = mod.weight.shape
            kinds = random_kinds(-(-n // tile[0]), -(-k // tile[1]), p_dense, g)
            dense = (kinds == 0).repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:n, :k]
            masks[f"{name}.weight"] = dense | random_24_mask(n, k, g)
    return masks


def n_hybrid(plan: TilePlan) -> int:
    return sum(int((layer.kinds == 1).sum()) > 0 for layer in plan.layers.values())


@pytest.fixture(scope="module")
def stories():
    if not (STORIES / "stories260K.bin").exists():
        pytest.skip(f"real model not found under {STORIES}")
    from patchc.models.llama2c import load_llama2c

    model = load_llama2c(STORIES / "stories260K.bin").eval()
    plan = TilePlan.from_masks(model, hybrid_masks(model), tile=(16, 16))
    pruned = plan.apply(copy.deepcopy(model))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = pruned(ids)
    return model, plan, pruned, ids, ref


@pytest.fixture(scope="module")
def llama():
    model = tiny_hf("llama")
    plan = TilePlan.from_masks(model, hybrid_masks(model, p_dense=0.4, seed=1), tile=(16, 16))
    pruned = plan.apply(copy.deepcopy(model))
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = pruned(ids, use_cache=False).logits
    return model, plan, pruned, ids, ref


def count_op(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target is OP)


def backend_run(model, ids, options, hf=False):
    counts = []
    torch._dynamo.reset()
    cm = torch.compile(model, backend=rt.patch_backend,
                       options={**options, "graph_callback": lambda gm, n: counts.append(count_op(gm.graph))})
    with torch.no_grad():
        out = cm(ids, use_cache=False).logits if hf else cm(ids)
    return out, sum(counts)


# --- stories260K -----------------------------------------------------------------------------------
@needs_shared
def test_compile_stories_matches_pruned(stories):
    model, plan, _, ids, ref = stories
    fast = compile_fn(model, plan, batch_size=2, prefill_len=12)
    swapped = [m for m in fast.modules() if isinstance(m, rt.TileLinear)]
    assert len(swapped) == n_hybrid(plan) == 35
    assert not any(isinstance(m, rt.TileLinear) for m in model.modules()), "the original must stay untouched"
    with torch.no_grad():
        torch.testing.assert_close(fast(ids), ref, **TOL)


@needs_shared
def test_backend_with_plan_stories(stories):
    model, plan, _, ids, ref = stories
    out, count = backend_run(model, ids, {"plan": plan})
    assert count == n_hybrid(plan)
    torch.testing.assert_close(out, ref, **TOL)


@needs_shared
def test_backend_infers_plan_from_pruned_stories(stories):
    _, plan, pruned, ids, ref = stories
    out, count = backend_run(pruned, ids, {})
    # the inferred plan finds every layer with a 2:4 tile; the tied lm_head/embedding stays dense
    assert count == n_hybrid(plan)
    torch.testing.assert_close(out, ref, **TOL)


@needs_shared
def test_export_of_compiled_stories(stories):
    model, plan, _, ids, ref = stories
    fast = compile_fn(model, plan, batch_size=2, prefill_len=12, tune=False)
    ep = torch.export.export(fast, (ids,))
    assert count_op(ep.graph) == n_hybrid(plan)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(ids), ref, **TOL)


# --- tiny transformers Llama -------------------------------------------------------------------------
def test_compile_tiny_llama_matches_pruned(llama):
    model, plan, _, ids, ref = llama
    fast = compile_fn(model, plan, batch_size=2, prefill_len=10)
    assert sum(isinstance(m, rt.TileLinear) for m in fast.modules()) == n_hybrid(plan) > 0
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, use_cache=False).logits, ref, **TOL)


def test_backend_tiny_llama_plan_and_inferred(llama):
    model, plan, pruned, ids, ref = llama
    out, count = backend_run(model, ids, {"plan": plan}, hf=True)
    assert count == n_hybrid(plan)
    torch.testing.assert_close(out, ref, **TOL)
    out, count = backend_run(pruned, ids, {"tile": (16, 16)}, hf=True)
    assert count == n_hybrid(plan)
    torch.testing.assert_close(out, ref, **TOL)


def test_backend_refuses_a_plan_made_for_other_weights_and_reads_a_plan_file(llama, tmp_path):
    """A plan given to the backend for a model whose weights are not its source is refused, naming the layer,
    as `plan.apply` and `patchc.compile` refuse it (the backend served the plan's own pruned weights beside
    the other model's embeddings and norms); `force` serves them anyway. The plan may be a file's path."""
    model, plan, pruned, ids, ref = llama
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.01)
    with pytest.raises(Exception, match=r"patch backend: layer .*weight: the model's weight has norm .*the plan "
                                        r"was made for other weights .*options=\{'force': True\}"):
        backend_run(other, ids, {"plan": plan}, hf=True)
    _, count = backend_run(other, ids, {"plan": plan, "force": True}, hf=True)
    assert count == n_hybrid(plan)
    out, count = backend_run(pruned, ids, {"plan": plan}, hf=True)  # W * M: the plan's own weights, applied
    assert count == n_hybrid(plan)
    torch.testing.assert_close(out, ref, **TOL)
    plan.save(tmp_path / "plan.patch")
    out, count = backend_run(model, ids, {"plan": str(tmp_path / "plan.patch")}, hf=True)
    assert count == n_hybrid(plan)
    torch.testing.assert_close(out, ref, **TOL)


def _biased_mlp_and_plan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64))
    masks = oneshot(model, method="magnitude", pattern="tiles", sparsity=0.3, tile=(16, 16), progress=False)
    return model, TilePlan.from_masks(model, masks, tile=(16, 16))


def test_backend_biases_of_planned_layers_get_their_gradients():
    """The backend served a planned layer's bias from a frozen copy in the plan: the model's bias kept
    requires_grad but got no .grad, so an optimizer (BitFit, a head over a pruned backbone) skipped it."""
    model, plan = _biased_mlp_and_plan()
    ref, x = plan.apply(copy.deepcopy(model)), torch.randn(5, 64)
    ref(x).pow(2).sum().backward()
    torch._dynamo.reset()
    torch.compile(model, backend=rt.patch_backend, options={"plan": plan, "tune": False})(x).pow(2).sum().backward()
    torch._dynamo.reset()
    want = dict(ref.named_parameters())
    for name in ("0.bias", "1.weight", "1.bias", "2.bias"):
        torch.testing.assert_close(model.get_parameter(name).grad, want[name].grad, atol=1e-5, rtol=1e-5)


def test_a_bias_changed_after_planning_is_refused_not_replaced():
    """The plan carries each planned layer's bias as it was: compile, apply and the backend replaced a bias
    fine-tuned since with that stale one, without a word. Now each refuses as for changed weights, naming the
    layer; `force` serves the plan's bias, as it does the plan's weights."""
    model, plan = _biased_mlp_and_plan()
    with torch.no_grad():
        model[2].bias.add_(0.5)
    why = r"layer 2.weight: 64 of 64 bias values differ from the plan's \(max \|diff\| 0.5; a bias changed since"
    for run in (lambda: compile_fn(model, plan, tune=False), lambda: plan.apply(copy.deepcopy(model)),
                lambda: backend_run(model, torch.randn(3, 64), {"plan": plan, "tune": False})):
        with pytest.raises(Exception, match=why):  # the backend's ValueError comes wrapped by dynamo
            run()
    forced = compile_fn(model, plan, tune=False, force=True)
    with torch.no_grad():
        torch.testing.assert_close(forced[2].bias, model[2].bias - 0.5)


@pytest.mark.parametrize("source, fqn", [
    ("L['self']._modules['layers']._modules['0']._parameters['weight']", "layers.0.weight"),
    ("L['fn'].lm_head.weight", "lm_head.weight"),
    # transformers >= 5.2x wraps forward in a (*args, **kwargs) decorator: the module is args[0]
    ("L['args'][0]._modules['model']._modules['norm']._parameters['weight']", "model.norm.weight"),
    ("L['this']._modules['a']._parameters['weight']", "a.weight"),  # forward(this, x)
    ("L['args'][1]", None),  # an input, not a parameter
    ("L['x']", None),
    ("L['args'][0]", None),
    ("G['table']", None),
])
def test_source_fqn_reads_every_spelling_of_the_compiled_module(source, fqn):
    from types import SimpleNamespace

    from patchc.runtime.graph_names import source_fqn

    node = SimpleNamespace(meta={"grapharg": SimpleNamespace(source=SimpleNamespace(name=lambda: source))})
    assert source_fqn(node) == fqn


def test_backend_entry_point_name():
    """backend="patch" resolves through the torch_dynamo_backends entry point once installed."""
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "patch"]
    if not eps:
        pytest.skip("entry point not installed yet: pip install --no-deps -e . after pyproject has it")
    assert eps[0].value == "patchc.runtime.backend:patch_backend"
    assert "patch" in torch._dynamo.list_backends(exclude_tags=())


def test_backend_takes_the_inductor_mode_in_its_options(tiny_mlp, monkeypatch):
    """torch.compile refuses mode= beside options= (torch 2.11 on the GPU machine raised): with a plan, the
    mode (reduce-overhead: CUDA graphs) travels in the options and reaches inductor."""
    import patchc.runtime.backend as backend

    seen = []
    real = backend._inner_compile
    monkeypatch.setattr(backend, "_inner_compile", lambda gm, ex, inner, mode: seen.append(mode) or real(gm, ex, inner, None))
    with pytest.raises(RuntimeError, match="Either mode or options"):
        torch.compile(tiny_mlp, backend="patch", mode="reduce-overhead", options={"plan": None})
    torch._dynamo.reset()
    cm = torch.compile(tiny_mlp, backend=rt.patch_backend, options={"mode": "reduce-overhead", "tune": False})
    with torch.no_grad():
        cm(torch.randint(0, 32, (2, 5)))
    torch._dynamo.reset()
    assert seen == ["reduce-overhead"]


def test_backend_rejects_unknown_option(tiny_mlp):
    torch._dynamo.reset()
    cm = torch.compile(tiny_mlp, backend=rt.patch_backend, options={"plan": None, "bogus": 1})
    with pytest.raises(Exception, match="unknown option"):
        cm(torch.zeros(1, 3, dtype=torch.long))


def test_all_dense_layers_stay_linear(tiny_mlp):
    plan = TilePlan.from_weights(tiny_mlp.state_dict(), tile=(8, 8))  # random weights: every tile dense
    fast = compile_fn(tiny_mlp, plan, tune=False)
    assert not any(isinstance(m, rt.TileLinear) for m in fast.modules())
    assert isinstance(fast.up, nn.Linear)


# --- the custom op -----------------------------------------------------------------------------------
def small_module(kinds="mixed", bias=True, n=48, k=64, tile=(16, 32), threshold=None):
    layer = random_layer_plan(n, k, tile=tile, kinds=kinds, bias=bias, seed=3, name="fc.weight")
    mod = rt.TileLinear.from_plan(layer, dtype=torch.float32, batch_size=2, prefill_len=8)
    if threshold is not None:
        mod.threshold = threshold
    return layer, mod


def test_retuned_shares_the_weights_and_changes_only_the_configs():
    from patchc.codegen import pack

    _, mod = small_module()
    t = mod.tuning
    flipped = dataclasses.replace(t, decode=dataclasses.replace(t.decode, split_k=2, reduce="launch"), buckets=())
    other = mod.retuned(flipped)
    assert other.config(1).reduce == "launch" and other.config(1).split_k == 2 and mod.tuning is t
    assert all(getattr(other, b) is getattr(mod, b) for b in rt.dispatch.BUFFER_NAMES)
    x = torch.randn(3, 64)
    torch.testing.assert_close(other(x), mod(x))
    layer, _ = small_module()
    at_16 = rt.tuner.default_tuning(layer, pack(layer, block=(16, 16)), 2, 8, "sm_80")
    with pytest.raises(ValueError, match=r"keeps the packed block \(16, 32\).*got block \(16, 16\)"):
        mod.retuned(at_16)


def test_opcheck_custom_op():
    _, mod = small_module()
    for shape in [(3, 64), (2, 5, 64)]:
        x = torch.randn(*shape)
        torch.library.opcheck(OP, (x, *mod.op_args()))


def test_op_reference_and_fake_shapes():
    layer, mod = small_module()
    x = torch.randn(2, 3, 64)
    y = mod(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.to_dense(), layer.bias), **TOL)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = OP(torch.empty(7, 64), *mod.op_args())
    assert fake.shape == (7, 48)
    with pytest.raises(ValueError, match="fc.weight.*K=64"):
        mod(torch.randn(2, 60))


def test_gradients_reach_the_input_and_a_model_bias_not_the_packed_weights():
    """A compiled model called with gradients on backpropagates through the op (aot_autograd needs the
    formula): dL/dx = dL/dy @ W_hat, a bias read from the model gets its sum; the packed weights are frozen."""
    layer, mod = small_module(bias=False)
    x, bias = torch.randn(2, 3, 64, requires_grad=True), torch.randn(48, requires_grad=True)
    y = OP(x, *mod.op_args(bias=bias))
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, g @ layer.to_dense(), **TOL)
    torch.testing.assert_close(bias.grad, g.sum((0, 1)), **TOL)
    assert not any(t.requires_grad for t in mod.buffers())
    torch.library.opcheck(OP, (x.detach().requires_grad_(), *mod.op_args(bias=bias)))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_the_output_takes_an_in_place_add_with_gradients_on(impl, monkeypatch):
    """The op's output is no view on either path (the kernels' path interpreted here): autograd forbids in-place
    ops on a view a custom op outputs, and models add into a linear's output in place (Llama 4's shared expert:
    `out.add_(routed)`), which failed with gradients on."""
    if impl == "triton" and not rt_op.kernels_interpreted():
        pytest.skip("patchc's Triton kernels were not decorated under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    monkeypatch.setenv("PATCHC_CPU_IMPL", impl)
    layer, mod = small_module(bias=False)
    x = torch.randn(2, 3, 64, requires_grad=True)
    y = mod(x)
    assert not y._is_view()
    y.add_(1.0)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(y.detach(), x.detach() @ layer.to_dense().t() + 1.0, **TOL)
    torch.testing.assert_close(x.grad, g @ layer.to_dense(), **TOL)


# Triton's own @jit helpers (tl.sum, tl.cdiv, ...) are decorated when triton is first imported, so the
# interpreter only works in a process that had TRITON_INTERPRET=1 before importing triton: run there.
INTERP_SCRIPT = r"""
import torch, torch.nn.functional as F
import patchc.runtime as rt
from patchc.runtime import op as rt_op
from patchc.codegen.reference import random_layer_plan
assert rt_op.kernels_interpreted() and rt_op.use_triton(torch.zeros(1))
seen = []
real = rt_op.launch
def spy(x2, *args, **kwargs):
    seen.append((x2.shape[0], args[-1].kernel))
    return real(x2, *args, **kwargs)
rt_op.launch = spy
for kinds in ("mixed", "sparse"):
    layer = random_layer_plan(48, 64, tile=(16, 32), kinds=kinds, bias=True, seed=3, name="fc.weight")
    mod = rt.TileLinear.from_plan(layer, dtype=torch.float32, batch_size=2, prefill_len=8)
    mod.threshold = 4
    w = layer.to_dense()
    for m in (2, 20):
        x = torch.randn(m, 64)
        torch.testing.assert_close(mod(x), F.linear(x, w, layer.bias), atol=1e-4, rtol=1e-5)
assert seen == [(2, "decode"), (20, "prefill")] * 2, seen
torch.library.opcheck(torch.ops.patchc.tile_linear.default, (torch.randn(3, 64), *mod.op_args()))
# fused experts (tile_grouped_mm): experts 0 and 2 planned, expert 1 a dense weight, all in one launch per call
from patchc.runtime import grouped_op
from patchc.ir import TilePlan
layers = {f"w.{e}": random_layer_plan(48, 64, tile=(16, 32), kinds="mixed", seed=e, name=f"w.{e}") for e in (0, 2)}
slices = torch.randn(3, 48, 64)
for e in (0, 2):
    slices[e] = layers[f"w.{e}"].to_dense()
mod = grouped_op.TileGroupedLinear.from_plan(TilePlan(layers=layers), "w", slices, batch_size=2, prefill_len=8)
mod.threshold = 4
grouped = []
seen.clear()
real_grouped = grouped_op.launch_grouped
grouped_op.launch_grouped = lambda x2, offs, *a, **k: grouped.append((x2.shape[0], a[-1].kernel)) or real_grouped(x2, offs, *a, **k)
for x, offs in ((torch.randn(3, 64), torch.tensor([2, 2, 3], dtype=torch.int32)),
                (torch.randn(9, 64), torch.tensor([2, 3, 9], dtype=torch.int32))):
    bounds = [0, *offs.tolist()]
    want = torch.cat([x[bounds[e]:bounds[e + 1]] @ slices[e].T for e in range(3)])
    torch.testing.assert_close(mod(x, offs), want, atol=1e-4, rtol=1e-5)
assert grouped == [(3, "decode"), (9, "prefill")] and not seen, (grouped, seen)  # no per-expert launches
torch.library.opcheck(torch.ops.patchc.tile_grouped_mm.default, (x, offs, *mod.op_args()))
print("INTERP-OK")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the GPU tests run the kernels for real")
def test_triton_path_dispatch_and_opcheck_interpreted():
    """Under TRITON_INTERPRET=1: decode kernel for M <= threshold, prefill above, exact; opcheck passes."""
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1", "PATCHC_CPU_IMPL": "auto"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", INTERP_SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "INTERP-OK" in proc.stdout, proc.stderr[-4000:]


def test_a_float64_model_is_served_exactly_never_by_the_fp32_kernels(monkeypatch):
    """`.double()` after patchc.compile ran the fp32-accumulating kernels (1.9e-7 off, not 1e-15)."""
    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")  # the kernels' path, as on a GPU
    assert rt_op.use_triton(torch.zeros(1)) and not rt_op.use_triton(torch.zeros(1, dtype=torch.float64))
    model, plan = _biased_mlp_and_plan()
    fast, ref = compile_fn(model, plan, tune=False).double(), plan.apply(copy.deepcopy(model)).double()
    x = torch.randn(3, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), ref(x), atol=1e-12, rtol=1e-12)


def test_cpu_impl_setting(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "nonsense")
    with pytest.raises(ValueError, match="PATCHC_CPU_IMPL"):
        rt_op.use_triton(torch.zeros(1))
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    assert not rt_op.use_triton(torch.zeros(1))


def test_config_roundtrip():
    for ints in ([0, 16, 4, 4, 3, 8, 0], [1, 64, 2, 8, 3, 8, 1]):
        assert rt_op.encode_config(rt_op.decode_config(ints)) == ints
    assert rt_op.decode_config([0, 16, 4, 4, 3, 8, 1]).reduce == "launch"
    with pytest.raises(ValueError, match="kernel code"):
        rt_op.decode_config([5, 1, 1, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="reduce code 2"):
        rt_op.decode_config([0, 16, 4, 4, 3, 8, 2])
    with pytest.raises(ValueError, match=r"7 ints \('kernel'.*'reduce'\), got \[0, 16, 4, 4, 3, 8\]"):
        rt_op.decode_config([0, 16, 4, 4, 3, 8])  # the form before reduce: a cache of it is stale


def test_compiling_a_compiled_model_says_so():
    """Its planned linears are TileLinears now: the error said only "the model has no parameter '0.weight'"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    plan = TilePlan.from_masks(model, oneshot(model, method="magnitude", pattern="2:4", progress=False), tile=16)
    fast = compile_fn(model, plan, tune=False)
    with pytest.raises(PlanError, match=r"the model is already compiled \(0 is a TileLinear\); compile the model "
                                        r"the plan was made from, or use this one as it is \(layer 0.weight: .*no "
                                        r"parameter"):
        compile_fn(fast, plan, tune=False)
    with pytest.raises(ValueError, match=r"already compiled \(0 is a TileLinear\).*\(no plan layer"):
        compile_fn(fast, tune=False)  # nor read off its zeros


def test_compile_rejects_bad_tune(tiny_mlp):
    with pytest.raises(ValueError, match="tune must be"):
        compile_fn(tiny_mlp, TilePlan(), tune="always")


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on the ops that make a CUDA stream wait for the host: reading a value, or an op whose output
    size depends on values (nonzero & co.). On CPU tensors the same ops mark the same hazard."""

    SYNCING = {"item", "_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        assert name not in self.SYNCING, f"host synchronisation: aten.{name} in the Triton launch path"
        if func is OP:  # run the op's body under this mode too (a mode is off while it handles an op)
            with self:
                return rt_op.tile_linear._init_fn(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def record_launches(monkeypatch) -> list[tuple[str, tuple[int, ...], dict]]:
    """Replace the Triton kernels by recorders of (kernel, grid, constexprs and options): nothing runs."""
    from patchc.codegen import kernels

    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((self.name, grid, kw))

    for name in ("decode", "prefill"):
        monkeypatch.setitem(kernels.KERNELS, name, Recorder(name))
    monkeypatch.setattr(kernels, "splitk_reduce_kernel", Recorder("splitk_reduce"))
    return launched


def test_launch_path_has_no_host_sync(monkeypatch):
    """The op's Triton path (dispatch by M, allocation, grid, launch, split-K reduce) reads no tensor value
    on the host, so it can run under CUDA-graph capture. The kernels are replaced by recorders: what is
    checked is everything around them, for decode calls with split-K (added in the kernel, whose counters
    are allocated on the first call, or by a second launch) and a prefill call."""
    launched = record_launches(monkeypatch)
    monkeypatch.setattr(rt_op, "use_triton", lambda x: True)
    layer = random_layer_plan(256, 512, tile=(64, 64), kinds="mixed", bias=True, name="fc.weight")
    mod = rt.TileLinear.from_plan(layer)
    assert mod.decode_cfg[2] > 1, "the decode config should split K here, to cover the reductions"
    with _NoHostSync():
        mod(torch.randn(2, 512))
        mod(torch.randn(3, 40, 512))
        width = len(rt_op.CONFIG_FIELDS) + 1  # every bucket's reduction: a second launch
        mod.decode_buckets = [rt_op.REDUCE_CODES["launch"] if i % width == width - 1 else v
                              for i, v in enumerate(mod.decode_buckets)]
        mod(torch.randn(2, 512))
    kinds = [k for k, _, _ in launched]
    assert kinds == ["decode", "prefill", "decode", "splitk_reduce"], launched
    with pytest.raises(AssertionError, match="host synchronisation"), _NoHostSync():
        torch.ones(3).sum().item()  # the guard itself catches a read



def bucketed_module(n=48, k=64, tile=(16, 32), threshold=16):
    """small_module with decode buckets M=1 (block_m 1), 2-4 (block_m 4), 5-16 (block_m 16, split-K 2 added by
    a second launch), prefill above."""
    from patchc.codegen.configs import KernelConfig

    _, mod = small_module(n=n, k=k, tile=tile, threshold=threshold)
    mod.decode_buckets = rt_op.encode_buckets([
        (1, KernelConfig("decode", 1, None, None, 1, 4, 2, 8, "fixup")),
        (4, KernelConfig("decode", 4, None, None, 1, 4, 2, 8, "fixup")),
        (16, KernelConfig("decode", 16, None, None, 2, 4, 2, 8, "launch")),
    ])
    mod.prefill_cfg = rt_op.encode_config(KernelConfig("prefill", 16, None, None, 1, 4, 2, 8, "fixup"))
    return mod


@pytest.fixture
def capture(monkeypatch):
    """The Triton path on CPU with recorded kernels, a fresh set of launched kernels, and a switch that
    makes the launcher believe a CUDA graph is being captured."""
    from patchc.codegen import launch as launch_mod

    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    monkeypatch.setattr(launch_mod, "_LAUNCHED", set())
    state = {"on": False, "launched": record_launches(monkeypatch)}
    monkeypatch.setattr(launch_mod, "_capturing", lambda: state["on"])
    return state


def test_capture_refuses_a_kernel_that_never_ran(capture):
    mod = bucketed_module()
    mod(torch.randn(3, 64))  # outside capture: the first launch compiles
    capture["on"] = True
    mod(torch.randn(3, 64))
    mod(torch.randn(2, 64))  # the same compiled kernel: Triton specialises M only on == 1 and % 16
    before = len(capture["launched"])
    with pytest.raises(RuntimeError, match=r"layer 'fc.weight': M=16 .*capturing.*warm-up.*TileLinear.warmup"):
        mod(torch.randn(16, 64))  # another bucket, never run
    misaligned = torch.randn(3 * 64 + 1)[1:].view(3, 64)  # 4 bytes off: Triton compiles a kernel without
    with pytest.raises(RuntimeError, match=r"layer 'fc.weight': M=3 .*warm-up"):  # 16-byte vector loads
        mod(misaligned)
    assert len(capture["launched"]) == before  # refused before launching
    from patchc.codegen import launch as launch_mod
    from patchc.codegen.configs import KernelConfig

    x2 = torch.randn(40, 64)
    with pytest.raises(RuntimeError, match=r"layer of shape \(N=48, K=64\): M=40"):  # no name: the shape
        launch_mod.launch(x2, tuple(getattr(mod, b) for b in rt.dispatch.BUFFER_NAMES), None, (48, 64),
                          mod.block, mod.per_row, KernelConfig("prefill", 16, *mod.block, 1, 4, 2, 8, "fixup"))


def test_warmup_covers_decode_buckets_and_prefill(capture):
    mod = bucketed_module()
    assert mod.warmup([1, 3, 16, 40]) is mod
    kernels = [(kind, kw.get("BLOCK_M"), kw.get("SPLIT_K")) for kind, _, kw in capture["launched"]]
    assert kernels == [("decode", 1, 1), ("decode", 4, 1), ("decode", 16, 2), ("splitk_reduce", None, 2),
                       ("prefill", 16, 1)]
    capture["on"] = True
    for m in (1, 2, 3, 16, 40, 23):  # every warmed kernel replays; 2 and 23 compile like 3 and 40
        assert mod(torch.randn(m, 64)).shape == (m, 48)
    with pytest.raises(RuntimeError, match="M=32"):
        mod(torch.randn(32, 64))
    with pytest.raises(ValueError, match="M >= 1"):
        mod.warmup([0])


def test_runtime_warmup_warms_every_tile_linear(capture):
    first, second = bucketed_module(), bucketed_module(n=32, k=48, tile=(16, 16))
    model = nn.Sequential(first, nn.ReLU(), second)
    capture["on"] = True
    with pytest.raises(RuntimeError, match="warm-up"):
        model(torch.randn(3, 64))
    capture["on"] = False
    assert rt.warmup(model, iter([1, 3, 40])) == 2  # an iterator: read once, used for both modules
    capture["on"] = True
    for m in (1, 3, 40):
        assert model(torch.randn(m, 64)).shape == (m, 32)
    assert rt.warmup(nn.Linear(4, 4), [1]) == 0


def test_compile_ahead_builds_what_warmup_then_launches(capture, monkeypatch):
    """The compile-only calls `warmup` hands to the parallel compile are the launches its runs make: the
    same kernels, grids' configs and constexprs (here launched instead, and recorded)."""
    from patchc.codegen import launch as launch_mod

    mod, ms = bucketed_module(), [1, 3, 16, 40]
    warmers = mod.warmers(ms)
    assert [w.func for w in warmers] == [rt.dispatch.warm] * len(ms)
    for w in warmers:
        launch_mod.launch(*w.args)
    ahead = list(capture["launched"])
    capture["launched"].clear()
    mod._run_each(ms)
    assert ahead == capture["launched"] and len(ahead) == 5  # 3 decode buckets, a split-K reduce, prefill
    mod.semi_weight = object()  # torch's 2:4 kernels serve M above the threshold: nothing of ours to compile
    assert [w.args[0].shape[0] for w in mod.warmers(ms)] == [m for m in ms if m <= mod.threshold]


def test_model_warmup_compiles_every_layer_at_once_on_a_gpu(capture, monkeypatch):
    first, second = bucketed_module(), bucketed_module(n=32, k=48, tile=(16, 16))
    calls = []
    monkeypatch.setattr(rt.dispatch, "compile_ahead_each", lambda jobs: calls.append(list(jobs)))
    rt.warmup(nn.Sequential(first, second), (m for m in (1, 40)))
    assert calls == [[(first, [1, 40]), (second, [1, 40])]]

    handed = []  # on CPU compile_ahead does nothing; on CUDA every module's warmers go to one parallel compile
    monkeypatch.undo()
    monkeypatch.setattr(rt.timing, "compile_parallel", lambda warmers, threads: handed.append(list(warmers)))
    rt.timing.compile_ahead([first, second], [1, 40])
    assert handed == []

    class OnGpu:
        values = types.SimpleNamespace(is_cuda=True)

        def __init__(self, tag):
            self.tag = tag

        def warmers(self, ms):
            return [(self.tag, m) for m in ms]

    rt.timing.compile_ahead([OnGpu("a"), OnGpu("b")], [1, 40])
    assert handed == [[("a", 1), ("a", 40), ("b", 1), ("b", 40)]]
    rt.timing.compile_ahead_each([(OnGpu("a"), [1]), (OnGpu("experts"), [2, 80])])  # experts: M x top_k rows
    assert handed[-1] == [("a", 1), ("experts", 2), ("experts", 80)]


# --- TileLinear as a drop-in for nn.Linear, and what patchc.compile swaps ------------------------------
def test_tile_linear_is_a_drop_in_for_linear():
    layer, mod = small_module()
    assert (mod.in_features, mod.out_features) == (64, 48) and mod.bias.shape == (48,)
    w = mod.weight
    assert torch.equal(w, layer.to_dense()) and mod.weight is w  # built once, then cached
    x = torch.randn(3, 64)
    torch.testing.assert_close(mod(x), torch.nn.functional.linear(x, w, mod.bias))
    with pytest.raises(AttributeError, match="cannot be assigned"):
        mod.weight = torch.zeros(48, 64)
    assert "weight" not in mod.state_dict()
    mod.to(torch.float64)
    assert mod.weight.dtype == torch.float64 and mod.bias.dtype == torch.float64
    other = small_module()[1].to(torch.float64)
    other.load_state_dict(copy.deepcopy(mod.state_dict()))
    torch.testing.assert_close(other(x.double()), mod(x.double()))
    # .weight is rebuilt from the module's own buffers: it follows a load, and no LayerPlan is kept beside them
    layer2 = dataclasses.replace(layer, dense=layer.dense * 2, values=layer.values * 2)
    other.weight  # cached, then overwritten below
    other.load_state_dict(rt.TileLinear.from_plan(layer2, dtype=torch.float64).state_dict())
    assert torch.equal(other.weight, layer2.to_dense().double())
    assert not any(isinstance(v, LayerPlan) for v in vars(other).values())


def _mask24(shape, seed):
    return random_24_mask(*shape, torch.Generator().manual_seed(seed))


def _planned(model, fqns, tile=(16, 16)):
    masks = {f: _mask24(tuple(model.get_parameter(f).shape), seed=i) for i, f in enumerate(fqns)}
    return TilePlan.from_masks(model, masks, tile=tile, allow_lossy=True)


def test_compile_swaps_sequential_tied_users_and_conv1d():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    seq[2].weight = seq[0].weight  # tied: one plan layer, two modules
    conv = transformers.pytorch_utils.Conv1D(48, 32)  # weight (in, out) = (32, 48)
    model = nn.Sequential(seq, conv)
    plan = _planned(model, ["0.0.weight"])
    conv_mask = _mask24((48, 32), seed=5)
    conv_plan = TilePlan.from_masks({"1.weight": conv.weight.detach().t()}, {"1.weight": conv_mask}, tile=(16, 16))
    plan = TilePlan(layers={**plan.layers, **conv_plan.layers},
                    meta={"targets": {"1.weight": {"param": "1.weight", "expert": None, "transposed": True}}})
    ref = plan.apply(copy.deepcopy(model), force=True)
    fast = compile_fn(model, plan, tune=False, strict=True)
    assert isinstance(fast[0][0], rt.TileLinear) and isinstance(fast[0][2], rt.TileLinear)
    assert isinstance(fast[1], rt.TileLinear) and fast[1].weight.shape == (48, 32)
    x = torch.randn(5, 32)
    torch.testing.assert_close(fast(x), ref(x))


def test_compile_writes_the_plan_into_a_weight_a_kept_module_still_reads():
    """A planned weight tied to a module compile does not replace (an embedding reading the LM head's matrix)
    stays in the model, so it gets W * M; one only the replaced linears read leaves with them, unwritten."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mid, self.head = nn.Embedding(48, 32), nn.Linear(32, 32), nn.Linear(32, 48, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.relu(self.mid(self.emb(ids))))

    torch.manual_seed(0)
    model = Tied()
    plan = _planned(model, ["head.weight", "mid.weight"])
    ref = plan.apply(copy.deepcopy(model), force=True)
    mid_before = model.mid.weight.detach().clone()
    old_mid = model.mid.weight
    fast = compile_fn(model, plan, tune=False, inplace=True)
    assert isinstance(fast.head, rt.TileLinear) and isinstance(fast.mid, rt.TileLinear)
    assert torch.equal(fast.emb.weight, plan.layers["head.weight"].to_dense()), "the embedding reads W * M"
    assert torch.equal(old_mid, mid_before), "a weight leaving with its module is never written"
    ids = torch.randint(0, 48, (3, 5))
    torch.testing.assert_close(fast(ids), ref(ids))


def test_compiling_a_copy_copies_no_weight_the_swap_removes(monkeypatch):
    """The copy `compile` works on (inplace=False) takes what stays in the model, not the weights that leave
    with the replaced linears; the original keeps every value, and the copy serves the same outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(48, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 48))
    model[4].weight = model[0].weight  # a tied head: the embedding keeps reading it
    plan = _planned(model, ["1.weight", "3.weight", "4.weight"])
    ref = plan.apply(copy.deepcopy(model), force=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copied: list[tuple[int, ...]] = []
    real = nn.Parameter.__deepcopy__

    def spy(self, memo):
        copied.append(tuple(self.shape))
        return real(self, memo)

    monkeypatch.setattr(nn.Parameter, "__deepcopy__", spy)
    fast = compile_fn(model, plan, tune=False)
    assert (64, 32) not in copied and (32, 64) not in copied, "a replaced linear's weight was copied"
    assert (48, 32) in copied and (64,) in copied, "the tied head / embedding and the biases are copied"
    assert all(isinstance(fast[i], rt.TileLinear) for i in (1, 3, 4)) and model[1].weight.shape == (64, 32)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "the original changed"
    ids = torch.randint(0, 48, (3, 5))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids), ref(ids))
    assert len(plan.layers) == 3, "the caller's plan is kept unless released"
    all_dense = TilePlan.from_masks(model, {"1.weight": torch.ones(64, 32, dtype=torch.bool)}, tile=(16, 16))
    dense_too = TilePlan(layers={**plan.layers, **all_dense.layers}, meta=plan.meta)  # 1.weight: no 2:4 tile
    again = compile_fn(model, dense_too, tune=False, release_plan=True)
    assert list(dense_too.layers) == ["1.weight"], "released: only the layer left dense stays in the plan"
    assert isinstance(again[1], nn.Linear) and isinstance(again[3], rt.TileLinear)


def test_compile_keeps_each_replacement_on_its_layers_device():
    """Without `device=`, a model split over devices stays split (meta stands in for a second GPU)."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    plan = _planned(seq, ["0.weight", "2.weight"])
    seq[2].to("meta")
    fast = compile_fn(seq, plan, tune=False, force=True)
    assert isinstance(fast[0], rt.TileLinear) and isinstance(fast[2], rt.TileLinear)
    assert fast[0].values.device.type == "cpu" and fast[0].bias.device.type == "cpu"
    assert fast[2].values.device.type == "meta" and fast[2].bias.device.type == "meta"


def test_compile_warns_about_planned_layers_it_cannot_replace():
    class Raw(nn.Module):  # the weight is used in a hand-written matmul, not an nn.Linear
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 32))

        def forward(self, x):
            return x @ self.w.T

    model = Raw()
    masks = {"w": _mask24((32, 32), seed=1)}
    plan = TilePlan.from_masks(model, masks, tile=(16, 16))
    with pytest.warns(UserWarning, match=r"1 planned layer\(s\) not replaced.*w \(read by a Raw"):
        fast = compile_fn(model, plan, tune=False)
    torch.testing.assert_close(fast(torch.ones(2, 32)), torch.ones(2, 32) @ plan.layers["w"].to_dense().T)
    with pytest.raises(ValueError, match="not replaced"):
        compile_fn(model, plan, tune=False, strict=True)


def test_backend_matches_plan_names_on_a_sequential():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    plan = _planned(seq, ["0.weight", "2.weight"])
    plan.apply(seq)
    counts = []
    cm = torch.compile(seq, backend="patch", options={"plan": plan, "tune": False,
                                                      "graph_callback": lambda gm, n: counts.append(n)})
    x = torch.randn(4, 32)
    torch.testing.assert_close(cm(x), seq(x))
    assert counts == [2]
    torch._dynamo.reset()


def test_compile_without_a_plan_reads_the_models_zeros(tiny_mlp):
    """A model pruned elsewhere (here: `up` 2:4 by magnitude) is served as it is: no plan needed."""
    with pytest.raises(ValueError, match="no linear weight .* of the TinyMLP holds a 2:4 tile"):
        compile_fn(tiny_mlp, tune=False)
    with torch.no_grad():
        tiny_mlp.up.weight.copy_(prune_24(tiny_mlp.up.weight))
    import patchc.ir.provenance as provenance

    def never(*args):  # a plan read off the model's own zeros has nothing to be checked against
        raise AssertionError("the provenance check ran on a plan made from the same weights")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(provenance, "check_weights", never)
        fast = compile_fn(tiny_mlp, tune=False)
    assert isinstance(fast.up, rt.TileLinear) and type(fast.down) is nn.Linear and type(fast.odd) is nn.Linear
    assert fast.out.weight is fast.embed.weight, "the tied head is no layer to plan"
    ids = torch.randint(0, 32, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids), tiny_mlp(ids), atol=1e-5, rtol=1e-5)
    plan = TilePlan.from_linears(tiny_mlp)
    assert set(plan.layers) == {"up.weight"}
    assert plan.skipped == {"down.weight": "no 2:4 tile", "odd.weight": "K=18 is not a multiple of 4 (no 2:4 groups)"}
