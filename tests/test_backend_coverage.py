"""`patchc.runtime.unserved(plan)`: the planned layers no graph of the patch backend served (and
`unserved(model)`: the 2:4 weights of a model compiled without a plan that no graph served).

Dynamo never shows the backend a frame it runs eagerly, so such a layer stays dense without a warning; the
record of what each graph served is the only way to tell. Checked on a frame under `torch._dynamo.disable`,
on a read the backend names as left dense, on fused experts, and on a plan no graph has read yet.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchc.runtime as rt
from patchc.codegen.reference import random_24_mask, random_layer_plan
from patchc.ir import TilePlan
from patchc.runtime.coverage import NOT_READ, NOT_SEEN


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


class Eager(nn.Module):
    """Two linears dynamo compiles, one in a frame it must run eagerly, one scaled before its matmul."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32, bias=False) for _ in range(4))
        for lin in (self.a, self.b, self.c, self.d):
            lin.weight.data = torch.randn(32, 32, generator=g) / 4

    @torch._dynamo.disable
    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.a(x))
        return self._eager(y) + F.linear(y, self.d.weight * 2)


def _plan(model: nn.Module) -> TilePlan:
    g = torch.Generator().manual_seed(1)
    return TilePlan.from_weights({f"{n}.weight": model.get_parameter(f"{n}.weight").detach() * random_24_mask(32, 32, g)
                                  for n in "abcd"}, tile=(16, 16))


def test_a_frame_run_eagerly_and_a_read_left_dense_are_unserved_and_the_rest_served():
    model = Eager()
    plan = _plan(model)
    assert rt.unserved(plan) == {f"{n}.weight": NOT_SEEN for n in "abcd"}  # before any graph
    torch._dynamo.reset()
    cm = torch.compile(model, backend="patch", options={"plan": plan, "tune": False, "inner": "eager"})
    with pytest.warns(UserWarning, match=r"d\.weight \(read only by mul"), torch.no_grad():
        cm(torch.randn(3, 32))
    torch._dynamo.reset()
    left = rt.unserved(plan)
    assert sorted(left) == ["c.weight", "d.weight"]  # a and b served; c never seen; d named by its graph
    assert left["c.weight"] == NOT_SEEN
    assert left["d.weight"].startswith("read only by mul")
    assert rt.unserved(_plan(model)) == {f"{n}.weight": NOT_SEEN for n in "abcd"}  # recorded per plan object


def test_a_model_compiled_without_a_plan_is_asked_of_its_own_weights():
    """The pruned model, its plan inferred from the zeros in every graph: a and b served, c never seen (the
    eager frame), d read only through a product; an unpruned weight (no 2:4 tile) is never listed."""
    model = _plan(Eager()).apply(Eager())
    assert rt.unserved(model) == {f"{n}.weight": NOT_SEEN for n in "abcd"}
    torch._dynamo.reset()
    cm = torch.compile(model, backend="patch", options={"tune": False, "inner": "eager"})
    with torch.no_grad():
        torch.testing.assert_close(cm(torch.ones(3, 32)), model(torch.ones(3, 32)), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    assert rt.unserved(model) == {"c.weight": NOT_SEEN, "d.weight": NOT_READ} == rt.unserved(cm)
    model.a.weight.data = torch.randn(32, 32)  # dense now: not a layer to serve
    assert sorted(rt.unserved(model)) == ["c.weight", "d.weight"]
    assert rt.unserved(model, tile=32) == {"c.weight": NOT_SEEN, "d.weight": NOT_READ}
    assert rt.unserved(_plan(Eager()).apply(Eager())) == {f"{n}.weight": NOT_SEEN for n in "abcd"}  # per weight


class Experts(nn.Module):
    def __init__(self, slices: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(slices.clone())

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.bmm(self.w[ids], x.unsqueeze(-1)).squeeze(-1)


def test_served_expert_slices_are_not_listed_and_unplanned_ones_never_are():
    layers = {e: random_layer_plan(48, 64, tile=(16, 16), kinds="mixed", seed=e, name=f"w.{e}") for e in (0, 2)}
    layers[3] = random_layer_plan(48, 64, tile=(16, 16), kinds="dense", seed=3, name="w.3")  # no 2:4 tile
    slices = torch.randn(4, 48, 64, generator=torch.Generator().manual_seed(9))
    for e, layer in layers.items():
        slices[e] = layer.to_dense()
    plan = TilePlan(layers={layer.name: layer for layer in layers.values()})
    assert sorted(rt.unserved(plan)) == ["w.0", "w.2"]
    torch._dynamo.reset()
    cm = torch.compile(Experts(slices), backend="patch", options={"plan": plan, "strict": True, "tune": False})
    with torch.no_grad():
        cm(torch.randn(5, 64), torch.tensor([0, 2, 1, 3, 0]))
    torch._dynamo.reset()
    assert rt.unserved(plan) == {}
