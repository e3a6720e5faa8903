"""Text files -> documents -> train/eval split by document -> token stream -> fixed-length blocks -> batches.

Document rules (``load_documents(path, kind="auto")``):
  * ``"lines"``: one document per non-empty line (TinyStories sample: one story per line, no blank lines);
  * ``"endoftext"``: documents separated by ``<|endoftext|>`` (the TinyStories release files);
  * ``"wikitext"``: one document per article; an article starts at a top-level heading line
    `` = Title = `` (exactly one ``=`` each side; `` = = Section = = `` lines stay inside the article).
    Text before the first heading, if any, is a document of its own;
  * ``"blank"``: documents separated by one or more blank lines (e.g. tinyshakespeare's speeches).
``"auto"`` picks ``wikitext`` if a top-level heading line exists, else ``endoftext`` if the marker occurs,
else ``blank`` if there is a blank line, else ``lines``. JSON Lines, JSON and Parquet files are records
instead, one document each (``patchc.job.records``: a text field or a chat); ``.gz`` files are read
decompressed. Line endings are normalised to ``\\n`` and each document is stripped of surrounding
whitespace; empty documents are dropped.

Example:
    >>> docs = load_documents(SHARED_DIR / "data/tinystories_sample.txt")       # 19 stories
    >>> train_docs, eval_docs = split_documents(docs, eval_fraction=0.2, seed=0)
    >>> blocks = pack_blocks(tokenize_documents(train_docs, tok), block_len=129)  # (n, 129) long
    >>> batch = get_batch(blocks, batch_size=8, step=17, seed=0)                  # the batch of step 17
"""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from patchc.job.records import Chat, is_records, record_documents

_WIKI_HEADING = re.compile(r"^ ?= [^=](?:.*[^=])? = ?$")
KINDS = ("auto", "lines", "endoftext", "wikitext", "blank")


def _detect_kind(text: str) -> str:
    if any(_WIKI_HEADING.match(line) for line in text.split("\n")):
        return "wikitext"
    if "<|endoftext|>" in text:
        return "endoftext"
    if re.search(r"\n[ \t]*\n", text.strip()):
        return "blank"
    return "lines"


def split_text(text: str, kind: str = "auto") -> list[str]:
    """Split a whole text into documents by the rule `kind` (see the module docstring).

    Example:
        >>> split_text("a\\nb\\n")
        ['a', 'b']
    """
    if kind not in KINDS:
        raise ValueError(f"unknown document kind {kind!r}; use one of {KINDS}")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if kind == "auto":
        kind = _detect_kind(text)
    if kind == "lines":
        parts = text.split("\n")
    elif kind == "endoftext":
        parts = text.split("<|endoftext|>")
    elif kind == "blank":
        parts = re.split(r"\n[ \t]*\n", text)
    else:  # wikitext
        parts, current = [], []
        for line in text.split("\n"):
            if _WIKI_HEADING.match(line) and current:
                parts.append("\n".join(current))
                current = []
            current.append(line)
        parts.append("\n".join(current))
    return [p.strip() for p in parts if p.strip()]


def read_text(path: Path, encoding: str = "utf-8") -> str:
    """The file's text (gunzipped for .gz); a decoding error names the file, line and byte, and the way out
    (--encoding)."""
    raw = path.read_bytes()
    if path.name.lower().endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: not a readable gzip file ({e})") from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}: line {line} (byte {e.start}) is not valid {encoding} ({e.reason}); "
                         "pass the file's --encoding (e.g. latin-1)") from None


def load_documents(path: str | os.PathLike, kind: str = "auto", encoding: str = "utf-8", field: str | None = None,
                   chat: Chat | None = None) -> list[str]:
    """Read a text file (UTF-8 unless told) and split it into documents (rules in the module docstring).

    `field` and `chat` are for records (`patchc.job.records.record_documents`): the text field to read, and
    how a chat becomes text (`chat_renderer(tokenizer)`; None joins its turns).

    Example:
        >>> len(load_documents(SHARED_DIR / "data/tinystories_sample.txt"))
        19
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    parquet = kind == "auto" and path.suffix.lower() == ".parquet"
    text = None if parquet else read_text(path, encoding)
    records = parquet or (kind == "auto" and is_records(path, text))
    docs = record_documents(path, text, field, chat) if records else split_text(text, kind)
    if not docs:
        what = "every record's text is empty" if records else "the file is empty or whitespace only"
        raise ValueError(f"{path}: no documents ({what})")
    return docs


def split_documents(
    docs: Sequence[str], eval_fraction: float, seed: int = 0, dedupe: bool = True, where: str = "the text"
) -> tuple[list[str], list[str]]:
    """Split documents (not tokens) into (train, eval), deterministically for a given seed.

    round(eval_fraction * n) documents (at least 1 when eval_fraction > 0, at most n - 1) go to eval,
    chosen by a seeded shuffle; both parts keep the original document order. With `dedupe`, exact
    duplicate documents are dropped first (keeping the first), so no text appears in both parts. `where`
    names the documents' source in the error for fewer than 2 of them.

    Example:
        >>> split_documents(["a", "b", "c", "d"], eval_fraction=0.25, seed=0)
        (['a', 'b', 'd'], ['c'])
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if dedupe:
        docs = list(dict.fromkeys(docs))
    n = len(docs)
    n_eval = 0 if eval_fraction == 0 else min(max(1, round(eval_fraction * n)), n - 1)
    if eval_fraction > 0 and n < 2:
        raise ValueError(f"{where}: holds {'one document' if n else 'no documents'} (documents are lines, or blocks "
                         "between blank lines, <|endoftext|> markers or ' = Title = ' headings), so none can be "
                         "held out for evaluation; give more documents or files (a text to score unsplit goes to "
                         "`patchc prune --eval-data` or `patchc eval --text`)")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_idx = set(order[:n_eval])
    train = [d for i, d in enumerate(docs) if i not in eval_idx]
    evals = [d for i, d in enumerate(docs) if i in eval_idx]
    return train, evals


def split_files(
    paths: Sequence[str | os.PathLike], eval_fraction: float, seed: int = 0, kind: str = "auto",
    encoding: str = "utf-8", field: str | None = None, chat: Chat | None = None,
) -> tuple[list[str], list[str]]:
    """Load each file's documents and split them (`split_documents`) file by file; the parts are joined in
    file order, so every file gives its own share of held-out documents.

    Example:
        >>> train_docs, eval_docs = split_files([SHARED_DIR / "data/tinystories_sample.txt"], 0.2)
        >>> len(train_docs), len(eval_docs)
        (14, 3)
    """
    train: list[str] = []
    evals: list[str] = []
    for path in paths:
        docs = load_documents(path, kind, encoding, field, chat)
        part_train, part_eval = split_documents(docs, eval_fraction, seed, where=str(path))
        train += part_train
        evals += part_eval
    return train, evals


def _as_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` with llama2.c's ``encode(text, bos=, eos=)``: a raw Hugging Face tokenizer is wrapped
    in `patchc.models.bundle.HFTokenizer`, so both kinds encode by the same code."""
    # A patchc tokenizer has `bos_id`; a Hugging Face one has `bos_token_id` instead.
    if hasattr(tokenizer, "bos_token_id") and not hasattr(tokenizer, "bos_id"):
        # Imported here: patchc.models.bundle pulls in the model loaders, which plain text handling needs not.
        from patchc.models.bundle import HFTokenizer

        return HFTokenizer(tokenizer, "causal")
    return tokenizer


def tokenize_documents(docs: Sequence[str], tokenizer: Any, bos: bool = True,
                       max_tokens: int | None = None) -> torch.Tensor:
    """Concatenate the token ids of all documents (each starting with BOS) into one 1-D LongTensor.

    `tokenizer` is a `patchc.models.llama2c.Tokenizer` or a Hugging Face tokenizer (its BOS, else EOS,
    token marks document starts). `max_tokens` keeps the first that many ids and stops encoding once it
    has them (a 1 MB file scored on its first 16K tokens is not tokenized whole).

    Example:
        >>> tokenize_documents(["Hello", "World"], tok)[:3]
        tensor([  1, ...])
    """
    tokenizer = _as_tokenizer(tokenizer)
    out: list[int] = []
    for doc in docs:
        if max_tokens is not None and len(out) >= max_tokens:
            break
        out.extend(tokenizer.encode(doc, bos=bos, eos=False))
    return torch.tensor(out[:max_tokens], dtype=torch.long)


def pack_blocks(ids: torch.Tensor, block_len: int, source: str | os.PathLike | None = None) -> torch.Tensor:
    """Cut a 1-D token stream into contiguous (n_blocks, block_len) rows, dropping the ragged tail.

    Raises ValueError naming `source` (a file name, for the message) if there is not one full block.

    Example:
        >>> pack_blocks(torch.arange(10), 4)
        tensor([[0, 1, 2, 3],
                [4, 5, 6, 7]])
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if block_len < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len}")
    n_blocks = ids.numel() // block_len
    if n_blocks == 0:
        where = f"{source}: " if source is not None else ""
        raise ValueError(
            f"{where}text too short: {ids.numel()} tokens, need at least block_len={block_len} for one block; "
            "use a longer text or a smaller block_len"
        )
    return ids[: n_blocks * block_len].reshape(n_blocks, block_len).long()


def pack_documents(docs: Sequence[str], tokenizer: Any, block_len: int, source: str | os.PathLike | None = None,
                   bos: bool = True) -> torch.Tensor:
    """`tokenize_documents` then `pack_blocks`: the training blocks of a list of documents.

    Example:
        >>> pack_documents(train_docs, tok, block_len=129, source="stories.txt").shape[1]
        129
    """
    return pack_blocks(tokenize_documents(docs, tokenizer, bos=bos), block_len, source=source)


@dataclass(frozen=True, eq=False)
class TextData:
    """A text file split by document: train blocks for training, the eval token stream for perplexity."""

    source: str
    train_docs: list[str]
    eval_docs: list[str]
    train_blocks: torch.Tensor  # (n_blocks, block_len) long
    eval_ids: torch.Tensor  # 1-D long, BOS at each document start


def load_text_data(
    path: str | os.PathLike,
    tokenizer: Any,
    block_len: int,
    eval_fraction: float = 0.1,
    seed: int = 0,
    kind: str = "auto",
) -> TextData:
    """load_documents -> split_documents -> tokenize -> pack the train part into blocks.

    Example:
        >>> data = load_text_data(SHARED_DIR / "data/wikitext2_raw_test.txt", tok, block_len=129)
        >>> data.train_blocks.shape, data.eval_ids.shape
    """
    train_docs, eval_docs = split_files([path], eval_fraction, seed, kind)
    train_blocks = pack_documents(train_docs, tokenizer, block_len, source=f"{path} (train part)")
    eval_ids = tokenize_documents(eval_docs, tokenizer)
    return TextData(str(path), train_docs, eval_docs, train_blocks, eval_ids)


def doc_hashes(docs: Sequence[str]) -> list[str]:
    """A short stable id per document (12 hex digits of sha256): plans record their training documents so
    `patchc eval` can refuse to score a plan on text it was trained on."""
    return [hashlib.sha256(d.encode()).hexdigest()[:12] for d in docs]


def _seed_for(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"patchc.data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@lru_cache(maxsize=8)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_seed_for(seed, epoch))
    return torch.randperm(n, generator=gen)


def batch_indices(n_blocks: int, batch_size: int, step: int, seed: int = 0) -> torch.Tensor:
    """Row indices of the batch of optimizer step `step`: a fresh seeded permutation per epoch,
    consumed in order, so batches depend only on (n_blocks, batch_size, step, seed).

    Example:
        >>> batch_indices(10, 4, step=0, seed=0).shape
        torch.Size([4])
    """
    if n_blocks < 1 or batch_size < 1 or step < 0:
        raise ValueError(f"need n_blocks >= 1, batch_size >= 1, step >= 0; got {n_blocks}, {batch_size}, {step}")
    first = step * batch_size
    idx = []
    for s in range(first, first + batch_size):
        epoch, pos = divmod(s, n_blocks)
        idx.append(int(_epoch_order(n_blocks, seed, epoch)[pos]))
    return torch.tensor(idx, dtype=torch.long)


def get_batch(blocks: torch.Tensor, batch_size: int, step: int, seed: int = 0) -> torch.Tensor:
    """The (batch_size, block_len) batch for optimizer step `step` (deterministic, so resume is exact).

    Example:
        >>> get_batch(blocks, 8, step=100, seed=0)   # same tensor in a resumed run
    """
    return blocks[batch_indices(blocks.shape[0], batch_size, step, seed)]


def batch_iterator(
    blocks: torch.Tensor, batch_size: int, seed: int = 0, start_step: int = 0, steps: int | None = None
) -> Iterator[torch.Tensor]:
    """Yield get_batch(blocks, batch_size, step, seed) for step = start_step, start_step + 1, ...
    (`steps` batches, or forever). Resuming at step k yields what the original run saw from step k.

    Example:
        >>> it = batch_iterator(blocks, 8, seed=0, start_step=50)
        >>> torch.equal(next(it), get_batch(blocks, 8, 50, seed=0))
        True
    """
    step = start_step
    while steps is None or step < start_step + steps:
        yield get_batch(blocks, batch_size, step, seed)
        step += 1


def batch_fn(blocks: torch.Tensor, batch_size: int, seed: int = 0):
    """A step -> batch callable, the form `patchc.train_masks` takes.

    Example:
        >>> patchc.train_masks(prog, batch_fn(blocks, 8, seed=0), patchc.lm_loss, steps=300)
    """
    return lambda step: get_batch(blocks, batch_size, step, seed)


__all__ = [
    "KINDS",
    "split_text",
    "load_documents",
    "split_documents",
    "split_files",
    "doc_hashes",
    "tokenize_documents",
    "pack_blocks",
    "pack_documents",
    "TextData",
    "load_text_data",
    "batch_indices",
    "get_batch",
    "batch_iterator",
    "batch_fn",
]
