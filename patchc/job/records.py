"""JSON Lines, JSON and Parquet files -> documents: one record, one document.

    {"text": "Once upon a time ..."}                         the record's text field (`field`, default "text")
    {"messages": [{"role": "user", "content": "Hi"}, ...]}   a chat (also under "conversations", or ShareGPT's
    {"conversations": [{"from": "human", "value": "Hi"}]}    {"from", "value"} turns): rendered with the model's
                                                             chat template, else its turns joined by blank lines

A file is read as records when it ends in .jsonl, .ndjson, .json or .parquet (.gz for the text ones), or
when its first line is a JSON object: JSON Lines saved as .txt would otherwise train on its braces and keys.
A .json file holds one JSON list of records or, as `datasets.Dataset.to_json` writes it, JSON Lines.
Parquet needs pyarrow (`pip install pyarrow`).

Example:
    >>> record_documents("chats.jsonl", Path("chats.jsonl").read_text(), chat=chat_renderer(tokenizer))[0][:30]
    '<|im_start|>user\\nWhat is a til'
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = (".jsonl", ".ndjson", ".json")
CHAT_FIELDS = ("messages", "conversations")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}

Chat = Callable[[list[dict[str, Any]]], str]


def format_suffix(path: str | os.PathLike) -> str:
    """The file's format suffix, lower case, past a trailing .gz: "x.jsonl.gz" -> ".jsonl"."""
    name = Path(path).name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return Path(name).suffix


def is_records(path: str | os.PathLike, text: str | None) -> bool:
    """True for a records file: by its suffix, or (`text` given) when the first non-blank line is a JSON object."""
    if format_suffix(path) in (*TEXT_SUFFIXES, ".parquet"):
        return True
    if text is None:
        return False
    first = re.match(r"\s*([^\n]*)", text).group(1).strip()  # no copy of a large file
    if not first.startswith("{"):
        return False
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def parse_records(path: str | os.PathLike, text: str) -> Iterator[tuple[str, Any]]:
    """(where, record) of a JSON Lines text ("line 3"), or of one JSON list ("record 3")."""
    body = text.lstrip()
    if body.startswith("["):
        try:
            records = json.loads(body)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON at line {e.lineno} ({e.msg})") from None
        yield from ((f"record {i}", r) for i, r in enumerate(records, start=1))
        return
    for line, row in enumerate(text.split("\n"), start=1):
        if not row.strip():
            continue
        try:
            yield f"line {line}", json.loads(row)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {line} is not a JSON object ({e.msg}); {one_object(body)}") from None


def one_object(body: str) -> str:
    """What to say when JSON Lines do not parse: the whole file may be one object instead of records."""
    try:
        whole = json.loads(body)
    except json.JSONDecodeError:
        return "JSON Lines hold one record per line"
    keys = sorted(whole) if isinstance(whole, dict) else type(whole).__name__
    return f"the file is one JSON value ({keys}), not records: write a list of records or JSON Lines"


def parquet_records(path: str | os.PathLike, field: str | None) -> Iterator[tuple[str, Any]]:
    """("row 3", record) of a Parquet file; reads only the text column when it is known."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert the file "
                          "to JSON Lines") from None
    names = pq.read_schema(path).names
    wanted = [field] if field in names else [c for c in ("text", *CHAT_FIELDS) if c in names] or None
    rows = pq.read_table(path, columns=wanted).to_pylist()
    yield from ((f"row {i}", r) for i, r in enumerate(rows, start=1))


def turns(path: str | os.PathLike, where: str, chat: list) -> list[dict[str, Any]]:
    """A chat as [{"role", "content"}, ...]; ShareGPT's {"from", "value"} turns are renamed."""
    if not all(isinstance(t, dict) for t in chat):
        raise ValueError(f"{path}: {where}: a chat is a list of turns ({{\"role\", \"content\"}}), got a list "
                         f"holding {sorted({type(t).__name__ for t in chat if not isinstance(t, dict)})}")
    out = []
    for turn in chat:
        if "role" in turn and "content" in turn:
            out.append(turn)
        elif "from" in turn and "value" in turn:
            out.append({"role": SHAREGPT_ROLES.get(turn["from"], turn["from"]), "content": turn["value"]})
        else:
            raise ValueError(f"{path}: {where}: a chat turn needs role and content (or from and value), got "
                             f"keys {sorted(turn)}")
    return out


def content_text(content: Any) -> str:
    """A turn's text: its string, or the text parts of a multimodal content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def join_turns(chat: list[dict[str, Any]]) -> str:
    """A chat as plain text, for models without a chat template: the turns' texts between blank lines."""
    return "\n\n".join(t for t in (content_text(turn["content"]).strip() for turn in chat) if t)


def chat_renderer(tokenizer: Any) -> Chat | None:
    """The tokenizer's chat template as chat -> text, or None when it has none (a base model, llama2.c).

    The BOS text a template starts with is dropped: every document gets its BOS token when tokenised.
    """
    hf = getattr(tokenizer, "hf", tokenizer)
    if not getattr(hf, "chat_template", None):
        return None
    bos = getattr(hf, "bos_token", None)

    def render(chat: list[dict[str, Any]]) -> str:
        text = hf.apply_chat_template(chat, tokenize=False)
        return text[len(bos):] if bos and text.startswith(bos) else text

    return render


def record_text(path: str | os.PathLike, where: str, record: Any, field: str | None, chat: Chat | None) -> str:
    """One record's document: its `field` (text, paragraphs or chat), else "text", else a chat field."""
    if not isinstance(record, dict):
        raise ValueError(f"{path}: {where}: a record is a JSON object, got {type(record).__name__}")
    keys = [field] if field else ["text", *CHAT_FIELDS]
    key = next((k for k in keys if k in record), None)
    if key is None:
        hint = f"--text-field {field!r} is not among them" if field else "name the text with --text-field"
        raise ValueError(f"{path}: {where}: no {' / '.join(repr(k) for k in keys)} field in a record with keys "
                         f"{sorted(record)}; {hint}")
    value = record[key]
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):  # paragraphs
        return "\n\n".join(value)
    if not isinstance(value, list):
        raise ValueError(f"{path}: {where}: {key!r} holds {str(value)[:40]!r}; a record's text is a string, "
                         "a list of strings, or a chat (a list of role / content turns)")
    messages = turns(path, where, value)
    if chat is None:
        return join_turns(messages)
    try:
        return chat(messages)
    except Exception as e:  # a template's own checks (roles must alternate, ...) raise anything
        raise ValueError(f"{path}: {where}: the chat template refused this chat: {e}") from e


def record_documents(path: str | os.PathLike, text: str | None = None, field: str | None = None,
                     chat: Chat | None = None) -> list[str]:
    """The documents of a records file, in file order, empty ones dropped. `text`: the file's text (None for
    Parquet, which is read here).

    Example:
        >>> record_documents("a.jsonl", '{"text": "one"}\\n{"text": "two"}\\n')
        ['one', 'two']
    """
    rows = parquet_records(path, field) if text is None else parse_records(path, text)
    docs = (record_text(path, where, record, field, chat).strip() for where, record in rows)
    return [d for d in docs if d]


__all__ = ["chat_renderer", "is_records", "record_documents"]
