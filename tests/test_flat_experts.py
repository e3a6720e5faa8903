"""DBRX's flat experts served: `patchc.compile` cuts each flat plan per expert (`TileFlatExperts`), and the
compiled model gives what the pruned model gives when its own loop runs over the plan's W * M: on the CPU
fallback, through the grouped kernels in the Triton interpreter, saved and loaded back by transformers."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import patchc
from patchc.codegen.reference import random_24_mask, random_kinds
from patchc.ir import LayerPlan
from patchc.runtime.flat_experts import TileFlatExperts

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.dbrx.modeling_dbrx")

from tests.test_dbrx import EXPERTS, FFN, HIDDEN, _ids, _model  # noqa: E402

FLAT = ("w1", "v1", "w2")


def _plan(model: torch.nn.Module, tiles: dict[str, tuple[int, int]] | None = None, skip: tuple[str, ...] = ()):
    """A random hybrid plan of every flat expert weight of every block (w2 as its (H, E * F) transpose), from the
    model's own weights; `tiles` per weight (default 16 x 16), `skip`: weights left unplanned."""
    layers = {}
    for b, block in enumerate(model.transformer.blocks):
        for w in FLAT:
            if w in skip:
                continue
            name, tile = f"transformer.blocks.{b}.ffn.experts.mlp.{w}", (tiles or {}).get(w, (16, 16))
            weight = getattr(block.ffn.experts.mlp, w).detach()
            weight = weight.t() if w == "w2" else weight
            gen = torch.Generator().manual_seed(len(layers))
            n, k = weight.shape
            kinds = random_kinds(-(-n // tile[0]), -(-k // tile[1]), "mixed", gen)
            dense = (kinds == 0).repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:n, :k]
            layers[name] = LayerPlan.from_mask(name, weight, kinds, dense | random_24_mask(n, k, gen), tile=tile)
    return patchc.TilePlan(layers=layers)


def _compile(model, plan, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every planned flat weight is served: nothing to warn about
        return patchc.compile(model, plan, tune=False, **kw)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_compiled_dbrx_runs_its_experts_from_the_plan_as_the_pruned_model_does(dtype, tol, monkeypatch):
    """CPU fallback: each block's experts module is a TileFlatExperts holding no flat weight, its logits are the
    pruned model's, and its dense state dict holds the pruned flat weights exactly, in their stored layout."""
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    model = _model().to(dtype)
    plan = _plan(model)
    pruned = plan.apply(copy.deepcopy(model))
    fast = _compile(model, plan)
    for block in fast.transformer.blocks:
        assert type(block.ffn.experts) is TileFlatExperts and not hasattr(block.ffn.experts, "mlp")
    ids = _ids(2, 12)
    want = _logits(pruned, ids)
    assert (want - _logits(model, ids)).abs().max() > 0.05  # the plan prunes what the experts compute
    torch.testing.assert_close(_logits(fast, ids), want, atol=tol, rtol=tol)
    state, expected = patchc.runtime.saving.dense_state_dict(fast), pruned.state_dict()
    assert set(state) == set(expected)
    for b in range(2):
        for w in FLAT:
            name = f"transformer.blocks.{b}.ffn.experts.mlp.{w}"
            assert state[name].shape == (EXPERTS * FFN, HIDDEN) and torch.equal(state[name], expected[name]), name


def test_the_grouped_kernels_serve_every_expert_in_one_launch_per_projection(monkeypatch):
    """The GPU path in the Triton interpreter: gate and up rows run as one projection, then down, for each block;
    greedy generation gives the pruned model's tokens."""
    from tests.test_experts_runtime import _spy_grouped

    model = _model()
    plan = _plan(model)
    pruned = plan.apply(copy.deepcopy(model))
    fast = _compile(model, plan)
    launched = _spy_grouped(monkeypatch)
    ids = _ids(2, 6)
    got = _logits(fast, ids)
    projections = ("gate_up_proj", "down_proj")
    assert launched == [f"transformer.blocks.{b}.ffn.experts.{p}" for b in range(2) for p in projections]
    torch.testing.assert_close(got, _logits(pruned, ids), atol=1e-4, rtol=1e-4)
    launched.clear()
    # warmup reads DBRX's top_k from its ffn_config (else it asks for one): a launch per projection and block
    assert patchc.runtime.warmup(fast, [2]) == 2 and len(launched) == 4
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)  # the KV-cache decode steps: one token each
    assert torch.equal(fast.generate(ids, **kw), pruned.generate(ids, **kw))



def test_the_served_experts_trace_as_one_graph_without_host_syncs(monkeypatch):
    """On the grouped kernels' path (the GPU's; interpreted here) dynamo captures a TileFlatExperts whole, with
    no graph break (no host read of the routing: what a CUDA graph of decode needs), and the compiled model
    gives the pruned model's logits."""
    from tests.test_experts_runtime import _spy_grouped

    _spy_grouped(monkeypatch)
    model = _model()
    plan = _plan(model)
    fast = _compile(model, plan)
    gen = torch.Generator().manual_seed(4)
    args = (torch.randn(2, 6, HIDDEN, generator=gen), torch.randint(0, EXPERTS, (12, 2), generator=gen),
            torch.rand(12, 2, generator=gen))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fast.transformer.blocks[0].ffn.experts)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    ids = _ids(2, 6)
    compiled = torch.compile(fast, backend="aot_eager")
    torch.testing.assert_close(_logits(compiled, ids), _logits(plan.apply(copy.deepcopy(model)), ids),
                               atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()

def test_an_unplanned_flat_weight_is_served_as_it_is_and_saved_models_load_back(tmp_path, monkeypatch):
    """v1 without a plan joins w1's rows unpruned; the saved compiled model loads in transformers as the
    pruned model."""
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    model = _model()
    plan = _plan(model, skip=("v1",))
    pruned = plan.apply(copy.deepcopy(model))
    fast = _compile(model, plan)
    assert all(type(b.ffn.experts) is TileFlatExperts for b in fast.transformer.blocks)
    ids = _ids(1, 10)
    torch.testing.assert_close(_logits(fast, ids), _logits(pruned, ids), atol=1e-5, rtol=1e-5)
    fast.save_pretrained(tmp_path / "saved")
    loaded = transformers.DbrxForCausalLM.from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(_logits(loaded, ids), _logits(pruned, ids), atol=1e-6, rtol=1e-6)


def test_experts_in_their_traced_form_are_still_called_as_dbrx_calls_them(monkeypatch):
    """With the experts' class running patchc's traced form (`traceable_layers(every_instance=True)`, as the
    family sweep runs DBRX throughout), their forward still has DBRX's call form, so they are served."""
    from patchc.models.traceable import traceable_layers

    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    model = _model()
    plan = _plan(model)
    with traceable_layers(model, every_instance=True):
        fast = _compile(model, plan)
        assert all(type(b.ffn.experts) is TileFlatExperts for b in fast.transformer.blocks)
        ids = _ids(1, 8)
        torch.testing.assert_close(_logits(fast, ids), _logits(plan.apply(copy.deepcopy(model)), ids),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("tiles", "why"), [
    ({"w1": (64, 16), "v1": (64, 16)}, r"its 32 rows per expert are not whole tiles of its plans \(w1 / v1 tile "
                                        r"\(64, 16\), w2 \(16, 16\)\)"),
    ({"w2": (16, 64)}, r"its 32 rows per expert are not whole tiles of its plans \(w1 / v1 tile \(16, 16\), "
                       r"w2 \(16, 64\)\)"),
    ({"v1": (32, 16)}, r"its w1 and v1 are planned with different tiles \(16, 16\) and \(32, 16\)"),
])
def test_flat_experts_that_cannot_be_cut_per_expert_keep_the_plans_values_and_are_named(tiles, why, monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    model = _model()
    plan = _plan(model, tiles)
    with pytest.warns(UserWarning, match=r"6 planned layer\(s\) not replaced .*transformer\.blocks\.0\.ffn\.experts"
                                         r"\.mlp\.w1 \(" + why):
        fast = patchc.compile(model, plan, tune=False)
    assert all(type(b.ffn.experts).__name__ == "DbrxExperts" for b in fast.transformer.blocks)
    ids = _ids(1, 8)
    torch.testing.assert_close(_logits(fast, ids), _logits(plan.apply(copy.deepcopy(model)), ids))
    with pytest.raises(ValueError, match=why):
        patchc.compile(model, plan, tune=False, strict=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the grouped kernels run there")
def test_dbrx_experts_on_a_gpu_give_the_pruned_models_logits():
    """fp16 on CUDA with the architecture's default configs: no dense copy of the experts is kept; the pruned
    model, running its own loop over the plan's W * M, is the reference."""
    model = _model()
    plan = _plan(model)
    pruned = plan.apply(copy.deepcopy(model)).cuda().half()
    fast = _compile(model.cuda().half(), plan)
    experts = [b.ffn.experts for b in fast.transformer.blocks]
    assert all(type(e) is TileFlatExperts and e.gate_up_proj_dense is None and e.down_proj_dense is None
               for e in experts)
    for length in (1, 16):  # decode and prefill rows
        ids = _ids(2, length).cuda()
        torch.testing.assert_close(_logits(fast, ids), _logits(pruned, ids), atol=2e-2, rtol=2e-2)


def test_a_pruned_dbrx_compiles_without_a_plan_its_flat_experts_read_off_their_zeros(monkeypatch):
    """A DBRX pruned by any tool (here a 16 x 16 hybrid plan applied) and compiled with no plan: its flat
    weights are planned from their zeros (w2 as its transpose) and served by TileFlatExperts."""
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    model = _model()
    pruned = _plan(model).apply(copy.deepcopy(model))
    inferred = patchc.TilePlan.from_linears(pruned)
    for w in FLAT:
        layer = inferred.layers[f"transformer.blocks.1.ffn.experts.mlp.{w}"]
        shape = (HIDDEN, EXPERTS * FFN) if w == "w2" else (EXPERTS * FFN, HIDDEN)
        assert layer.tile == (16, 16) and layer.shape == shape
        assert layer.n_sparse and torch.equal(layer.mask(), _weight(pruned, 1, w) != 0)
    fast = _compile(pruned, None)
    assert all(type(b.ffn.experts) is TileFlatExperts for b in fast.transformer.blocks)
    ids = _ids(2, 8)
    torch.testing.assert_close(_logits(fast, ids), _logits(pruned, ids), atol=1e-5, rtol=1e-5)



def test_patchc_import_of_a_pruned_dbrx_folder_loads_back_served(tmp_path, monkeypatch):
    """A pruned DBRX saved by transformers: `import_sparse` plans its six flat weights off their zeros and
    `patchc.from_pretrained` serves them with TileFlatExperts, giving the pruned model's logits."""
    from patchc.export.importing import import_sparse
    from tests.conftest import save_word_tokenizer

    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    model = _model()
    pruned = _plan(model).apply(copy.deepcopy(model))
    pruned.save_pretrained(tmp_path / "src")
    save_word_tokenizer(tmp_path / "src")
    summary = import_sparse(tmp_path / "src", tmp_path / "out")
    assert "6 layers planned at tile 16x16" in summary.format()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        served = patchc.from_pretrained(tmp_path / "out")
    assert all(type(b.ffn.experts) is TileFlatExperts for b in served.transformer.blocks)
    ids = _ids(2, 8)
    torch.testing.assert_close(_logits(served, ids), _logits(pruned, ids), atol=1e-5, rtol=1e-5)


def test_flat_experts_are_tuned_as_their_first_expert_slices_and_read_back_from_the_cache(tmp_path):
    """`tune=True` times each block's first gate_up and down slices (a fake clock here), and `tune="cached"`
    reads those tunings back; the tuned kernels still give the pruned model's logits (in the interpreter)."""
    from tests.test_runtime_tuner import FakeTimer

    model = _model()
    plan = _plan(model)
    timer, cache = FakeTimer(), tmp_path / "tune.json"
    fast = patchc.compile(model, plan, batch_size=4, prefill_len=8, tune=True, time_fn=timer, cache=cache)
    kernels = [k for b in fast.transformer.blocks for k in b.ffn.experts.kernels.values()]
    assert timer.calls > 0 and len(kernels) == 4 and {k.tuning.source for k in kernels} == {"tuned"}
    ids = _ids(1, 6)
    torch.testing.assert_close(_logits(fast, ids), _logits(plan.apply(copy.deepcopy(model)), ids), atol=1e-4, rtol=1e-4)
    cached = patchc.compile(model, plan, batch_size=4, prefill_len=8, tune="cached", cache=cache)
    again = [k for b in cached.transformer.blocks for k in b.ffn.experts.kernels.values()]
    assert {k.tuning.source for k in again} == {"cache"}
    assert [k.tuning.decode for k in again] == [k.tuning.decode for k in kernels]

def _weight(model, block: int, w: str) -> torch.Tensor:
    """A flat weight as its (N, K) matrix (w2 transposed)."""
    weight = getattr(model.transformer.blocks[block].ffn.experts.mlp, w).detach()
    return weight.t() if w == "w2" else weight
