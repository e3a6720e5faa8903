"""Learned hybrid masks on the real stories260K model and real TinyStories text (CPU, ~1 min)."""

from __future__ import annotations

import pytest
import torch

import patchc
from patchc.data import batch_fn, load_text_data
from patchc.evaluate import perplexity
from patchc.models.llama2c import export_llama, load_llama2c, load_tokenizer
from tests.conftest import STORIES, TINYSTORIES, needs_shared

pytestmark = [needs_shared, pytest.mark.slow]


@pytest.fixture(scope="module")
def setting():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 260K-parameter model is faster on one thread
    tok = load_tokenizer(STORIES / "tok512.bin")
    data = load_text_data(TINYSTORIES, tok, block_len=129, eval_fraction=0.2, seed=0)
    yield data
    torch.set_num_threads(threads)


def _model():
    return load_llama2c(STORIES / "stories260K.bin")


def _magnitude_24(model):
    masks = patchc.oneshot(model, method="magnitude", pattern="2:4")
    with torch.no_grad():
        for fqn, mask in masks.items():
            model.get_parameter(fqn).mul_(mask)
    return model


def test_patch_35_beats_magnitude_24_and_hits_the_density(setting):
    data = setting
    cfg = patchc.PatchConfig(tile=(16, 16), sparsity=0.35, variant="joint", prior="magnitude", steps=300)
    prog = patchc.transform(export_llama(_model()), cfg)
    patchc.train_masks(prog, batch_fn(data.train_blocks, 8, seed=0), patchc.lm_loss, lr=1e-3, progress=False)
    plan = patchc.harden(prog)  # the paper's sign rule, no exact budget
    pruned = plan.apply(_model())
    ppl_patch = perplexity(pruned, data.eval_ids, context=256)
    ppl_magnitude = perplexity(_magnitude_24(_model()), data.eval_ids, context=256)
    ppl_dense = perplexity(_model(), data.eval_ids, context=256)
    print(f"dense {ppl_dense:.3f}  PATCH 35% {ppl_patch:.3f} (density {plan.density:.4f})  magnitude 2:4 {ppl_magnitude:.3f}")
    assert abs(plan.density - 0.65) <= 0.02
    assert ppl_dense < ppl_patch < 0.5 * ppl_magnitude
    # The program's eval forward is the hardened plan's forward.
    ids = data.eval_ids[:64].unsqueeze(0)
    assert torch.equal(prog.eval()(ids), pruned(ids))
