"""torch.compile(backend="patch") on fused MoE experts: grouped matmuls become `patchc::tile_grouped_mm`.

transformers 5 multiplies fused experts as one grouped mm (F.grouped_mm in bf16, its own
`transformers::grouped_mm_fallback` op otherwise). The op is checked against an independent fp64 loop
over the experts; the backend on real MoE families compiles the *dense* model with a plan, so only a
served plan can give the plan-applied model's outputs.
"""

from __future__ import annotations

import copy
import operator
import re

import pytest
import torch

import patchc
from patchc.codegen.reference import random_layer_plan
from patchc.config import PatchConfig
from patchc.runtime.grouped import planned_experts
from patchc.runtime.grouped_op import TileGroupedLinear

GROUPED = torch.ops.patchc.tile_grouped_mm.default
E, N, K = 4, 48, 64


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


def _experts(dtype=torch.float32):
    """Slices (E, N, K) and their TileGroupedLinear: experts 0, 2, 3 planned, expert 1 not (its weight dense)."""
    layers = {e: random_layer_plan(N, K, tile=(16, 16), kinds="mixed", seed=e, name=f"w.{e}") for e in (0, 2, 3)}
    slices = torch.randn(E, N, K, generator=torch.Generator().manual_seed(9))
    for e, layer in layers.items():
        slices[e] = layer.to_dense()
    plan = patchc.TilePlan(layers={layer.name: layer for layer in layers.values()})
    return slices.to(dtype), TileGroupedLinear.from_plan(plan, "w", slices.to(dtype), dtype=dtype)


def _loop(rows: torch.Tensor, slices: torch.Tensor, offs: torch.Tensor, transpose: bool = True) -> torch.Tensor:
    """fp64: each expert's rows times its slice (transposed for the forward, as is for the input gradient)."""
    out, start = torch.zeros(rows.shape[0], slices.shape[1 if transpose else 2], dtype=torch.float64), 0
    for e, end in enumerate(offs.tolist()):
        w = slices[e].double()
        out[start:end] = rows[start:end].double() @ (w.T if transpose else w)
        start = end
    return out


@pytest.mark.parametrize("counts", [(3, 0, 5, 1), (0, 7, 0, 0), (1, 1, 1, 1)])
def test_grouped_op_equals_a_float64_loop_over_the_experts(counts):
    slices, mod = _experts()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]), K, generator=torch.Generator().manual_seed(1))
    got = GROUPED(x, offs, *mod.op_args())
    torch.testing.assert_close(got.double(), _loop(x, slices, offs), atol=1e-4, rtol=1e-5)  # fp32 over K = 64
    assert got.shape == (x.shape[0], N)


def test_gradients_reach_the_tokens_of_every_expert():
    slices, mod = _experts()
    offs = torch.tensor([3, 5, 5, 9], dtype=torch.int32)
    x = torch.randn(9, K, requires_grad=True)
    y = GROUPED(x, offs, *mod.op_args())
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad.double(), _loop(g, slices, offs, transpose=False), atol=1e-4, rtol=1e-5)
    torch.library.opcheck(GROUPED, (x.detach().requires_grad_(), offs, *mod.op_args()))


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_a_compiled_moe_called_with_gradients_on_backpropagates_like_the_pruned_model(family):
    """Without torch.no_grad, aot_autograd traces the backward too: it must go through both ops (Llama 4: and
    the bmm's flatten / view) and give the embedding the pruned eager model's gradient (every other weight
    frozen in both)."""
    case, plan = _family_plan(family)
    served, pruned = copy.deepcopy(case.model), plan.apply(copy.deepcopy(case.model))
    for model in (served, pruned):
        for name, p in model.named_parameters():
            p.requires_grad_("embed_tokens" in name)
    torch._dynamo.reset()
    graphs = []
    cm = torch.compile(served, backend="patch", options={"plan": plan, "strict": True, "tune": False,
                                                         "graph_callback": lambda gm, n: graphs.append(gm)})
    for model in (cm, pruned):
        (model(case.ids, use_cache=False).logits ** 2).mean().backward()
    torch._dynamo.reset()
    got, want = served.model.embed_tokens.weight.grad, pruned.model.embed_tokens.weight.grad
    assert want.abs().sum() > 0 and sum(n.target is GROUPED for gm in graphs for n in gm.graph.nodes) == 2
    # with gradients on, Llama 4's bmms keep every row in place: a zero row's input gradient is not zero
    assert not any(n.target is torch.argsort for gm in graphs for n in gm.graph.nodes)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_grouped_op_passes_opcheck_and_names_bad_shapes():
    _, mod = _experts()
    offs = torch.tensor([2, 2, 4, 5], dtype=torch.int32)
    x = torch.randn(5, K)
    torch.library.opcheck(GROUPED, (x, offs, *mod.op_args()))
    with pytest.raises(ValueError, match=r"'w'.*offs must be the \(4,\) integer row ends.*\(3,\)"):
        GROUPED(x, offs[:3], *mod.op_args())
    with pytest.raises(ValueError, match=r"'w'.*x must be \(S, K=64\), got \(5, 63\)"):
        GROUPED(torch.randn(5, K - 1), offs, *mod.op_args())
    with pytest.raises(ValueError, match=r"w\.2: planned as \(48, 64\) \(N, K\) but the weight's slices are \(64, 48\)"):
        TileGroupedLinear.from_plan(patchc.TilePlan(layers={"w.2": random_layer_plan(N, K, name="w.2")}), "w",
                                    torch.zeros(E, K, N))


def _sparse_experts(node) -> list[int]:
    """The experts with 2:4 blocks in a tile_grouped_mm node's stacked buffers (read from the graph)."""
    rowptr = node.args[7].meta["val"]  # sparse_rowptr of E * RB block rows
    rows = (rowptr.numel() - 1) // node.args[11]
    return [e for e in range(node.args[11]) if int(rowptr[(e + 1) * rows] - rowptr[e * rows]) > 0]


def _family_plan(name: str):
    from tests.test_families import TILE, exported

    case, ep = exported(name)
    return case, patchc.harden(patchc.transform(ep, PatchConfig(tile=TILE, sparsity=0.35, init_std=0.5)))


@pytest.mark.parametrize("family,dtype,impl", [
    ("qwen3_moe", torch.float32, None), ("qwen3_moe", torch.bfloat16, None), ("gpt_oss", torch.float32, None),
    ("llama4", torch.float32, None), ("llama4", torch.bfloat16, None), ("qwen3_moe", torch.float32, "batched_mm"),
    ("qwen3_moe", torch.bfloat16, "batched_mm"), ("gpt_oss", torch.float32, "batched_mm")])
def test_backend_serves_every_planned_expert_slice(family, dtype, impl):
    """fp32: transformers' own grouped op; bf16: torch._grouped_mm (dynamo's form of F.grouped_mm); gpt-oss:
    experts stored (E, K, N), with biases; Llama 4: one bmm over every expert, weights stored (E, K, N);
    batched_mm: a bmm of each token's gathered weight W[ids]. The dense model is compiled with the plan: only
    served slices give the plan-applied outputs."""
    case, plan = _family_plan(family)
    dense = copy.deepcopy(case.model).to(dtype)
    pruned = plan.apply(copy.deepcopy(case.model)).to(dtype)
    if impl is not None:
        dense.set_experts_implementation(impl)
    graphs = []
    torch._dynamo.reset()
    cm = torch.compile(dense, backend="patch", options={"plan": plan, "strict": True, "tune": False,
                                                        "graph_callback": lambda gm, n: graphs.append(gm)})
    with torch.no_grad():
        got, want, before = case.run(cm), case.run(pruned), case.run(dense)
    torch._dynamo.reset()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert not torch.allclose(before.float(), want.float(), **tol)  # the plan changes the outputs
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    assert sum(n.target is GROUPED for n in nodes) == 2  # gate_up_proj and down_proj of the one block
    assert not any("grouped_mm" in str(n.target) and n.target is not GROUPED for n in nodes)
    assert not any(n.target in (torch.bmm, "bmm") for n in nodes)  # nor a per-token gather of the experts
    assert not any(n.target is operator.getitem and n.args[0].op == "placeholder" and n.args[0].name.endswith("proj_")
                   for n in nodes)  # (gpt-oss's biases are still gathered per token: (S, N) rows, not matrices)
    if impl == "batched_mm":  # gate_up_proj and down_proj share the routing: its rows are sorted once
        assert sum(n.target is torch.argsort for n in nodes) == 1
    if family == "llama4":  # no gradient taken: each bmm sorts the rows not all zero (the experts picked) first
        assert sum(n.target is torch.argsort for n in nodes) == 2
    served = {n.args[9]: _sparse_experts(n) for n in nodes if n.target is GROUPED}
    for fqn, experts in served.items():  # every planned slice with a 2:4 tile, and only those
        assert experts == [e for e in range(64) if (layer := plan.layers.get(f"{fqn}.{e}")) is not None
                           and bool((layer.kinds == 1).any())]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_backend_refuses_experts_of_other_weights_naming_the_slice(family):
    """The grouped reads are checked as the 2-D ones are: an expert whose weights are not the plan's source
    was served with the plan's values beside the other model's own. gpt-oss stores its experts (E, K, N)."""
    case, plan = _family_plan(family)
    pruned = plan.apply(copy.deepcopy(case.model))
    other = copy.deepcopy(case.model)
    fqn, e = next((name.rpartition(".")[0], int(name.rpartition(".")[2])) for name in plan.meta["targets"]
                  if plan.meta["targets"][name]["expert"] is not None and plan.layers[name].n_sparse)
    with torch.no_grad():
        other.get_parameter(fqn)[e].mul_(1.01)  # one expert slice of one fused weight
    options = {"plan": plan, "strict": True, "tune": False}
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match=rf"patch backend: layer {re.escape(fqn)}\.{e}: .*the plan "
                                                        r"was made for other weights"):
        case.run(torch.compile(other, backend="patch", options=options))
    torch._dynamo.reset()
    with torch.no_grad():  # its own weights pass, applied or not; force serves the plan's anyway
        want = case.run(pruned)
        for model in (case.model, pruned):
            torch.testing.assert_close(case.run(torch.compile(model, backend="patch", options=options)), want,
                                       atol=1e-5, rtol=1e-5)
            torch._dynamo.reset()
        forced = case.run(torch.compile(other, backend="patch", options={**options, "force": True}))
    torch._dynamo.reset()
    assert forced.shape == want.shape


def test_llama4_bmm_serves_new_lengths_from_the_dynamic_graph(monkeypatch):
    """The bmm's row ends (T, 2T, ...) are built from x's size in the graph: the dynamic graphs dynamo makes
    after the first shapes serve new batch sizes and lengths, and stay the plan-applied model's. Every graph
    shares the first one's packed experts (`patchc.runtime.packs`), and runs the rows of the picked experts
    only (no gradient taken)."""
    import patchc.runtime.backend as backend
    from patchc.runtime import grouped_op

    case, plan = _family_plan("llama4")
    dense, pruned = copy.deepcopy(case.model), plan.apply(copy.deepcopy(case.model))
    graphs, packed, build = [], [], backend.expert_modules
    monkeypatch.setattr(backend, "expert_modules", lambda *a, **k: packed.append(build(*a, **k)) or packed[-1])
    ends, segments = [], grouped_op._segments
    monkeypatch.setattr(grouped_op, "_segments", lambda offs, rows: ends.append((int(offs[-1]), rows)) or
                        segments(offs, rows))
    torch._dynamo.reset()
    cm = torch.compile(dense, backend="patch", options={"plan": plan, "strict": True, "tune": False,
                                                        "graph_callback": lambda gm, n: graphs.append(gm)})
    shapes = [(2, 9), (1, 5), (3, 7), (2, 1), (2, 4), (3, 3)]
    compiled = []
    with torch.no_grad():
        for batch, length in shapes:
            ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(length))
            ends.clear()
            got, want = cm(ids, use_cache=False).logits, pruned(ids, use_cache=False).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"batch {batch}, length {length}")
            compiled.append(len(graphs))
            tokens = batch * length  # top-1 of 4 experts: a token's row for each other expert is zero, not run
            assert ends == [(tokens, 4 * tokens)] * 2, f"batch {batch}, length {length}"
    torch._dynamo.reset()
    assert compiled[-1] == compiled[-3]  # the last two shapes ran on an earlier (dynamic) graph
    assert all(sum(n.target is GROUPED for n in gm.graph.nodes) == 2 for gm in graphs)
    assert len(packed) == len(graphs) >= 2
    assert len({id(mod) for modules in packed for _, mod in modules.values()}) == 2  # packed once, not per graph


class _Gathered(torch.nn.Module):
    """transformers' batched_mm in miniature: row s of x times expert ids[s]'s slice, W gathered per row."""

    def __init__(self, slices: torch.Tensor, read: str = "bmm") -> None:
        super().__init__()
        self.w, self.read = torch.nn.Parameter(slices.clone()), read

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.read == "einsum":
            return torch.einsum("sk,snk->sn", x, self.w[ids])
        if self.read == "two columns":
            return torch.bmm(self.w[ids], torch.stack([x, 2 * x], dim=-1)).sum(-1)
        return torch.bmm(self.w[ids], x.unsqueeze(-1)).squeeze(-1)


def _gathered_plan():
    layers = {e: random_layer_plan(N, K, tile=(16, 16), kinds="mixed", seed=e, name=f"w.{e}") for e in (0, 2, 3)}
    slices = torch.randn(E, N, K, generator=torch.Generator().manual_seed(9))
    for e, layer in layers.items():
        slices[e] = layer.to_dense()
    return slices, patchc.TilePlan(layers={layer.name: layer for layer in layers.values()})


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("ids", [[2, 0, 3, 3, 0, 2, 2], [1, 1, 1], [3]])
def test_weights_gathered_per_row_are_served_sorted_by_expert(ids, impl, monkeypatch):
    """W[ids] per row becomes one grouped mm over the rows sorted by expert (experts with no row, a row of an
    unplanned expert, one row), put back in order: equal to an fp64 loop over the rows, through the op's
    reference and through the grouped Triton kernels (interpreted)."""
    monkeypatch.setenv("PATCHC_CPU_IMPL", impl)
    slices, plan = _gathered_plan()
    ids = torch.tensor(ids)
    x = torch.randn(len(ids), K, generator=torch.Generator().manual_seed(1))
    graphs = []
    torch._dynamo.reset()
    cm = torch.compile(_Gathered(slices), backend="patch", options={"plan": plan, "strict": True, "tune": False,
                                                                    "graph_callback": lambda gm, n: graphs.append(gm)})
    with torch.no_grad():
        got = cm(x, ids)
    torch._dynamo.reset()
    want = torch.stack([slices[e].double() @ row.double() for row, e in zip(x, ids.tolist())])
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)  # fp32 over K = 64
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    assert sum(n.target is GROUPED for n in nodes) == 1 and not any(n.target is torch.bmm for n in nodes)


@pytest.mark.parametrize("read,why", [
    ("einsum", r"w\.\* \(fused expert slices \(3-D weight\) gathered per token \(W\[ids\]\) and multiplied other "
               r"than by a bmm: call model\.set_experts_implementation"),
    ("two columns", r"w\.\* \(per-token gathered experts \(W\[ids\]\) whose input is not \(S, 64, 1\) "
                    r"\(got \(3, 64, 2\)\)")])
def test_weights_gathered_per_row_in_other_forms_are_named_with_the_reason(read, why):
    slices, plan = _gathered_plan()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=why):
        with torch.no_grad():
            torch.compile(_Gathered(slices, read), backend="patch",
                          options={"plan": plan, "strict": True})(torch.randn(3, K), torch.tensor([0, 2, 3]))
    torch._dynamo.reset()


def test_generate_through_batched_mm_experts_gives_the_pruned_models_tokens():
    """generate() compiles the prompt, the first step and a graph dynamic in the length: the sorted rows of
    every one serve the planned experts (no gather left) and greedy decoding keeps the pruned model's tokens."""
    case, plan = _family_plan("qwen3_moe")
    model, pruned = copy.deepcopy(case.model), plan.apply(copy.deepcopy(case.model))
    model.set_experts_implementation("batched_mm")
    graphs = []
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="patch", options={
        "plan": plan, "strict": True, "tune": False, "graph_callback": lambda gm, n: graphs.append(gm)})
    with torch.no_grad():
        got = model.generate(case.ids[:1, :5], max_new_tokens=8, do_sample=False)
        want = pruned.generate(case.ids[:1, :5], max_new_tokens=8, do_sample=False)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    assert len(graphs) >= 2 and all(sum(n.target is GROUPED for n in gm.graph.nodes) == 2 for gm in graphs)


def test_a_plan_in_the_other_orientation_is_left_dense_with_the_reason():
    case, plan = _family_plan("qwen3_moe")
    for name, target in plan.meta["targets"].items():
        if target.get("expert") is not None:
            target["transposed"] = not target.get("transposed")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"gate_up_proj\.\* \(read as \(E, N, K\) transposed.*other orientation"):
        with torch.no_grad():
            case.run(torch.compile(copy.deepcopy(case.model), backend="patch", options={"plan": plan, "strict": True}))
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the experts' kernels and inductor run there")
@pytest.mark.parametrize("family,impl", [("qwen3_moe", None), ("llama4", None), ("qwen3_moe", "batched_mm")])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_backend_experts_on_gpu_match_an_independent_dense_model(mode, family, impl):
    """bf16 on CUDA: transformers takes torch._grouped_mm (Llama 4: bmm; batched_mm: a bmm of gathered
    weights); every expert runs in one grouped Triton launch, and reduce-overhead captures it in its CUDA
    graphs (the kernels read the offsets on the device, batched_mm's rows are sorted there)."""
    case, plan = _family_plan(family)
    reference = plan.apply(copy.deepcopy(case.model)).to("cuda", torch.bfloat16)  # dense F.linear / grouped_mm
    dense = copy.deepcopy(case.model).to("cuda", torch.bfloat16)
    if impl is not None:
        dense.set_experts_implementation(impl)
    graphs = []
    torch._dynamo.reset()
    cm = torch.compile(dense, backend="patch", options={"plan": plan, "strict": True, "tune": False, "mode": mode,
                                                        "graph_callback": lambda gm, n: graphs.append(gm)})
    ids = case.ids.to("cuda")
    with torch.no_grad():
        for _ in range(3):  # reduce-overhead records on the second call and replays after
            got = cm(ids, use_cache=False).logits.clone()
        want = reference(ids, use_cache=False).logits
    torch._dynamo.reset()
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert sum(n.target is GROUPED for gm in graphs for n in gm.graph.nodes) == 2


@pytest.mark.parametrize("family,impl", [("qwen3_moe", None), ("llama4", None), ("gpt_oss", "batched_mm")])
def test_without_a_plan_the_zeros_of_the_pruned_experts_are_the_plan(family, impl):
    """A pruned model compiled without a plan: each expert slice is planned from its zeros (Llama 4's and
    gpt-oss's as the transposes their bmm multiplies by), so the slices the plan made 2:4 are served again, and
    the outputs stay the pruned model's."""
    case, plan = _family_plan(family)
    pruned = plan.apply(copy.deepcopy(case.model))
    if impl is not None:
        pruned.set_experts_implementation(impl)
    graphs = []
    torch._dynamo.reset()
    cm = torch.compile(pruned, backend="patch", options={"tune": False, "graph_callback": lambda gm, n: graphs.append(gm)})
    with torch.no_grad():
        torch.testing.assert_close(case.run(cm), case.run(pruned), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    served = {n.args[9]: _sparse_experts(n) for gm in graphs for n in gm.graph.nodes if n.target is GROUPED}
    assert len(served) == 2
    for fqn, experts in served.items():
        assert experts == [e for e in range(64) if (layer := plan.layers.get(f"{fqn}.{e}")) is not None
                           and bool((layer.kinds == 1).any())]


@pytest.mark.parametrize("family", ["llama4", "gpt_oss"])
def test_a_plan_read_off_the_pruned_model_is_served_with_its_experts_orientation(family):
    """`TilePlan.from_linears` (what `patchc import` and `patchc.compile(model)` plan with) records the expert
    slices of weights stored (E, K, N) as the job's plans do, so the backend serves them under strict=True: it
    refused them as read in the other orientation before."""
    from tests.test_families import TILE

    case, plan = _family_plan(family)
    pruned = plan.apply(copy.deepcopy(case.model))
    inferred = patchc.TilePlan.from_linears(pruned, tile=TILE)
    assert inferred.meta["targets"] == {name: entry for name, entry in plan.meta["targets"].items()
                                        if name in inferred.layers}
    torch._dynamo.reset()
    cm = torch.compile(copy.deepcopy(case.model), backend="patch",
                       options={"plan": inferred, "strict": True, "tune": False})
    with torch.no_grad():
        torch.testing.assert_close(case.run(cm), case.run(pruned), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_the_backend_tunes_every_fused_weight_in_one_tuner_call(monkeypatch):
    """One tuner call (one cache read) covers the first planned slice of every served 3-D weight."""
    import importlib

    compile_mod = importlib.import_module("patchc.runtime.compile")  # the package's `compile` is the function
    case, plan = _family_plan("qwen3_moe")
    calls, real = [], compile_mod._tunings
    monkeypatch.setattr(compile_mod, "_tunings", lambda p, names, *a: calls.append(list(names)) or real(p, names, *a))
    torch._dynamo.reset()
    cm = torch.compile(copy.deepcopy(case.model), backend="patch", options={"plan": plan, "strict": True, "tune": False})
    with torch.no_grad():
        case.run(cm)
    torch._dynamo.reset()
    expert_calls = [names for names in calls if any(n.rpartition(".")[2].isdigit() for n in names)]
    assert len(expert_calls) == 1 and len(expert_calls[0]) == 2  # gate_up_proj and down_proj of the one block
    for name in expert_calls[0]:  # each weight's first expert slice with a 2:4 tile
        fqn, _, expert = name.rpartition(".")
        assert int(expert) == planned_experts(plan, fqn, 64)[0]
