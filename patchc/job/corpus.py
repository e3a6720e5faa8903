"""The job's text: training blocks (real, self-generated, or both), held-out ids, extra evaluation texts.

    --data files ─ split by document (--split-seed) ─┬─ training documents ──> real training blocks ─┐
                                                      │        └─ first tokens = prompts ─> dense model writes --self-tokens ─┤─> train
                                                      └─ held-out documents ──> eval ids (never trained on, never prompts)
    --train-extra files ──> whole, training only (a file holding a held-out document is refused) ───────┘
    --eval-data files ──> scored unsplit on their first --eval-tokens tokens, a second view of generalisation

Example:
    >>> data = load_data(bundle, PruneOptions(), cache_dir=Path("runs/.cache"))
    >>> data["train"].shape, data["eval"].numel()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from patchc.job.options import PruneOptions
from patchc.job.records import Chat, chat_renderer


def check_text_files(opts: PruneOptions, eval_flag: str = "--eval-data", data_note: str = "") -> None:
    """Every text file the options name is a file: checked before the model loads (minutes, for a large
    one). `eval_flag` is the flag the eval files came from (`patchc eval` names them --text); `data_note` ends
    the message of a --data file."""
    for flag, paths, note in (("--data", opts.data, data_note), (eval_flag, opts.eval_data, ""),
                              ("--train-extra", opts.train_extra, "")):
        for path in paths:
            if why := not_a_text_file(path):
                raise FileNotFoundError(f"{flag} {path}: {why}{note}")


def not_a_text_file(path: str | Path) -> str:
    """Why `path` cannot be read as a text file ("" when it can)."""
    path = Path(path)
    if path.is_file():
        return ""
    if path.is_dir():
        return f"is a folder; name its files (e.g. {path / '*.txt'})"
    return "is not a regular file" if path.exists() else "no such file"


def load_data(bundle: Any, opts: PruneOptions, cache_dir: Path | None = None, training: bool = True) -> dict[str, Any]:
    """Held-out evaluation text always comes from --data; training text from it, from the dense model, or both.

    `cache_dir`: where self-generated text is cached (None: generate without caching). `training=False`
    (`patchc eval`): only the scored texts, {"eval", "extra"}; nothing is packed or generated for training.
    """
    from patchc.job.data import doc_hashes, pack_documents

    check_text_files(opts)
    chat = chat_renderer(bundle.tokenizer)
    docs_train, docs_eval = split_data(opts, chat)
    if not docs_eval:
        raise ValueError(f"--data {', '.join(opts.data)}: too few documents to hold any out for evaluation")
    source = ", ".join(opts.data)
    if not training:
        return scored_texts(bundle, opts, docs_eval, source)
    docs_extra = extra_training_documents(opts, docs_eval, chat)
    common = {"docs_train": len(docs_train), "docs_eval": len(docs_eval), "train_hashes": doc_hashes(docs_train),
              "train_extra_hashes": doc_hashes([d for docs in docs_extra.values() for d in docs])}
    if bundle.kind == "encoder":
        from patchc.job.encoder_eval import sentences_from_docs

        extra = [s for docs in docs_extra.values() for s in sentences_from_docs(docs, max_sentences=4096)]
        return {"train": sentences_from_docs(docs_train, max_sentences=4096) + extra,
                **scored_texts(bundle, opts, docs_eval, source), **common,
                "real_tokens": 0, "train_extra_tokens": len(extra), "self_tokens": 0, "self_cached": False}
    tokenizer = bundle.require_tokenizer()
    scored = scored_texts(bundle, opts, docs_eval, source)
    parts, real_tokens, self_tokens, cached = [], 0, 0, False
    if opts.train_data in ("real", "mix"):
        real = pack_documents(docs_train, tokenizer, opts.block_len + 1, source=source, bos=opts.bos)
        parts.append(real)
        real_tokens = real.numel()
    parts += [pack_documents(docs, tokenizer, opts.block_len + 1, source=path, bos=opts.bos)
              for path, docs in docs_extra.items()]
    extra_tokens = sum(p.numel() for p in parts) - real_tokens
    if opts.train_data in ("self", "mix"):
        generated, cached = self_generated(bundle, opts, docs_train, tokenizer, cache_dir)
        parts.append(generated)
        self_tokens = generated.numel()
    # self-only runs still saw the training documents' first tokens as prompts: their hashes stay recorded
    return {"train": torch.cat(parts), **scored, **common,
            "real_tokens": real_tokens, "train_extra_tokens": extra_tokens, "self_tokens": self_tokens, "self_cached": cached}


def scored_texts(bundle: Any, opts: PruneOptions, docs_eval: list[str], source: str) -> dict[str, Any]:
    """{"eval", "extra"}: the held-out documents and the --eval-data files, as `evaluate` reads them."""
    if bundle.kind == "encoder":
        from patchc.job.encoder_eval import sentences_from_docs

        return {"eval": sentences_from_docs(docs_eval, max_sentences=512), "extra": extra_sentences(opts)}
    from patchc.job.data import tokenize_documents

    tokenizer = bundle.require_tokenizer()
    eval_ids = tokenize_documents(docs_eval, tokenizer, bos=opts.bos)
    if eval_ids.numel() < 2:
        raise ValueError(f"--data {source}: the held-out part is too short to evaluate")
    return {"eval": eval_ids, "extra": extra_texts(opts, tokenizer)}


def split_data(opts: PruneOptions, chat: Chat | None = None) -> tuple[list[str], list[str]]:
    """(training, held-out) documents of the --data files, split as the options say (`split_files`)."""
    from patchc.job.data import split_files

    return split_files(opts.data, opts.eval_fraction, opts.split_seed, encoding=opts.encoding, field=opts.text_field,
                       chat=chat)


def read_documents(path: str, opts: PruneOptions, chat: Chat | None = None) -> list[str]:
    """A text or records file's documents, read as the options say (encoding, records' text field)."""
    from patchc.job.data import load_documents

    return load_documents(path, encoding=opts.encoding, field=opts.text_field, chat=chat)


def extra_training_documents(opts: PruneOptions, docs_eval: list[str],
                             chat: Chat | None = None) -> dict[str, list[str]]:
    """--train-extra files, each whole ({path: documents}); refuses a file holding a held-out document."""
    from patchc.job.data import doc_hashes

    held_out = set(doc_hashes(docs_eval))
    out = {}
    for path in opts.train_extra:
        docs = read_documents(path, opts, chat)
        if held_out & set(doc_hashes(docs)):
            raise ValueError(f"--train-extra {path} holds documents of --data's held-out split: the run would be "
                             "scored on text it trained on; remove them from the file")
        out[path] = docs
    return out


def self_generated(bundle: Any, opts: PruneOptions, docs_train: list[str], tokenizer: Any,
                   cache_dir: Path | None) -> tuple[torch.Tensor, bool]:
    """The dense model's own text, prompted by the training documents' first tokens (cached)."""
    from patchc.job.selfdata import SelfDataSpec, prompts_from, self_generated_blocks

    spec = SelfDataSpec(tokens=opts.self_tokens, block_len=opts.block_len, seed=opts.split_seed,
                        temperature=opts.self_temperature, top_p=opts.self_top_p)
    prompts = prompts_from(docs_train, tokenizer, spec.prompt_len, bos=opts.bos)
    return self_generated_blocks(bundle, spec, prompts, cache_dir, progress=opts.progress)


def extra_texts(opts: PruneOptions, tokenizer: Any) -> dict[str, torch.Tensor]:
    """--eval-data files, each scored unsplit (BOS per document) on its first --eval-tokens tokens."""
    from patchc.job.data import tokenize_documents

    chat = chat_renderer(tokenizer)
    out = {}
    for path in opts.eval_data:
        ids = tokenize_documents(read_documents(path, opts, chat), tokenizer, bos=opts.bos, max_tokens=opts.eval_tokens)
        if ids.numel() < 2:
            raise ValueError(f"--eval-data {path}: too short to evaluate")
        out[path] = ids
    return out


def extra_sentences(opts: PruneOptions, max_sentences: int = 512) -> dict[str, list[str]]:
    """--eval-data files for an encoder: up to `max_sentences` sentences of each, taken across its documents."""
    from patchc.job.encoder_eval import sentences_from_docs

    out = {}
    for path in opts.eval_data:
        sentences = sentences_from_docs(read_documents(path, opts), max_sentences=max_sentences)
        if len(sentences) < 2:
            raise ValueError(f"--eval-data {path}: {len(sentences)} sentence(s) of 4 or more words; an encoder is "
                             "judged on at least 2 (nearest neighbours)")
        out[path] = sentences
    return out


def data_record(data: dict, opts: PruneOptions) -> dict:
    """The split a plan was trained on: files, split seed, fraction, encoding and its training documents' ids."""
    return {"files": [str(Path(p).resolve()) for p in opts.data], "seed": opts.split_seed,
            "eval_fraction": opts.eval_fraction, "encoding": opts.encoding, "text_field": opts.text_field,
            "bos": opts.bos,
            "train_data": opts.train_data, "self_tokens": data["self_tokens"], "train_documents": data["train_hashes"],
            "train_extra": [str(Path(p).resolve()) for p in opts.train_extra],
            "train_extra_documents": data["train_extra_hashes"]}


def text_size(kind: str, text: Any) -> int:
    """How much text a job's training or scored text holds: a causal LM's token ids, an encoder's sentences."""
    return int(text.numel()) if kind == "causal" else len(text)


def data_summary(bundle: Any, data: dict, opts: PruneOptions) -> dict:
    """report.json's "data": where training and evaluation text came from, and how much of each."""
    causal = bundle.kind == "causal"
    train = {"real": list(opts.data), "self": ["generated by the dense model"],
             "mix": [*opts.data, "generated by the dense model"]}[opts.train_data if causal else "real"]
    train += list(opts.train_extra)
    return {"train": train, "eval": list(opts.data), "eval_extra": list(opts.eval_data),
            "train_data": opts.train_data if causal else "real", "split_seed": opts.split_seed,
            "train_documents": data["docs_train"], "eval_documents": data["docs_eval"],
            "train_tokens": text_size(bundle.kind, data["train"]),
            "train_tokens_real": data["real_tokens"], "train_tokens_generated": data["self_tokens"],
            "train_tokens_extra": data["train_extra_tokens"],  # an encoder's: sentences
            "generated_from_cache": data["self_cached"],
            # an encoder's texts are lists of sentences: its counts are sentences (`text_size`)
            "eval_tokens": text_size(bundle.kind, data["eval"]),
            "eval_extra_tokens": {k: text_size(bundle.kind, v) for k, v in data["extra"].items()}}


__all__ = ["load_data", "data_record", "data_summary", "self_generated", "extra_texts", "extra_sentences",
           "read_documents", "scored_texts", "split_data", "text_size"]
