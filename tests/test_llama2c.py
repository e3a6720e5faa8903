"""stories260K loader, tokenizer, generation, export and perplexity against the known facts in shared/SOURCES.md."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch

from patchc.job.data import load_documents, tokenize_documents
from patchc.job import evaluate
from patchc.utils import chunks
from patchc.job.evaluate import perplexity
from patchc.models import (
    SHARED_DIR,
    STORIES260K_DIR,
    CheckpointError,
    Llama,
    LlamaConfig,
    Tokenizer,
    export_llama,
    generate,
    load_llama2c,
    load_tokenizer,
    shared_dir,
)

MODEL_BIN = STORIES260K_DIR / "stories260K.bin"
TOK_BIN = STORIES260K_DIR / "tok512.bin"
SAMPLE = SHARED_DIR / "data" / "tinystories_sample.txt"
needs_shared = pytest.mark.skipif(
    not (MODEL_BIN.is_file() and TOK_BIN.is_file() and SAMPLE.is_file()),
    reason=f"stories260K / tinystories sample not found under {SHARED_DIR} (set PATCHC_SHARED)",
)

# Measured on CPU (float32, torch 2.13): ids = every line of the sample as a document, BOS at each start,
# context 256, non-overlapping windows. SOURCES.md says "about 5.6" (real) and "about 516" (random init).
PPL_STORIES = 5.5873
PPL_TOL = 0.01
GREEDY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # A 260K-parameter model gains nothing from intra-op threads, and on a shared 2-core machine the
    # OpenMP spin-waiting makes it up to 8x slower; restore the setting for other test modules.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> Llama:
    return load_llama2c(MODEL_BIN)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(TOK_BIN)


@pytest.fixture(scope="module")
def sample_ids(tok) -> torch.Tensor:
    return tokenize_documents(load_documents(SAMPLE), tok)


def _write_llama2c(model: Llama, path) -> None:
    """Serialise `model` in llama2.c's legacy layout (test-only writer, to exercise the reader)."""
    cfg = model.config
    vocab = cfg.vocab_size if cfg.shared_classifier else -cfg.vocab_size
    layers = model.layers
    parts = [
        model.embed_tokens.weight,
        *[l.input_layernorm.weight for l in layers],
        *[l.self_attn.q_proj.weight for l in layers],
        *[l.self_attn.k_proj.weight for l in layers],
        *[l.self_attn.v_proj.weight for l in layers],
        *[l.self_attn.o_proj.weight for l in layers],
        *[l.post_attention_layernorm.weight for l in layers],
        *[l.mlp.gate_proj.weight for l in layers],
        *[l.mlp.down_proj.weight for l in layers],
        *[l.mlp.up_proj.weight for l in layers],
        model.norm.weight,
        model.rope_cos,
        model.rope_sin,
    ]
    if not cfg.shared_classifier:
        parts.append(model.lm_head.weight)
    header = struct.pack(
        "<7i", cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, vocab, cfg.max_seq_len
    )
    body = b"".join(p.detach().float().contiguous().numpy().tobytes() for p in parts)
    path.write_bytes(header + body)


def _naive_merge(tok: Tokenizer, text: str) -> list[int]:
    """Straight transcription of llama2.c run.c encode (O(n^2) merge loop), the reference for Tokenizer.encode."""
    tokens = [tok.lookup[b" "]] if text else []
    for ch in text:
        b = ch.encode("utf-8")
        tokens.extend([tok.lookup[b]] if b in tok.lookup else [x + 3 for x in b])
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            tid = tok.lookup.get(tok.pieces[tokens[i]] + tok.pieces[tokens[i + 1]])
            if tid is not None and tok.scores[tid] > best_score:
                best_score, best_id, best_idx = tok.scores[tid], tid, i
        if best_idx == -1:
            return [1] + tokens
        tokens[best_idx : best_idx + 2] = [best_id]


# ------------------------------------------------------------------------------------------------ loader


@needs_shared
def test_config_and_names(model):
    cfg = model.config
    assert (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.max_seq_len) == (
        64, 172, 5, 8, 4, 512, 512,
    )
    assert cfg.shared_classifier and model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 260_032
    names = dict(model.named_modules())
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert isinstance(names[f"layers.4.{proj}"], torch.nn.Linear)
        assert names[f"layers.4.{proj}"].bias is None
    assert names["layers.0.self_attn.k_proj"].weight.shape == (32, 64)  # GQA: 4 kv heads x 8
    assert not any("rope" in k for k in model.state_dict())  # non-persistent buffers


@needs_shared
def test_rope_matches_checkpoint_tables(model):
    # The checkpoint stores llama2.c's freq_cis tables right after rms_final; we skip them but must agree.
    cfg = model.config
    raw = MODEL_BIN.read_bytes()
    L, d, h, hd = cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.head_dim
    n_before = cfg.vocab_size * d + 2 * L * d + L * d * d * 2 + 2 * L * cfg.kv_dim * d + 3 * L * h * d + d
    n_tab = cfg.max_seq_len * hd // 2
    flat = torch.frombuffer(bytearray(raw[28:]), dtype=torch.float32)
    real = flat[n_before : n_before + n_tab].view(cfg.max_seq_len, hd // 2)
    imag = flat[n_before + n_tab : n_before + 2 * n_tab].view(cfg.max_seq_len, hd // 2)
    torch.testing.assert_close(model.rope_cos, real, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.rope_sin, imag, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shared", [True, False])
def test_roundtrip_through_llama2c_format(tmp_path, shared):
    cfg = LlamaConfig(32, 40, 2, 4, 2, 300, 64, shared_classifier=shared)
    torch.manual_seed(0)
    ref = Llama(cfg).eval()
    _write_llama2c(ref, tmp_path / "m.bin")
    got = load_llama2c(tmp_path / "m.bin")
    assert got.config == cfg
    assert (got.lm_head.weight is got.embed_tokens.weight) == shared
    ids = torch.randint(0, 300, (2, 17))
    torch.testing.assert_close(got(ids), ref(ids), atol=0, rtol=0)


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        load_llama2c(missing)
    cfg = LlamaConfig(16, 24, 1, 2, 1, 260, 16)
    torch.manual_seed(0)
    good = tmp_path / "good.bin"
    _write_llama2c(Llama(cfg), good)
    raw = good.read_bytes()

    short = tmp_path / "short.bin"
    short.write_bytes(raw[:-4])
    with pytest.raises(CheckpointError, match=r"short\.bin.*truncated"):
        load_llama2c(short)
    long_ = tmp_path / "long.bin"
    long_.write_bytes(raw + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"long\.bin.*longer"):
        load_llama2c(long_)
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(raw[:10])
    with pytest.raises(CheckpointError, match=r"tiny\.bin.*header"):
        load_llama2c(tiny)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(struct.pack("<7i", 16, 24, 1, 3, 1, 260, 16) + raw[28:])  # 16 % 3 != 0
    with pytest.raises(CheckpointError, match=r"bad\.bin.*bad llama2.c header.*n_heads"):
        load_llama2c(bad)
    v1 = tmp_path / "v1.bin"
    v1.write_bytes(struct.pack("<I", 0x616B3432) + raw[4:])
    with pytest.raises(CheckpointError, match=r"v1\.bin.*ak42"):
        load_llama2c(v1)


def test_shared_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("PATCHC_SHARED", str(tmp_path))
    assert shared_dir() == tmp_path
    monkeypatch.delenv("PATCHC_SHARED")
    import patchc

    assert shared_dir() == Path(patchc.__file__).resolve().parent.parent.parent / "shared"


def test_config_validation():
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(64, 172, 5, 8, 3, 512, 512)
    with pytest.raises(ValueError, match="hidden_dim"):
        LlamaConfig(64, 0, 5, 8, 4, 512, 512)
    with pytest.raises(ValueError, match="even"):
        LlamaConfig(24, 32, 1, 8, 4, 64, 64)  # head_dim 3


# ------------------------------------------------------------------------------------------------ tokenizer


@needs_shared
def test_tokenizer_encode_known_ids(tok):
    assert tok.vocab_size == 512
    ids = tok.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]  # BOS, " Once", " upon", " a", " time"
    assert tok.encode("Hi", bos=False, eos=True)[-1] == 2
    assert tok.encode("") == [1]


@needs_shared
def test_tokenizer_matches_run_c_reference(tok):
    text = SAMPLE.read_text(encoding="utf-8")
    for piece in (text[:700], text[5000:5600], "café naïve — 杜甫 ☃\n\ttabs  and  spaces!", "a", " x "):
        assert tok.encode(piece) == _naive_merge(tok, piece), piece[:40]


@needs_shared
def test_tokenizer_roundtrip_real_text(tok):
    text = SAMPLE.read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert 10_000 < len(ids) < 20_000  # ~2 characters per token for this 512-token vocabulary
    assert tok.decode(ids) == text
    wiki = (SHARED_DIR / "data" / "wikitext2_raw_test.txt").read_text(encoding="utf-8")[:3000]
    assert tok.decode(tok.encode(wiki)) == wiki  # includes byte-fallback tokens (CR, non-ASCII)
    assert tok.decode(tok.encode("杜甫 café")) == "杜甫 café"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([1, 512])


def test_tokenizer_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tok.bin"):
        load_tokenizer(tmp_path / "tok.bin")
    bad = tmp_path / "trunc.bin"
    bad.write_bytes(struct.pack("<i", 8) + struct.pack("<fi", 0.0, 5) + b"ab")
    with pytest.raises(CheckpointError, match=r"trunc\.bin"):
        load_tokenizer(bad)


# ------------------------------------------------------------------------------------------------ generation


@needs_shared
def test_greedy_generation_known_story(model, tok):
    ids = torch.tensor([tok.encode("Once upon a time")])
    out = generate(model, ids, max_new_tokens=30)
    assert out.shape == (1, 5 + 30)
    assert torch.equal(out[:, :5], ids)
    assert tok.decode(out[0].tolist()).startswith(GREEDY)


@needs_shared
def test_sampled_generation_is_seeded(model, tok):
    ids = torch.tensor(tok.encode("Once upon a time"))
    a = generate(model, ids, 30, temperature=1.0, seed=7)
    b = generate(model, ids, 30, temperature=1.0, seed=7)
    c = generate(model, ids, 30, temperature=1.0, seed=8)
    assert a.shape == (35,) and torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, generate(model, ids, 30))  # sampling is not greedy


# ------------------------------------------------------------------------------------------------ export


@needs_shared
def test_export_dynamic_batch_and_seq_equals_eager(model):
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=1, max=model.config.max_seq_len)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    ep = torch.export.export(model, (ids,), dynamic_shapes={"input_ids": {0: batch, 1: seq}})
    linears = [n for n in ep.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert len(linears) == 5 * 7 + 1
    g = torch.Generator().manual_seed(1)
    for shape in [(3, 37), (1, 1), (5, 200)]:
        x = torch.randint(0, 512, shape, generator=g)
        torch.testing.assert_close(ep.module()(x), model(x), atol=1e-5, rtol=1e-5)


@needs_shared
def test_export_helper_and_perplexity_on_exported_module(model, sample_ids):
    ep = export_llama(model)
    module = ep.module()
    ids = sample_ids[:1500]
    assert perplexity(module, ids, context=256) == pytest.approx(perplexity(model, ids, context=256), rel=1e-6)


# ------------------------------------------------------------------------------------------------ perplexity


@needs_shared
def test_perplexity_tinystories_known_value(model, sample_ids):
    assert sample_ids.numel() == 15_526 and int((sample_ids == 1).sum()) == 19
    ppl = perplexity(model, sample_ids, context=256)
    assert 5.3 < ppl < 5.9
    assert ppl == pytest.approx(PPL_STORIES, abs=PPL_TOL)
    # More history per scored token helps: sliding windows score lower.
    assert perplexity(model, sample_ids, context=256, stride=128) < ppl - 0.1


@needs_shared
def test_perplexity_random_init_is_bad(model, sample_ids):
    torch.manual_seed(0)
    ppl = perplexity(Llama(model.config), sample_ids[:4096], context=256)
    assert ppl > 100  # ~508 for seed 0 (SOURCES.md: about 516 on the whole sample)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_nll_scores_a_few_positions_at_a_time_as_at_once(monkeypatch, dtype):
    """On a CPU the NLL is taken a few positions at a time (chunks of 7 here, with a tail), each upcast on its
    own: the same fp32 numbers, bit for bit, as one cross-entropy over the batch's upcast slice of logits."""
    gen = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(3, 20, 100, generator=gen) * 4, torch.randint(0, 100, (3, 19), generator=gen)
    logits = logits.to(dtype)
    whole = torch.nn.functional.cross_entropy(logits.float()[:, :-1].reshape(-1, 100), targets.flatten(),
                                              reduction="none")
    monkeypatch.setattr(chunks, "CPU_ROW_ELEMENTS", 7 * 100 + 3)
    got = evaluate.token_nll(logits[:, :-1], targets)
    assert got.shape == (3, 19) and got.dtype == torch.float32 and torch.equal(got, whole.view(3, 19))


class _Oracle:
    """A callable LM that puts probability p on the true next token (known from the stream) and spreads
    the rest uniformly: a scored target at stream position i costs -log p, so ppl must be exactly 1/p if
    every target is scored once and only targets are scored."""

    def __init__(self, stream: torch.Tensor, vocab: int, p: float) -> None:
        self.stream, self.vocab, self.p = stream, vocab, p

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape
        logits = torch.full((b, t, self.vocab), math.log((1 - self.p) / (self.vocab - 1)))
        # Windows are slices of the stream: find each row's offset, then mark the true next tokens.
        for r in range(b):
            for off in range(self.stream.numel() - t + 1):
                if torch.equal(self.stream[off : off + t], x[r]):
                    break
            nxt = self.stream[off + 1 : off + t + 1]
            logits[r, torch.arange(nxt.numel()), nxt] = math.log(self.p)
        return logits


@pytest.mark.parametrize("n,context,stride", [(100, 16, None), (101, 16, 5), (33, 32, 32), (40, 8, 1)])
def test_perplexity_scores_every_target_once(n, context, stride):
    stream = torch.randperm(1000, generator=torch.Generator().manual_seed(n))[:n]  # distinct tokens
    assert perplexity(_Oracle(stream, 1000, 0.25), stream, context=context, stride=stride, batch_size=3) == (
        pytest.approx(4.0, rel=1e-5)  # float32 logits
    )
    uniform = lambda x: torch.zeros(*x.shape, 7)  # noqa: E731
    assert perplexity(uniform, stream % 7, context=context, stride=stride) == pytest.approx(7.0, rel=1e-6)


def test_perplexity_restores_training_mode_and_validates():
    cfg = LlamaConfig(16, 24, 1, 2, 1, 50, 32)
    m = Llama(cfg).train()
    ids = torch.randint(0, 50, (70,))
    perplexity(m, ids, context=16)
    assert m.training
    with pytest.raises(ValueError, match="stride"):
        perplexity(m, ids, context=16, stride=17)
    with pytest.raises(ValueError, match="1-D"):
        perplexity(m, ids[None], context=16)
