"""torch.compile(backend="patch") packs each planned weight once for all the graphs dynamo compiles.

`model.generate()` under a compiled forward hands the backend several graphs (the prompt, the first decode
step, a graph dynamic in the length). Each used to pack every planned weight again: one packed copy of the
model per graph. `patchc.runtime.packs` shares them; these tests count the distinct packed modules, check
generate's tokens against the pruned model's, and check that the shared modules go when their graphs do.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import patchc.runtime.backend as backend
from patchc.codegen.reference import random_24_mask
from patchc.ir import TilePlan
from patchc.runtime import packs
from tests.conftest import tiny_hf


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


@pytest.fixture()
def pruned():
    model = tiny_hf("llama")
    g = torch.Generator().manual_seed(1)
    weights = {n: p.detach() * random_24_mask(*p.shape, g) for n, p in model.named_parameters()
               if n.endswith("proj.weight")}
    plan = TilePlan.from_weights(weights, tile=(16, 16))
    return plan.apply(model, force=True), plan


def _packed_modules(monkeypatch) -> list[list[torch.nn.Module]]:
    """Per graph the backend rewrites: the TileLinear modules it gets (held, so their ids stay theirs)."""
    seen: list[list[torch.nn.Module]] = []
    build = backend.linear_modules

    def record(*args, **kwargs):
        out = build(*args, **kwargs)
        seen.append([mod for _, mod in out.values()])
        return out

    monkeypatch.setattr(backend, "linear_modules", record)
    return seen


@pytest.mark.parametrize("with_plan", [True, False], ids=["plan", "inferred"])
def test_generate_packs_each_weight_once_for_every_graph(pruned, monkeypatch, with_plan):
    model, plan = pruned
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False)
    seen = _packed_modules(monkeypatch)
    compiled = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled.forward = torch.compile(compiled.forward, backend="patch",
                                     options={"tune": False, **({"plan": plan} if with_plan else {})})
    with torch.no_grad():
        got = compiled.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert len(seen) >= 2 and all(len(mods) == len(plan.layers) == 14 for mods in seen)  # every graph serves all
    assert len({id(m) for mods in seen for m in mods}) == 14  # one packed module per weight, not one per graph
    weight = compiled.model.layers[0].mlp.up_proj.weight
    assert packs.held(weight) == 1
    seen.clear()
    torch._dynamo.reset()  # the graphs go, and with them the packed modules
    del compiled.forward
    gc.collect()
    assert packs.held(weight) == 0


def test_shared_builds_again_for_new_sources_a_new_stamp_or_a_value_that_is_gone():
    class Source:
        pass

    class Value:
        pass

    weight, a, b = torch.zeros(4, 4), Source(), Source()
    calls: list[int] = []

    def build() -> Value:
        calls.append(1)
        return Value()

    first = packs.shared(weight, (a,), "k", build, stamp=0)
    assert packs.shared(weight, (a,), "k", build, stamp=0) is first and len(calls) == 1
    assert packs.shared(weight, (b,), "k", build, stamp=0) is not first  # another plan layer
    assert packs.shared(weight, (a,), "other", build, stamp=0) is not first  # another dtype, batch size, ...
    kept = packs.shared(weight, (a,), "k", build, stamp=1)  # the weight was edited in place
    assert kept is not first and len(calls) == 4
    del first
    gc.collect()
    assert packs.held(weight) == 1  # only `kept` is alive: the others went with their values
    del b
    gc.collect()
    assert packs.shared(weight, (a,), "k", build, stamp=1) is kept and len(calls) == 4


def test_an_in_place_edit_of_a_weight_packs_the_inferred_plan_again(pruned, monkeypatch):
    model, _ = pruned
    seen = _packed_modules(monkeypatch)  # holds the first graph's modules past the reset below
    x = torch.randint(3, 128, (1, 5))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="patch", options={"tune": False})(x)
        model.model.layers[0].mlp.up_proj.weight.mul_(2)  # same zeros, new values
        torch._dynamo.reset()  # a compiled graph keeps the weights it packed: compile again
        got = torch.compile(model, backend="patch", options={"tune": False})(x).logits
        want = model(x).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    first, second = ({id(m) for m in mods} for mods in seen)
    assert len(first) == len(second) == 14 and len(first & second) == 13  # only the edited weight packed again
    torch._dynamo.reset()
