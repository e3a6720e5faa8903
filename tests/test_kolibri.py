"""Kolibri 1.1's indexer (transformers 5.25), which loops over batch and query groups around `.tolist()`, exported
in a vectorised form (`patchc.models.traceable.kolibri_indexer_causal`): the same pools and the same selected keys
as the loop, then through patchc's path (export, masks, hardening), and the model's own indexer back for decoding."""

from __future__ import annotations

import pytest
import torch

import patchc
from patchc.models.hf_export import export_causal_lm
from patchc.models.traceable import traceable_layers
from tests.conftest import check_ones_and_hardened

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Kolibri1_1Config"):
    pytest.skip(f"transformers {transformers.__version__} has no Kolibri 1.1", allow_module_level=True)

POOL, RATIO, TOPK, LOCAL, SINKS = 8, 4, 4, 2, 1  # a query sees all keys up to 8, its pool above; 7 keys past 7


def _model() -> torch.nn.Module:
    """Three layers: sliding attention; an indexer (a new pool); a reindexer reading its keys, values and pool."""
    config = transformers.Kolibri1_1Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, mlp_only_intermediate_size=64, max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention", "indexed_attention", "indexed_attention"], index_layers=[1],
        kv_source_layers=[0, 1, 1], mlp_only_layers=[0], index_pool_size=POOL, index_compression=RATIO,
        index_topk=TOPK, index_num_heads=2, index_num_local_tokens=LOCAL, index_num_sink_tokens=SINKS)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _indexer_calls(model, ids) -> list:
    """(indexer, args, output) of each indexer call on `ids`, in layer order."""
    calls = []
    hooks = [m.register_forward_hook(lambda m, args, out: calls.append((m, args, out)))
             for m in model.modules() if type(m).__name__ == "Kolibri1_1Indexer"]
    with torch.no_grad():
        model(ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return calls


@pytest.mark.parametrize("length", [5, 9, 16, 23, 40])
def test_the_vectorised_indexer_selects_the_pools_and_keys_the_loop_selects(length):
    model = _model()
    for seed in range(2):
        calls = _indexer_calls(model, _ids(2, length, seed))
        assert [m.is_pool_source for m, _, _ in calls] == [True, False]
        for indexer, args, (want, want_pool) in calls:
            with traceable_layers(model), torch.no_grad():
                got, got_pool = indexer(*args)
            assert got.dtype == torch.bool and got.shape == want.shape == (2, 1, length, length)
            assert torch.equal(got, want) and torch.equal(got_pool, want_pool), (length, seed)
        kept = want.sum(-1).flatten()
        assert length <= TOPK + LOCAL + SINKS or int(kept.max()) == TOPK + LOCAL + SINKS  # the budget held


def test_a_kolibri_exports_trains_masks_and_hardens():
    """The ones-mask program is the model at two lengths (the training length's graph is the dynamic export's,
    which holds from length 8 up: no second export at 16); the hardened plan applied to a copy is the eval
    program; and the model decodes with its own indexer after the export."""
    model = _model()
    ids = _ids(1, 12)
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    prog = patchc.transform(export_causal_lm(model, fixed_len=16),
                            patchc.PatchConfig(tile=(16, 16), sparsity=0.35, init_std=0.5))
    assert "forward" not in next(m for m in model.modules() if hasattr(m, "is_pool_source")).__dict__
    assert any(".mlp.experts.gate_up_proj." in name for name in prog.layers)
    check_ones_and_hardened(prog, model)
    assert "holds only for lengths 8..128" in prog.seq_graphs.source.reason
    assert sorted(prog.seq_graphs.graphs) == [16, 23]
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
