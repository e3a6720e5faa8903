"""patchc.models.traceable: layers torch.export cannot trace, exported in a vectorised form (Qwen4-Exp's indexer).

The form is checked against transformers' own loop on the same inputs (the same blocks for every query, up to
ties among equal scores), then through patchc's path: export, masks, hardening, and the model's own forward
back after the export.
"""

from __future__ import annotations

import pytest
import torch

import patchc
from patchc.models.hf_export import export_causal_lm
from patchc.models.traceable import qsa_block_scores, qsa_queries_and_blocks, traceable_layers
from tests.conftest import check_ones_and_hardened

transformers = pytest.importorskip("transformers")
qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp",
                            reason="Qwen4-Exp needs a transformers that has it (5.24)")

RATIO, BUDGET = 4, 8  # blocks of 4 keys, 2 blocks kept per query


def _model(seed: int = 0, layer_types=("full_attention",)) -> torch.nn.Module:
    config = transformers.Qwen4ExpTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, hc_lowrank=16,
        ngram_vocab_size_base=1024, split_ngram_parts=4, max_position_embeddings=128, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=BUDGET, indexer_compress_ratio=RATIO)
    torch.manual_seed(seed)
    return transformers.Qwen4ExpForCausalLM(config).eval()


def _indexer(model):
    return next(m for m in model.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer")


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _indexer_call(model, ids):
    """(args, the mask transformers' loop returns) of the model's first indexer call on `ids`."""
    calls = []
    hook = _indexer(model).register_forward_hook(lambda _m, args, out: calls.append((args, out)))
    with torch.no_grad():
        model(ids, use_cache=False)
    hook.remove()
    return calls[0]


@pytest.mark.parametrize("length", [3, 4, 9, 16, 21, 40])
def test_the_vectorised_indexer_keeps_the_blocks_the_loop_keeps(length):
    """Every query keeps the keys after its last complete block and min(2, complete blocks) blocks; they are
    the loop's blocks, or blocks of exactly the same scores where the loop's top-k met a tie."""
    model = _model()
    indexer = _indexer(model)
    compared = differing = 0
    for seed in range(3):
        (hidden, position_embeddings, mask, cache), want = _indexer_call(model, _ids(2, length, seed))
        with traceable_layers(model), torch.no_grad():
            got = indexer(hidden, position_embeddings, mask, cache)
            scores = qsa_block_scores(*qsa_queries_and_blocks(indexer, hidden, position_embeddings))
        assert got.shape == want.shape == (2, 1, length, length) and got.dtype == torch.bool
        for b in range(2):
            for q in range(length):
                complete = (q + 1) // RATIO
                end = complete * RATIO
                assert torch.equal(got[b, 0, q, end:], want[b, 0, q, end:]), (b, q)  # the tail: keys end..q
                per_block = [m[b, 0, q, :end].reshape(complete, RATIO) for m in (got, want)]
                assert all(bool((k.all(1) | ~k.any(1)).all()) for k in per_block), (b, q)  # whole blocks only
                chosen = [set(torch.nonzero(k.all(1)).flatten().tolist()) for k in per_block]
                assert len(chosen[0]) == len(chosen[1]) == min(BUDGET // RATIO, complete), (b, q, chosen)
                mine, theirs = (sorted(scores[b, q, sorted(c)].tolist()) for c in chosen)
                assert mine == theirs, (b, q, chosen, scores[b, q])
                compared += complete > BUDGET // RATIO  # rows where there was a choice to make
                differing += chosen[0] != chosen[1]
    assert differing <= compared // 2 or compared == 0  # ties are the exception, not the rule


def test_a_qwen4_exp_model_exports_trains_masks_and_hardens():
    """The model exports (its indexer was the one layer torch.export could not trace; a graph holds from two
    blocks on, so one is made per length), its ones-mask program is the model at two lengths, and the hardened
    plan applied to a copy is the eval program."""
    model = _model()
    ep = export_causal_lm(model, fixed_len=16)
    assert "forward" not in _indexer(model).__dict__  # the model's own forward is back
    prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35, init_std=0.5))
    assert any(name.endswith("indexer.index_qk_proj.weight") for name in prog.layers)
    with traceable_layers(model, every_instance=True):  # the models below rank tied blocks as the program does
        check_ones_and_hardened(prog, model)
    assert type(_indexer(model)).forward.__name__ == "forward"  # the class's forward is back too


def test_with_a_cache_the_model_runs_its_own_indexer():
    """Decoding with a KV cache is not what the vectorised form covers: inside the block the model still decodes
    as transformers does, token for token, and the exported layers are restored however the block ends."""
    model = _model()
    ids = _ids(1, 9)
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    with traceable_layers(model) as swapped:
        assert swapped == ["model.layers.0.self_attn.indexer"]
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
    with pytest.raises(RuntimeError, match="inside"), traceable_layers(model):
        raise RuntimeError("inside")
    assert "forward" not in _indexer(model).__dict__


def test_under_eager_attention_the_model_runs_its_own_indexer():
    """Eager attention hands the indexer an additive float mask, which transformers 5.17's indexer answers in
    kind (5.24's with a bool mask): the vectorised form, which returns the bool selection, leaves it alone."""
    model = _model()
    model.set_attn_implementation("eager")
    (hidden, position_embeddings, mask, cache), want = _indexer_call(model, _ids(2, 16))
    assert mask.is_floating_point()
    with traceable_layers(model), torch.no_grad():
        got = _indexer(model)(hidden, position_embeddings, mask, cache)
    assert got.dtype == want.dtype and torch.equal(got, want)
