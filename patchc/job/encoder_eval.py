"""Judging and training masks on a sentence encoder (all-MiniLM-L6-v2), which has no LM head.

An encoder has no perplexity: a pruned copy is judged by how close its sentence embeddings stay to
the dense model's on held-out sentences (`embedding_agreement`), and its masks are trained by
distillation from the dense model (`distillation_loss`, `make_distill_loss`).

Example:
    >>> from patchc.models import load_model
    >>> from patchc.job.encoder_eval import sentences_from_docs, encode_batches, embedding_agreement
    >>> b = load_model("minilm")
    >>> sents = sentences_from_docs(eval_docs, max_sentences=512)
    >>> dense = b.embed(b.model, sents)
    >>> embedding_agreement(dense, b.embed(pruned_model, sents))
    {'cosine': 0.97..., 'retrieval_agreement': 0.9...}
    >>> batches = encode_batches(b, train_sents, max_len=128, batch_size=8)   # [{"input_ids", "attention_mask"}, ...]
    >>> loss_fn = make_distill_loss(b, b.model)                                # loss_fn(prog, batches[0])
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from patchc.models.hf import hidden_of, mean_pool
from patchc.models.outputs import device_of

# A sentence ends at . ! or ? (optionally followed by a closing quote/bracket) before whitespace and
# an upper-case letter, digit or opening quote. WikiText writes "season . The" (space before the
# period), so whitespace may precede it; the [^@] guard keeps its " @.@ " decimal marks ("1 @.@ 5")
# from ending a sentence.
_SENTENCE_END = re.compile(r"(?<=[^@][.!?])\s+(?=[\"'(\[A-Z0-9])|(?<=[^@][.!?][\"')\]])\s+(?=[\"'(\[A-Z0-9])")
# WikiText headings (" = Title = ", " = = Section = = ") are not sentences.
_HEADING = re.compile(r"^\s*=.*=\s*$")


def _split_sentences(doc: str) -> list[str]:
    out = []
    for line in doc.replace("\r", "\n").split("\n"):
        if not line.strip() or _HEADING.match(line):
            continue
        for piece in _SENTENCE_END.split(line):
            piece = " ".join(piece.split())
            if piece:
                out.append(piece)
    return out


def sentences_from_docs(docs: Sequence[str], max_sentences: int | None, min_words: int = 4) -> list[str]:
    """Split documents into sentences: deterministic, deduplicated, at least `min_words` words each.

    Sentences are taken round-robin across documents (the first sentence of every document, then
    the second, ...), so a cap of `max_sentences` still samples every document instead of
    exhausting the first one. Exact duplicates are dropped: a duplicate would be its own nearest
    neighbour and make retrieval agreement meaningless. Headings of WikiText are skipped.

    Example:
        >>> sentences_from_docs(["The cat sat on the mat. It was warm there!", "A dog ran to the park."], 2)
        ['The cat sat on the mat.', 'A dog ran to the park.']
    """
    if max_sentences is not None and max_sentences < 0:
        raise ValueError(f"max_sentences must be >= 0 or None, got {max_sentences}")
    per_doc = [[s for s in _split_sentences(d) if len(s.split()) >= min_words] for d in docs]
    out: list[str] = []
    seen: set[str] = set()
    depth = max((len(s) for s in per_doc), default=0)
    for i in range(depth):
        for sents in per_doc:
            if i < len(sents) and sents[i] not in seen:
                if max_sentences is not None and len(out) >= max_sentences:
                    return out
                seen.add(sents[i])
                out.append(sents[i])
    return out


def embedding_agreement(dense_embed: torch.Tensor, pruned_embed: torch.Tensor) -> dict[str, float]:
    """How close pruned sentence embeddings stay to the dense ones (same sentences, same order).

    * ``cosine``: mean cosine similarity of matching rows (1.0 = identical directions);
    * ``retrieval_agreement``: fraction of sentences whose nearest neighbour (cosine, itself excluded)
      among the pruned embeddings is the same sentence as among the dense ones.

    Example:
        >>> e = torch.nn.functional.normalize(torch.randn(10, 8), dim=-1)
        >>> embedding_agreement(e, e)
        {'cosine': 1.0, 'retrieval_agreement': 1.0}
    """
    if dense_embed.dim() != 2 or dense_embed.shape != pruned_embed.shape:
        raise ValueError(
            f"embedding_agreement: need two (n, H) tensors of the same shape, got {tuple(dense_embed.shape)} "
            f"and {tuple(pruned_embed.shape)}"
        )
    n = dense_embed.shape[0]
    if n < 2:
        raise ValueError(f"embedding_agreement: need at least 2 sentences for nearest neighbours, got {n}")
    # float64 on the CPU: argmax ties between near-equal similarities should not depend on the device.
    d = F.normalize(dense_embed.detach().double().cpu(), dim=-1)
    p = F.normalize(pruned_embed.detach().double().cpu(), dim=-1)
    cosine = (d * p).sum(-1).mean().item()
    eye = torch.eye(n, dtype=torch.bool)
    nn_dense = (d @ d.T).masked_fill(eye, float("-inf")).argmax(-1)
    nn_pruned = (p @ p.T).masked_fill(eye, float("-inf")).argmax(-1)
    retrieval = (nn_dense == nn_pruned).double().mean().item()
    return {"cosine": float(min(cosine, 1.0)), "retrieval_agreement": float(retrieval)}


def dense_embeddings(bundle: Any, data: dict) -> dict[str, Any]:
    """The dense model's embeddings of the held-out sentences ("eval") and of each --eval-data file's
    sentences ("extra", by path): what `score_embeddings` compares a pruned copy with."""
    return {"eval": bundle.embed(bundle.model, data["eval"]),
            "extra": {path: bundle.embed(bundle.model, sentences) for path, sentences in data["extra"].items()}}


def score_embeddings(bundle: Any, model: nn.Module, data: dict, dense: dict[str, Any] | None) -> dict[str, Any]:
    """`embedding_agreement` on the held-out sentences, plus the mean cosine on each --eval-data file
    under "extra" (keyed by file name). `dense`: `dense_embeddings(bundle, data)`."""
    if dense is None:
        raise ValueError(f"{getattr(bundle, 'name', 'encoder')} is scored against the dense embeddings: pass "
                         "dense_embeddings(bundle, data)")
    metrics: dict[str, Any] = embedding_agreement(dense["eval"], bundle.embed(model, data["eval"]))
    metrics["extra"] = {Path(path).name: embedding_agreement(dense["extra"][path], bundle.embed(model, sents))["cosine"]
                        for path, sents in data["extra"].items()}
    return metrics


def distillation_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    token_weight: float = 1.0,
) -> torch.Tensor:
    """Encoder training loss: embedding cosine distance + token-state distance, both on unit vectors.

        L = mean_b (1 - cos(pool(S_b), pool(T_b)))  +  token_weight * mean_{valid tokens} ||Ŝ_bt - T̂_bt||²

    with pool = mean over the attention mask (what all-MiniLM-L6-v2's embedding is) and ^ = L2
    normalisation over the hidden size. Why both: the first term is exactly what the evaluation
    measures; the second gives every token a gradient (a pooled mean alone lets token errors cancel),
    and normalising makes it scale-free so it neither needs tuning per model nor dominates the first
    (||â - b̂||² = 2 - 2·cos, so both terms live in [0, 2] and [0, 4]). Padding tokens are ignored.

    Example:
        >>> h = torch.randn(2, 5, 8); m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
        >>> distillation_loss(h, h, m).item()
        0.0
    """
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(f"distillation_loss: student {tuple(student_hidden.shape)} vs teacher {tuple(teacher_hidden.shape)}")
    s, t = student_hidden.float(), teacher_hidden.float()
    mask = attention_mask.to(s.device)
    embed_term = 1.0 - F.cosine_similarity(mean_pool(s, mask), mean_pool(t, mask), dim=-1)
    return embed_term.mean() + token_weight * _token_distance(s, t, mask)


def _token_distance(student: torch.Tensor, teacher: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens of ||Ŝ - T̂||² (unit vectors over the hidden size), in fp32."""
    token_sq = (F.normalize(student.float(), dim=-1) - F.normalize(teacher.float(), dim=-1)).pow(2).sum(-1)
    m = attention_mask.to(token_sq.device, torch.float32)
    return (token_sq * m).sum() / m.sum().clamp(min=1.0)


def layerwise_distillation_loss(
    student_states: Sequence[torch.Tensor],
    teacher_states: Sequence[torch.Tensor],
    attention_mask: torch.Tensor,
    token_weight: float = 1.0,
) -> torch.Tensor:
    """`distillation_loss` on the last layer, plus its token-state term on every earlier layer.

    Why: a layer that drifts from the dense one is told so where it happens, instead of through every
    layer above it. All terms are distances of unit vectors, so no layer needs its own weight.

    Example:
        >>> h = [torch.randn(2, 5, 8) for _ in range(3)]; m = torch.ones(2, 5)
        >>> layerwise_distillation_loss(h, h, m).item()
        0.0
    """
    if len(student_states) != len(teacher_states) or not student_states:
        raise ValueError(f"layerwise_distillation_loss: {len(student_states)} student and {len(teacher_states)} "
                         "teacher layers; need the same number, at least one")
    loss = distillation_loss(student_states[-1], teacher_states[-1], attention_mask, token_weight)
    for s, t in zip(student_states[:-1], teacher_states[:-1]):
        loss = loss + token_weight * _token_distance(s, t, attention_mask)
    return loss


def make_distill_loss(bundle: Any, teacher_model: nn.Module, token_weight: float = 1.0,
                      layers: bool = False) -> Callable[[Any, dict], torch.Tensor]:
    """A ``loss_fn(model, batch)``: distil `teacher_model` into `model` (a masked program, or a pruned copy).

    `batch` is a dict ``{"input_ids", "attention_mask"}`` (see `encode_batches`); it is moved to the
    teacher's device. The teacher runs under ``no_grad``. ``layers=True`` distils every layer's token
    states (`layerwise_distillation_loss`); both models must then have ``layer_states(ids, mask)``, as
    `EncoderWrapper` has (weight recovery trains one) and an exported program has not (mask training).

    Example:
        >>> loss_fn = make_distill_loss(bundle, bundle.model)
        >>> patchc.train_masks(prog, lambda t: batches[t % len(batches)], loss_fn, steps=100)
    """
    if getattr(bundle, "kind", "encoder") != "encoder":
        raise TypeError(f"make_distill_loss: {getattr(bundle, 'name', 'model')} is a {bundle.kind} model, not an encoder")
    fallback = getattr(bundle, "device", "cpu")

    def states(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Sequence[torch.Tensor]:
        if not layers:
            return [hidden_of(model(ids, mask))]
        if not callable(getattr(model, "layer_states", None)):
            raise TypeError(f"make_distill_loss(layers=True): {type(model).__name__} has no layer_states(ids, mask) "
                            "(an exported program returns only its last layer); use layers=False")
        return model.layer_states(ids, mask)

    def loss_fn(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dev = device_of(teacher_model, fallback)
        ids = batch["input_ids"].to(dev)
        mask = batch["attention_mask"].to(dev)
        with torch.no_grad():
            teacher = states(teacher_model, ids, mask)
        return layerwise_distillation_loss(states(model, ids, mask), teacher, mask, token_weight=token_weight)

    return loss_fn


def encode_batches(bundle: Any, sentences: Sequence[str], max_len: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Tokenise sentences into padded batches ``{"input_ids": (B, T), "attention_mask": (B, T)}`` (CPU, long).

    Sentences keep their order; each batch is padded to its longest member and truncated at
    ``min(max_len, bundle.block_len_limit)``; the last batch may be smaller. Only these two keys are
    produced, so ``model(**batch)`` (calibration) and ``model(ids, mask)`` both work.

    Example:
        >>> encode_batches(bundle, ["A cat.", "A dog ran off."], max_len=32, batch_size=2)[0]["input_ids"].shape
        torch.Size([2, 6])
    """
    if batch_size < 1 or max_len < 2:
        raise ValueError(f"encode_batches: need batch_size >= 1 and max_len >= 2, got {batch_size}, {max_len}")
    hf_tok = getattr(bundle, "hf_tokenizer", None) or getattr(getattr(bundle, "tokenizer", None), "hf", None)
    if hf_tok is None:
        raise ValueError(f"encode_batches: {getattr(bundle, 'name', 'model')} has no Hugging Face tokenizer")
    sentences = list(sentences)
    if not sentences:
        raise ValueError(f"encode_batches: no sentences for {getattr(bundle, 'name', 'model')}")
    limit = min(max_len, getattr(bundle, "block_len_limit", max_len))
    out = []
    for i in range(0, len(sentences), batch_size):
        enc = hf_tok(sentences[i : i + batch_size], padding=True, truncation=True, max_length=limit, return_tensors="pt")
        out.append({"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long()})
    return out


def splice_sentences(sentences: Sequence[str], fraction: float, seed: int | str, pool: Sequence[str] | None = None,
                     swap: float = 0.15) -> list[str]:
    """`sentences` with about `fraction` of them replaced by new inputs: the head of the sentence, the tail of
    a sentence of `pool` (default: `sentences`), and `swap` of the words exchanged for words of `pool` (the
    TinyBERT idea: a distilled student learns from any input the teacher labels, so fresh inputs keep it
    from fitting the few real ones). Deterministic in `seed`; uses no word beyond `sentences`' and `pool`'s.

    Example:
        >>> splice_sentences(["A cat sat on the mat.", "The dog ran off home."], fraction=1.0, seed=0)
        ['A ran off home.', 'sat dog home.']
    """
    if not 0.0 <= fraction <= 1.0 or not 0.0 <= swap <= 1.0:
        raise ValueError(f"splice_sentences: fraction and swap must be in [0, 1], got {fraction} and {swap}")
    rng = random.Random(seed)
    split = [s.split() for s in sentences]
    tails = [ws for ws in (split if pool is None else [s.split() for s in pool]) if ws]
    words = [w for ws in tails for w in ws]
    out = []
    for head in split:
        if rng.random() >= fraction or len(head) < 2:
            out.append(" ".join(head))
            continue
        tail = tails[rng.randrange(len(tails))]
        mixed = head[: rng.randint(1, len(head) - 1)] + tail[rng.randrange(len(tail)):]
        out.append(" ".join(rng.choice(words) if rng.random() < swap else w for w in mixed))
    return out


__all__ = ["dense_embeddings", "distillation_loss", "embedding_agreement", "encode_batches", "layerwise_distillation_loss",
           "make_distill_loss", "score_embeddings", "sentences_from_docs", "splice_sentences"]
