"""The suite's export reuse (`tests/export_cache.py`) hands back what a fresh export would: the same graph,
bound to the caller's own tensors, and nothing when the model could trace differently."""

from __future__ import annotations

import pytest
import torch

from patchc.models.llama2c import Llama, LlamaConfig, export_llama
from tests.export_cache import reuse_llama2c_exports

CONFIG = LlamaConfig(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
IDS = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))


def _model(seed: int) -> Llama:
    torch.manual_seed(seed)
    return Llama(CONFIG).eval()


def test_a_second_model_gets_the_first_graph_bound_to_its_own_tensors():
    export = reuse_llama2c_exports(export_llama)
    first, second = _model(0), _model(1)
    ep1, ep2 = export(first), export(second)
    assert len(export.cache) == 1
    own = second.state_dict(keep_vars=True)
    assert ep2.state_dict.keys() == own.keys() and all(ep2.state_dict[k] is own[k] for k in own)
    assert all(ep2.constants[k] is getattr(second, k) for k in ("rope_cos", "rope_sin"))
    torch.testing.assert_close(ep2.module()(IDS), second(IDS), rtol=0, atol=0)
    torch.testing.assert_close(ep1.module()(IDS), first(IDS), rtol=0, atol=0)
    assert not torch.equal(ep1.module()(IDS), ep2.module()(IDS))
    with torch.no_grad():  # an in-place edit of the model shows in its program, as in a fresh export
        second.layers[0].mlp.up_proj.weight.zero_()
    torch.testing.assert_close(ep2.module()(IDS), second(IDS), rtol=0, atol=0)
    before = str(ep1.graph)
    with ep1.graph.inserting_before(next(n for n in ep1.graph.nodes if n.op == "output")):
        ep1.graph.call_function(torch.ops.aten.zeros.default, ([1],))  # a job rewrites the graph it is handed
    assert str(ep1.graph) != before and str(export(_model(2)).graph) == before


def test_a_model_that_could_trace_differently_is_exported_afresh():
    export = reuse_llama2c_exports(export_llama)
    export(_model(0))
    export(_model(0), seq=9)  # another example shape
    hooked = _model(0)
    hooked.layers[0].register_forward_hook(lambda *_: None)
    export(hooked)
    export(Llama(LlamaConfig(**{**CONFIG.__dict__, "n_layers": 1})).eval())
    assert len(export.cache) == 3  # the hooked model is never cached
    mlp = type(_model(0).layers[0].mlp)
    forward = mlp.forward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mlp, "forward", lambda self, x: forward(self, x) * 2)  # a class's forward patched
        ep = export(_model(0))
        assert len(export.cache) == 4
        torch.testing.assert_close(ep.module()(IDS), _model(0)(IDS), rtol=0, atol=0)
