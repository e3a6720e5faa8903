"""The plan torch.compile(backend="patch") infers from the zeros: surveyed per graph, each layer packed once.

`InferredPlan.survey` must decide exactly what `TilePlan.from_weights` / `layer_from_weight` decide (the plan
the backend built before), and `generate()`'s later graphs must neither read a weight's zeros again nor pack
its layer again; an in-place edit of a weight must.
"""

from __future__ import annotations

import copy

import pytest
import torch

import patchc.runtime.inferred as inferred
from patchc.codegen.reference import random_24_mask
from patchc.ir import TilePlan
from patchc.ir.from_pruned import layer_from_weight
from patchc.runtime.inferred import InferredPlan
from tests.test_backend_packs import _packed_modules, pruned  # noqa: F401 (pruned: the fixture)

TILE = (16, 16)


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


def _hybrid(n: int, k: int, seed: int, dense_tiles: int = 2) -> torch.nn.Parameter:
    """(n, k) 2:4 weights with the first `dense_tiles` tiles of the first tile row left dense."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    kept = w * random_24_mask(n, k, g)
    kept[:TILE[0], : dense_tiles * TILE[1]] = w[:TILE[0], : dense_tiles * TILE[1]]
    return torch.nn.Parameter(kept, requires_grad=False)


def test_the_survey_decides_what_from_weights_does():
    a, b = _hybrid(40, 48, 0), torch.nn.Parameter(_hybrid(32, 64, 1).t().contiguous())  # b (K, N), read so
    dense, short_k = torch.nn.Parameter(torch.randn(32, 32)), torch.nn.Parameter(_hybrid(16, 18 * 4, 2)[:, :70])
    experts = torch.nn.Parameter(torch.stack([_hybrid(32, 48, 3), torch.randn(32, 48),
                                              _hybrid(32, 48, 4, dense_tiles=0)]))
    mixer, given = _hybrid(32, 32, 5), _hybrid(32, 32, 6).detach()  # a parameter of any name; a graph input
    plan = InferredPlan.survey({"a.weight": (a, False), "b.weight": (b, True), "c.weight": (dense, False),
                                "d.weight": (short_k, False), "hc_fn": (mixer, False),
                                "patchc_weight_3": (given, False)},
                               {"experts.up": (experts, False), "x": (torch.stack([a[:32]] * 2).detach(), False)},
                               TILE)
    want = TilePlan.from_weights({"a.weight": a, "b.weight": b.t(), "c.weight": dense, "d.weight": short_k},
                                 tile=TILE)
    # left out: c (all dense), d (K % 4), the graph inputs; in: the parameter not named "*.weight"
    assert sorted(plan.layers) == ["a.weight", "b.weight", "experts.up.0", "experts.up.2", "hc_fn"]
    for name in ("a.weight", "b.weight"):
        assert plan.layers[name] == want.layers[name].slot()
    assert plan.layers["a.weight"].n_dense == 2 and plan.layers["experts.up.2"].n_dense == 0
    for e in (0, 2):
        assert plan.layers[f"experts.up.{e}"] == layer_from_weight("x", experts[e], TILE).slot()
    assert plan.meta["targets"] == {"b.weight": {"param": "b.weight", "expert": None, "transposed": True},
                                    "experts.up.0": {"param": "experts.up", "expert": 0, "transposed": False},
                                    "experts.up.2": {"param": "experts.up", "expert": 2, "transposed": False}}
    packed = plan.packed(["b.weight", "experts.up.2"])
    assert sorted(packed.layers) == ["b.weight", "experts.up.2"]  # only what is asked for
    refs = {"b.weight": want.layers["b.weight"], "experts.up.2": layer_from_weight("x", experts[2], TILE)}
    for name, ref in refs.items():
        assert torch.equal(packed.layers[name].to_dense(), ref.to_dense())
        assert torch.equal(packed.layers[name].kinds, ref.kinds)


def test_a_weight_is_surveyed_again_after_an_in_place_edit_only():
    w = _hybrid(64, 64, 0)
    first = InferredPlan.survey({"a.weight": (w, False)}, {}, TILE).layers["a.weight"]
    assert InferredPlan.survey({"a.weight": (w, False)}, {}, TILE).layers["a.weight"] is first  # kept beside w
    assert InferredPlan.survey({"a.weight": (w, False)}, {}, (32, 32)).layers["a.weight"].tile == (32, 32)
    with torch.no_grad():
        w.fill_(1.0)  # every tile dense now
    assert InferredPlan.survey({"a.weight": (w, False)}, {}, TILE).layers == {}


def _counting(monkeypatch, name: str) -> list[str]:
    calls: list[str] = []
    real = getattr(inferred, name)

    def count(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(inferred, name, count)
    return calls


def test_generate_surveys_and_packs_each_weight_once(pruned, monkeypatch):
    model, _ = pruned  # its 14 projections 2:4
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False)
    surveyed, packed = _counting(monkeypatch, "slot_from_weight"), _counting(monkeypatch, "layer_from_weight")
    held: list[int] = []  # packed layers an inferred plan holds at once
    real_packed = InferredPlan.packed

    def packed_and_counted(self, names):
        out = real_packed(self, names)
        held.append(len(out.layers))
        return out

    monkeypatch.setattr(InferredPlan, "packed", packed_and_counted)
    served: list[int] = []
    compiled = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled.forward = torch.compile(compiled.forward, backend="patch",
                                     options={"tune": False, "graph_callback": lambda gm, n: served.append(n)})
    with torch.no_grad():
        got = compiled.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert len(served) >= 2 and all(n == 14 for n in served)  # every graph serves the 14 projections
    # once each, not once per graph: the 14 projections and the dense LM head surveyed, the 14 packed
    assert len(surveyed) == 15 and len(packed) == 14
    assert max(held) == 1  # untuned: each layer dropped once its module is built, never the whole packed model
    torch._dynamo.reset()


def test_a_tuned_inferred_plan_packs_one_layer_per_tuning_class_for_the_tuner(tmp_path, monkeypatch):
    """Two 1024 x 1024 layers of one tuning class and a 128 x 1024 one: the tuner gets the first layer of each
    class packed and shares its tuning with the rest, so the plan never holds all three packed layers."""
    from patchc.codegen.reference import random_tile_plan
    from tests.test_runtime_tuner import FakeTimer

    spec = dict(k=1024, tile=(64, 64), kinds="mixed")
    plan = random_tile_plan({"0.weight": dict(n=1024, **spec), "1.weight": dict(n=1024, **spec),
                             "2.weight": dict(n=128, **spec)})
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, n, bias=False) for n in (1024, 1024, 128)))
    with torch.no_grad():
        for i, linear in enumerate(model):
            linear.weight.copy_(plan.layers[f"{i}.weight"].to_dense())
    x, timer = torch.randn(3, 1024), FakeTimer()
    seen, packed, held = _packed_modules(monkeypatch), _counting(monkeypatch, "layer_from_weight"), []
    real_release = InferredPlan.release
    monkeypatch.setattr(InferredPlan, "release", lambda self, names: held.append(len(self._packed.layers))
                        or real_release(self, names))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="patch", options={
        "tile": (64, 64), "time_fn": timer, "cache": tmp_path / "tune.json", "batch_size": 16, "prefill_len": 32})
    with torch.no_grad():
        got = compiled(x)
    torch.testing.assert_close(got, model(x), atol=1e-4, rtol=1e-5)
    assert timer.calls > 0 and [m.tuning.source for m in seen[0]] == ["tuned", "shared", "tuned"]
    assert len(packed) == 3 and held[0] == 2  # at the first release: layer 0 and the tuned 2, never 1 beside them
    torch._dynamo.reset()
