"""Records files (JSON Lines, JSON, Parquet; text fields and chats) as the job's documents."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from patchc.job.corpus import load_data
from patchc.job.data import load_documents, split_files
from patchc.job.options import DEFAULT_DATA, PruneOptions
from patchc.job.records import chat_renderer, is_records, record_documents
from patchc.job.rescore import eval_options

CHAT = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}]
TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


@pytest.fixture
def tokenizer():
    """A Hugging Face tokenizer with a chat template that starts with its BOS text."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def test_jsonl_text_records_are_documents_in_order(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "one\n\ntwo", "id": 1}, {"text": ""}, {"text": None},
                                              {"text": " three "}, {"text": ["four", "five"]}])
    # one record, one document: blank lines stay inside, a list of paragraphs is joined by them
    assert load_documents(path) == ["one\n\ntwo", "three", "four\n\nfive"]


def test_records_are_found_by_suffix_or_first_line(tmp_path):
    assert is_records("x.jsonl.gz", None) and is_records("x.PARQUET", None) and is_records("x.json", None)
    assert not is_records("x.txt", "Once upon a time.\n{not json}\n")
    assert not is_records("x.txt", "{not: json}\n") and not is_records("x.txt", "[1, 2]\n")
    # JSON Lines saved as .txt: read as records, not as lines of braces and keys
    path = write_jsonl(tmp_path / "a.txt", [{"text": "one"}, {"text": "two"}])
    assert load_documents(path) == ["one", "two"]
    assert load_documents(path, kind="lines") == [json.dumps({"text": "one"}), json.dumps({"text": "two"})]


def test_gzip_files_read_decompressed(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl.gz", [{"text": "one"}, {"text": "two"}], opener=gzip.open)
    assert load_documents(path) == ["one", "two"]
    plain = tmp_path / "b.txt.gz"
    plain.write_bytes(gzip.compress("first story\nsecond story\n".encode()))
    assert load_documents(plain) == ["first story", "second story"]
    broken = tmp_path / "c.txt.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"c\.txt\.gz: not a readable gzip file"):
        load_documents(broken)


def test_json_list_and_datasets_to_json(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"text": "one"}, {"text": "two"}], indent=2))
    assert load_documents(listed) == ["one", "two"]
    lines = write_jsonl(tmp_path / "lines.json", [{"text": "one"}, {"text": "two"}])  # datasets' to_json default
    assert load_documents(lines) == ["one", "two"]


def test_text_field_chooses_the_field(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"story": "one", "text": "not this"}, {"story": "two"}])
    assert load_documents(path, field="story") == ["one", "two"]
    with pytest.raises(ValueError, match=r"a\.jsonl: line 2: no 'text' field in a record with keys \['story'\]; "
                                         r"--text-field 'text' is not among them"):
        load_documents(path, field="text")
    with pytest.raises(ValueError, match=r"line 1: no 'text' / 'messages' / 'conversations' field .*\['id', "
                                         r"'story'\]; name the text with --text-field"):
        load_documents(write_jsonl(tmp_path / "b.jsonl", [{"story": "one", "id": 3}]))


def test_chats_use_the_chat_template_without_a_second_bos(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    (doc,) = load_documents(path, chat=chat_renderer(tokenizer))
    assert doc == "<|user|> the cat\n<|assistant|> sat on the mat"  # the template's "<s>" is dropped
    assert tokenizer.apply_chat_template(CHAT, tokenize=False).startswith("<s>")
    assert load_documents(path) == ["the cat\n\nsat on the mat"]  # no template: the turns' texts


def test_sharegpt_and_multimodal_turns(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}]},
    ])
    seen = []
    assert load_documents(path, chat=lambda c: seen.append(c) or "x") == ["x", "x"]
    assert seen[0] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert load_documents(path) == ["hi\n\nhello", "what is it"]


def test_bad_records_name_the_file_and_place(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is not a JSON object .*one record per line"):
        load_documents(bad)
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"data": [{"text": "a"}], "version": 1}, indent=2))
    with pytest.raises(ValueError, match=r"one\.json: line 1 .*one JSON value \(\['data', 'version'\]\), not records"):
        load_documents(one)
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"text": "a"}, "b"]))
    with pytest.raises(ValueError, match=r"list\.json: record 2: a record is a JSON object, got str"):
        load_documents(listed)
    turns = write_jsonl(tmp_path / "turns.jsonl", [{"messages": [{"speaker": "a", "said": "b"}]}])
    with pytest.raises(ValueError, match=r"turns\.jsonl: line 1: a chat turn needs role and content .*\['said', "
                                         r"'speaker'\]"):
        load_documents(turns)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(ValueError, match=r"chat\.jsonl: line 1: the chat template refused this chat: .*alternate"):
        load_documents(chat, chat=chat_renderer(tokenizer))
    number = write_jsonl(tmp_path / "number.jsonl", [{"text": 3}])
    with pytest.raises(ValueError, match=r"number\.jsonl: line 1: 'text' holds '3'; a record's text is a string"):
        load_documents(number)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": [{"role": "user", "content": "a"}, "b"]}])
    with pytest.raises(ValueError, match=r"mixed\.jsonl: line 1: a chat is a list of turns .*holding \['str'\]"):
        load_documents(mixed)
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}])
    with pytest.raises(ValueError, match=r"empty\.jsonl: no documents \(every record's text is empty\)"):
        load_documents(empty)


def test_parquet_records(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["one", "", "two"], "n": [1, 2, 3]}), path)
    assert load_documents(path) == ["one", "two"]
    pq.write_table(pa.table({"messages": [CHAT]}), tmp_path / "chat.parquet")
    assert load_documents(tmp_path / "chat.parquet") == ["the cat\n\nsat on the mat"]
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as without pyarrow
    with pytest.raises(ImportError, match=r"a\.parquet: reading Parquet needs pyarrow \(pip install pyarrow\)"):
        load_documents(path)


def test_records_split_and_score_as_the_same_text_file(tmp_path):
    """The TinyStories sample as JSON Lines: the same documents, split, held-out ids and recorded split."""
    from patchc.job.corpus import data_record
    from patchc.models import load_model

    docs = load_documents(DEFAULT_DATA[0])
    path = write_jsonl(tmp_path / "stories.jsonl", [{"text": d} for d in docs])
    assert split_files([path], 0.2, 3) == split_files(DEFAULT_DATA, 0.2, 3)
    bundle = load_model(PruneOptions().model)
    as_text = load_data(bundle, PruneOptions(eval_data=()), training=False)
    as_records = load_data(bundle, PruneOptions(data=(str(path),), eval_data=(), text_field="text"), training=False)
    assert as_records["eval"].equal(as_text["eval"])
    record = data_record({"self_tokens": 0, "train_hashes": [], "train_extra_hashes": []},
                         PruneOptions(data=(str(path),), text_field="text"))
    assert record["text_field"] == "text"  # `patchc eval` and `patchc recover` read the records the same way
    plan = type("Plan", (), {"meta": {"data": record}})()
    assert eval_options(plan).text_field == "text"
    with pytest.raises(ValueError, match="--text-field must name a field"):
        PruneOptions(text_field=" ")


def test_record_documents_from_text():
    assert record_documents("a.jsonl", '{"text": "one"}\n\n{"text": "two"}\n') == ["one", "two"]
