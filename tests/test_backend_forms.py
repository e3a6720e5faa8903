"""torch.compile(backend="patch") on every matmul form the export path masks (issue 14 item 2).

One tiny module reads its weights as `x @ W.T`, `torch.matmul(x, W.t())`, `torch.mm`, GPT-2 Conv1D's
`torch.addmm(b, x, W)` (W stored (K, N)) and a linear-layout einsum; the backend must rewrite all five to
`patchc::tile_linear` and give the plan-applied model's outputs. A weight read as `W @ x` cannot be served:
it is left dense and named in a warning, or refused with strict=True.
"""

from __future__ import annotations

import copy
import gc
import operator

import pytest
import torch
from torch import fx, nn

import patchc.runtime as rt
from patchc.codegen.reference import random_24_mask
from patchc.ir import TilePlan
from patchc.runtime.matmul_reads import find_reads

OP = torch.ops.patchc.tile_linear.default


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


class Holder(nn.Module):
    def __init__(self, *shape: int, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*shape, generator=gen) / 4)


class Forms(nn.Module):
    def __init__(self, left: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.c, self.d = Holder(32, 32, gen=g), Holder(32, 32, gen=g), Holder(32, 32, gen=g)
        self.conv = Holder(32, 48, gen=g)  # Conv1D: (K, N)
        self.conv_bias = nn.Parameter(torch.randn(48, generator=g))
        self.left = left

    def forward(self, x: torch.Tensor):
        y = x @ self.a.weight.T + torch.matmul(x, self.c.weight.t())
        flat = y.reshape(-1, 32)
        z = torch.addmm(self.conv_bias, flat, self.conv.weight)
        z2 = torch.mm(flat, self.a.weight.t())
        z3 = torch.einsum("bsk,nk->bsn", y, self.d.weight)
        if self.left:
            z3 = z3 + (self.d.weight @ y.transpose(1, 2)).transpose(1, 2)  # W @ x: not a tile_linear
        return z, z2, z3


def _plan(model: Forms) -> TilePlan:
    """2:4 everywhere (N, K); the Conv1D weight planned as its transpose and recorded so."""
    g = torch.Generator().manual_seed(1)
    dense = {n: model.get_parameter(n).detach() for n in ("a.weight", "c.weight", "d.weight")}
    dense["conv.weight"] = model.conv.weight.detach().t()
    pruned = {n: w * random_24_mask(*w.shape, g) for n, w in dense.items()}
    plan = TilePlan.from_weights(pruned, tile=(16, 16))
    plan.meta["targets"] = {"conv.weight": {"param": "conv.weight", "expert": None, "transposed": True}}
    return plan


def _compiled(model, options):
    counts = []
    torch._dynamo.reset()
    cm = torch.compile(model, backend=rt.patch_backend,
                       options={"tune": False, "inner": "eager", **options, "graph_callback": lambda gm, n: counts.append(n)})
    return cm, counts


def test_backend_rewrites_every_form_with_a_plan_and_without():
    model = Forms()
    plan = _plan(model)
    assert all(int((lp.kinds == 1).sum()) == lp.kinds.numel() for lp in plan.layers.values())
    pruned = plan.apply(copy.deepcopy(model), force=True)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = pruned(x)
        for options in ({"plan": plan}, {}):  # {}: inferred from the pruned weights' zeros
            cm, counts = _compiled(pruned, options)
            out = cm(x)
            assert counts == [5], options  # linear-form reads of a, c, conv, a (tied), d
            for got, want in zip(out, ref):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class Lora(nn.Module):
    """PEFT's unmerged LoRA: base(x) + lora_B(lora_A(x)), one linear's output the next one's input."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.base = nn.Linear(32, 32)
        self.lora_A, self.lora_B = nn.Linear(32, 16, bias=False), nn.Linear(16, 32, bias=False)
        for lin in (self.base, self.lora_A, self.lora_B):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) / 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


@pytest.mark.parametrize("recorded", ["getattr", "aten"])
def test_a_transpose_attribute_is_a_read_in_either_form_torch_records_it(recorded):
    """dynamo records `W.T` / `W.mT` as getattr up to torch 2.13 and as aten.numpy_T / aten.mT from 2.14 (where
    the test above saw four of five reads): both are reads of a weight stored (N, K)."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    outs = []
    for attr, op in (("T", torch.ops.aten.numpy_T), ("mT", torch.ops.aten.mT)):
        t = graph.call_function(getattr, (w, attr)) if recorded == "getattr" else graph.call_function(op, (w,))
        outs.append(graph.call_function(operator.matmul, (x, t)))
    graph.output(tuple(outs))
    examples = {x: torch.randn(3, 32), w: nn.Parameter(torch.randn(16, 32))}
    reads = find_reads(fx.GraphModule(nn.Module(), graph), examples)
    assert [(r.weight, r.x, r.transposed, r.reason) for r in reads] == [(w, x, False, None)] * 2


def test_chained_linears_with_nothing_between_are_both_served():
    """The second read's x is the first read's result: it must take the rewritten node (before, the rewrite
    referred to the erased one and the graph failed to lint)."""
    model = Lora()
    g = torch.Generator().manual_seed(4)
    plan = TilePlan.from_weights({f"{n}.weight": model.get_parameter(f"{n}.weight").detach() * random_24_mask(
        *model.get_parameter(f"{n}.weight").shape, g) for n in ("base", "lora_A", "lora_B")}, tile=(16, 16))
    pruned = plan.apply(copy.deepcopy(model), force=True)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for options in ({"plan": plan, "strict": True}, {}):
            cm, counts = _compiled(pruned, options)
            torch.testing.assert_close(cm(x), pruned(x), atol=1e-5, rtol=1e-5)
            assert counts == [3], options
    torch._dynamo.reset()


def test_backend_names_layers_it_leaves_dense_and_strict_refuses():
    model = Forms(left=True)
    plan = _plan(model)
    pruned = plan.apply(copy.deepcopy(model), force=True)
    x = torch.randn(2, 3, 32)
    cm, counts = _compiled(pruned, {"plan": plan})
    with pytest.warns(UserWarning, match=r"1 planned layer\(s\) left dense.*d\.weight \(matmul with the weight on the left"):
        out = cm(x)
    assert counts == [4]  # d.weight is read twice, once as W @ x: both reads stay dense
    for got, want in zip(out, pruned(x)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    cm, _ = _compiled(pruned, {"plan": plan, "strict": True})
    with pytest.raises(Exception, match="left dense"):
        cm(x)
    torch._dynamo.reset()


def test_backend_refuses_a_plan_in_the_other_orientation():
    model = Forms()
    plan = _plan(model)
    # a.weight is read as x @ W^T, but the plan says it is stored (K, N)
    plan.meta["targets"]["a.weight"] = {"param": "a.weight", "expert": None, "transposed": True}
    cm, _ = _compiled(model, {"plan": plan, "strict": True})
    with pytest.raises(Exception, match="a.weight.*other orientation"):
        cm(torch.randn(2, 3, 32))
    torch._dynamo.reset()


class Broadcast(nn.Module):
    """A 3-D weight (E, K, N) multiplied by a 2-D x: matmul broadcasts x to every expert, which is not one
    expert's rows each (the bmm that Llama 4 runs is served: tests/test_backend_experts.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_a_3d_weight_read_by_a_broadcasting_matmul_is_named_as_left_dense():
    import warnings

    from patchc.codegen.reference import random_layer_plan

    model = Broadcast()
    layers = {f"w.{e}": random_layer_plan(16, 32, tile=(16, 16), kinds="sparse", seed=e, name=f"w.{e}") for e in (0, 1)}
    plan = TilePlan(layers=layers, meta={"targets": {n: {"param": "w", "expert": e, "transposed": True}
                                                     for e, n in enumerate(layers)}})
    x = torch.randn(5, 32)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"w\.\* \(batched matmul whose input is not \(E=2, T, K\) \(got \(5, 32\)\)"):
        torch.compile(model, backend="patch", options={"plan": plan, "strict": True})(x)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = torch.compile(model, backend="patch", options={"plan": plan})(x)
    torch._dynamo.reset()
    assert any("w.* (batched matmul" in str(w.message) for w in seen)
    torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)



class Scaled(nn.Module):
    """`b.weight` is planned but only its product with a scale reaches the matmul: no plan describes that
    product, so the backend must name b.weight as left dense instead of skipping it without a word. The
    forward's first parameter is not called `self`: the weights' FQNs must still be read."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
        self.scale = nn.Parameter(torch.rand(32, 1, generator=torch.Generator().manual_seed(3)) + 0.5)

    def forward(this, x: torch.Tensor) -> torch.Tensor:  # noqa: N805
        return torch.nn.functional.linear(this.a(x), this.b.weight * this.scale)


def test_a_planned_weight_read_by_no_matmul_form_is_named_as_left_dense():
    model = Scaled()
    g = torch.Generator().manual_seed(1)
    pruned_weights = {n: model.get_parameter(n).detach() * random_24_mask(32, 32, g) for n in ("a.weight", "b.weight")}
    plan = TilePlan.from_weights(pruned_weights, tile=(16, 16))
    pruned = plan.apply(copy.deepcopy(model), force=True)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    cm, counts = _compiled(pruned, {"plan": plan})
    with pytest.warns(UserWarning, match=r"1 planned layer\(s\) left dense.*: b\.weight \(read only by mul,"):
        out = cm(x)
    assert counts == [1]  # a.weight served
    torch.testing.assert_close(out, pruned(x), atol=1e-5, rtol=1e-5)
    cm, _ = _compiled(pruned, {"plan": plan, "strict": True})
    with pytest.raises(Exception, match=r"b\.weight \(read only by mul"):
        cm(x)
    torch._dynamo.reset()


class Norm(nn.Module):
    """A norm whose forward breaks the graph: its graph names its (unplanned) weight just "weight"."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x / x.norm(dim=-1, keepdim=True) * self.weight


class Block(nn.Module):
    """A norm, fc1, then a graph break, then fc2: dynamo traces this forward as its own frame, whose weight
    names are relative to the block ("fc1.weight"), not to the compiled model ("enc.fc1.weight")."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = Norm(), nn.Linear(32, 48), nn.Linear(48, 32)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen) / 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(self.norm(x)))
        torch._dynamo.graph_break()
        return self.fc2(h)


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.enc, self.dec = Block(g), Block(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def _enc_dec_plan(model: nn.Module, seed: int) -> TilePlan:
    g = torch.Generator().manual_seed(seed)
    weights = {n: p.detach() * random_24_mask(*p.shape, g) for n, p in model.named_parameters() if "fc" in n and n.endswith("weight")}
    return TilePlan.from_weights(weights, tile=(16, 16))


@pytest.mark.parametrize("with_plan", [True, False], ids=["plan", "inferred"])
def test_a_graph_reused_for_sibling_submodules_serves_each_with_its_own_weights(with_plan):
    """dynamo compiles Block's two graphs once, for enc, and reuses them for dec, which passes its own weights:
    each block must run on its own packed weights (a graph per set of weights), its relative names
    ("fc1.weight") matched to the planned weight whose kept values it holds (enc.* or dec.*); the norm's graph,
    whose "weight" ends every planned name but fits none, warns of nothing (strict). Compiled with the plan,
    the dense model gives the plan-applied model's outputs; without, the pruned model its own."""
    model = EncDec()
    plan = _enc_dec_plan(model, 1)
    pruned = plan.apply(copy.deepcopy(model))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    cm, counts = _compiled(model, {"plan": plan, "strict": True}) if with_plan else _compiled(pruned, {})
    with torch.no_grad():
        got, again = cm(x), cm(x)
    assert [c for c in counts if c] == [1, 1, 1, 1]  # enc's fc1 and fc2 graphs, then dec's: each compiled once
    torch.testing.assert_close(got, pruned(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, got, atol=0, rtol=0)
    torch._dynamo.reset()


class ViewBlock(Block):
    """Block whose second graph views its input by its own sizes (a shape the compiled graph must keep dynamic)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(self.norm(x)))
        torch._dynamo.graph_break()
        return self.fc2(h.view(*h.shape[:-1], 2, 24).flatten(-2))


@pytest.mark.parametrize("with_plan", [True, False], ids=["plan", "inferred"])
def test_a_sibling_graph_compiled_for_its_own_weights_keeps_dynamic_shapes(with_plan):
    """dec's graphs are compiled again for its weights from the shapes dynamo traced (symbolic here), not from
    the call that met them: compiled from that call's tensors, aot_autograd baked its batch into the view, and
    the next batch size failed (Kolibri 1.1's reindexing layer, decoding one more token a step)."""
    model = EncDec()
    model.enc.__class__ = model.dec.__class__ = ViewBlock
    plan = _enc_dec_plan(model, 1)
    pruned = plan.apply(copy.deepcopy(model))
    torch._dynamo.reset()
    options = {"tune": False, "inner": "aot_eager", **({"plan": plan} if with_plan else {})}
    cm = torch.compile(model if with_plan else pruned, backend=rt.patch_backend, options=options, dynamic=True)
    with torch.no_grad():
        for rows in (3, 5, 2):
            x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(cm(x), pruned(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_a_frame_past_the_recompile_limit_is_named_with_what_it_means_for_the_plan():
    """Past dynamo's recompile limit a frame runs eagerly, where no graph serves its weights: the backend warns."""
    model = nn.Sequential(nn.Linear(32, 32))
    mask = random_24_mask(32, 32, torch.Generator().manual_seed(0))
    plan = TilePlan.from_weights({"0.weight": model[0].weight.detach() * mask}, tile=(16, 16))
    torch._dynamo.reset()
    cm = torch.compile(model, backend=rt.patch_backend, dynamic=False,
                       options={"plan": plan, "tune": False, "inner": "eager"})
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        cm(torch.randn(3, 32))
        with pytest.warns(UserWarning, match=r"hit torch._dynamo.config.recompile_limit for '\w+' .* runs that "
                                             r"frame eagerly .* dense where the plan came in the backend's options"):
            cm(torch.randn(5, 32))
    torch._dynamo.reset()


def test_per_weights_compiles_once_for_each_set_of_weights():
    from patchc.runtime.weight_graphs import PerWeights

    a, b, x = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    built: list[float] = []

    def build(inputs):
        built.append(float(inputs[0][0]))
        return lambda w, y, scale=float(inputs[0][0]): (w, y * scale)

    run = PerWeights(build, [0], ([a, x], lambda w, y: (w, y * 1.0)))
    assert run(a, x)[1].tolist() == [3.0, 3.0] and built == []
    assert run(b, x)[1].tolist() == [0.0, 0.0] and built == [0.0]
    assert run(a, x)[1].tolist() == [3.0, 3.0] and run(b, x)[0] is b and built == [0.0]  # both kept
    c = torch.full((2,), 2.0)
    assert run(c, x)[1].tolist() == [6.0, 6.0] and built == [0.0, 2.0]
    del c  # its graph goes with it (and its id may be reused), also as the last one called
    gc.collect()
    assert len(run.entries) == 2 and run.last is None


def test_a_submodule_name_whose_values_match_no_planned_weight_is_named_as_left_dense():
    """A plan made from other weights: "fc1.weight" ends enc.fc1.weight and dec.fc1.weight (and "weight", read
    in a graph that starts in the Linear itself, every fc), but holds none of their values, so it is not
    guessed; the warning says why."""
    model = EncDec()
    plan = _enc_dec_plan(EncDec().apply(lambda m: [p.data.normal_() for p in m.parameters(recurse=False)]), 1)
    cm, counts = _compiled(model, {"plan": plan, "strict": True})  # not an error: it may be an unplanned weight
    with pytest.warns(UserWarning, match=r"named like planned ones left dense.*'(fc1\.)?weight', a name that ends "
                                         r"planned ones .*none of the planned weights \['(enc|dec)\.fc"):
        with torch.no_grad():
            cm(torch.randn(3, 32))
    assert sum(counts) == 0
    torch._dynamo.reset()
    left = rt.unserved(plan)  # after the run: no planned weight was served, each for that reason
    assert sorted(left) == sorted(plan.layers) and all("none of the planned weights" in why for why in left.values())


def test_a_partial_plan_leaves_like_named_unplanned_weights_to_a_warning_and_serves_its_own():
    """Only enc is planned: dec's graphs read "fc1.weight", which ends enc.fc1.weight but holds none of its
    values. Warned of, not refused under strict; enc is served, so nothing planned is unserved."""
    model = EncDec()
    plan = _enc_dec_plan(model, 1)
    plan.layers = {n: layer for n, layer in plan.layers.items() if n.startswith("enc.")}
    pruned = plan.apply(copy.deepcopy(model))
    cm, counts = _compiled(model, {"plan": plan, "strict": True})
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match=r"named like planned ones"), torch.no_grad():
        torch.testing.assert_close(cm(x), pruned(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    assert [c for c in counts if c] == [1, 1] and rt.unserved(plan) == {}


def test_a_plan_made_on_a_submodule_is_served_by_the_backend_and_named_by_patchc_compile():
    """The plan names two linears from the MLP that holds them; the compiled model holds that MLP as `body`, so
    its graph reads "body.fc1.weight", which ends with a planned name: matched by its values and served.
    patchc.compile refuses such a plan, naming the submodule and the call that compiles it."""
    import patchc

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(6)
            self.body = nn.Sequential()
            self.body.fc1, self.body.act, self.body.fc2 = nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    model = Wrapper()
    plan = _enc_dec_plan(model.body, 1)
    pruned = copy.deepcopy(model)
    pruned.body = plan.apply(pruned.body)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    cm, counts = _compiled(model, {"plan": plan, "strict": True})
    with torch.no_grad():
        torch.testing.assert_close(cm(x), pruned(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    assert counts == [2] and rt.unserved(plan) == {}
    with pytest.raises(patchc.PlanError, match=r"layer fc1\.weight: .*'body\.fc1\.weight' ends with it: the plan "
                                               r"names layers from submodule 'body' \(compile that: "
                                               r"model\.body = patchc\.compile\(model\.body, plan\)"):
        patchc.compile(model, plan, tune=False)
    with pytest.raises(patchc.PlanError, match=r"from submodule '0' \(compile that: patchc\.compile\(model\."
                                               r"get_submodule\('0'\), plan\)"):  # not an attribute path
        patchc.compile(nn.Sequential(model.body), plan, tune=False)
    other = Wrapper()  # same names, other shapes: a plan of another model is not told to compile a submodule
    other.body.fc1, other.body.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
    with pytest.raises(patchc.PlanError, match=r"layer fc1\.weight: the model has no parameter 'fc1\.weight' "
                                               r"\(nor an expert slice of that name\)$"):
        patchc.compile(other, plan, tune=False)
    model.body = patchc.compile(model.body, plan, tune=False)  # what the message says to do
    with torch.no_grad():
        torch.testing.assert_close(model(x), pruned(x), atol=1e-5, rtol=1e-5)


def test_source_root_is_the_frame_local_a_weight_comes_from():
    from patchc.runtime.graph_names import source_root

    assert source_root("L['self']._modules['a']._parameters['weight']") == "L['self']"
    assert source_root("L['args'][0]._modules['model']") == "L['args'][0]"  # a decorated forward's module
    assert source_root("G['table']") is None and source_root(None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the Triton kernels and inductor run there")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_sibling_graphs_on_gpu_match_an_independent_dense_model(mode, monkeypatch):
    """fp16 on CUDA under inductor: enc's graphs reused for dec run dec's own packed weights (one inductor graph
    per set of weights, CUDA graphs included), against the plan-applied model's F.linear."""
    monkeypatch.delenv("PATCHC_CPU_IMPL", raising=False)
    model = EncDec()
    plan = _enc_dec_plan(model, 1)
    reference = plan.apply(copy.deepcopy(model)).to("cuda", torch.float16)
    dense = copy.deepcopy(model).to("cuda", torch.float16)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)).to("cuda", torch.float16)
    counts = []
    torch._dynamo.reset()
    cm = torch.compile(dense, backend="patch", options={"plan": plan, "strict": True, "tune": False, "mode": mode,
                                                        "graph_callback": lambda gm, n: counts.append(n)})
    with torch.no_grad():
        for _ in range(3):  # reduce-overhead records on the second call and replays after
            got = cm(x).clone()
        want = reference(x)
    torch._dynamo.reset()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert [c for c in counts if c] == [1, 1, 1, 1]


def test_parameter_names_matches_relative_names_by_shape_and_kept_values():
    """A Conv1D-style square weight stored (K, N) is matched in either orientation; a norm's "weight" fits no
    planned shape and stays as it is; a name the plan has is kept."""
    from patchc.runtime.graph_names import parameter_names

    g = torch.Generator().manual_seed(4)
    pruned = {f"{m}.conv.weight": torch.randn(32, 32, generator=g) * random_24_mask(32, 32, g) for m in "ab"}
    plan = TilePlan.from_weights(pruned, tile=(16, 16))
    params = {"conv": nn.Parameter(pruned["b.conv.weight"].t().clone()), "norm": nn.Parameter(torch.ones(32)),
              "full": nn.Parameter(pruned["a.conv.weight"].clone())}
    fqns = {"conv": "conv.weight", "norm": "weight", "full": "a.conv.weight"}
    names, unmatched = parameter_names(params, plan, fqns)
    assert names == {"conv": "b.conv.weight", "norm": "weight", "full": "a.conv.weight"} and unmatched == {}
    params["conv"] = nn.Parameter(torch.randn(32, 32, generator=g))  # other values: not guessed
    names, unmatched = parameter_names(params, plan, fqns)
    assert names["conv"] == "conv.weight" and "none of the planned weights" in unmatched["conv.weight"][0]
    assert sorted(unmatched["conv.weight"][1]) == ["a.conv.weight", "b.conv.weight"]
    # a graph rooted above the plan's root (a plan made on a submodule), and one inside a LoRA layer
    params = {"above": nn.Parameter(pruned["a.conv.weight"].clone()),
              "lora": nn.Parameter(pruned["b.conv.weight"].clone())}
    names, unmatched = parameter_names(params, plan, {"above": "model.a.conv.weight", "lora": "base_layer.weight"})
    assert names == {"above": "a.conv.weight", "lora": "b.conv.weight"} and unmatched == {}
