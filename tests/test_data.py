"""Text -> documents -> split -> tokens -> blocks -> batches."""

from __future__ import annotations

import pytest
import torch

from patchc.job.data import (
    batch_fn,
    batch_indices,
    batch_iterator,
    get_batch,
    load_documents,
    load_text_data,
    pack_blocks,
    split_documents,
    split_text,
    tokenize_documents,
)
from patchc.models import SHARED_DIR, STORIES260K_DIR, load_tokenizer

SAMPLE = SHARED_DIR / "data" / "tinystories_sample.txt"
WIKI = SHARED_DIR / "data" / "wikitext2_raw_test.txt"
needs_shared = pytest.mark.skipif(
    not (SAMPLE.is_file() and WIKI.is_file() and (STORIES260K_DIR / "tok512.bin").is_file()),
    reason=f"shared data not found under {SHARED_DIR} (set PATCHC_SHARED)",
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(STORIES260K_DIR / "tok512.bin")


# ------------------------------------------------------------------------------------------------ documents


def test_split_text_rules():
    assert split_text("one story.\nanother story.\n\r\n") == ["one story.", "another story."]  # lines
    assert split_text("a\nb<|endoftext|>\nc\n") == ["a\nb", "c"]
    assert split_text("A:\nhi.\n\nB:\nho.\n \nC:\nhey.") == ["A:\nhi.", "B:\nho.", "C:\nhey."]
    wiki = " \r\n = Alpha = \r\n\r\n Text a .\r\n\r\n = = Part = = \r\n\r\n More a .\r\n = B = \r\n Text b .\r\n"
    docs = split_text(wiki)
    assert docs == ["= Alpha = \n\n Text a .\n\n = = Part = = \n\n More a .", "= B = \n Text b ."]
    assert split_text(wiki, kind="lines")[0] == "= Alpha ="
    with pytest.raises(ValueError, match="kind"):
        split_text("x", kind="paragraphs")


@needs_shared
def test_load_real_documents():
    stories = load_documents(SAMPLE)
    assert len(stories) == 19  # one story per line
    assert all(s[0].isalpha() and s.rstrip()[-1] in '.!"' for s in stories)
    articles = load_documents(WIKI)
    assert len(articles) == 62  # 62 top-level " = Title = " headings in the WikiText-2 test split
    assert articles[0].startswith("= Robert Boulter =") and all(a.startswith("= ") for a in articles)
    assert "= = Career = =" in articles[0]
    with pytest.raises(FileNotFoundError, match="nothere.txt"):
        load_documents(SAMPLE.parent / "nothere.txt")


def test_empty_file_error(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("\n  \n")
    with pytest.raises(ValueError, match="empty.txt"):
        load_documents(p)


# ------------------------------------------------------------------------------------------------ split


def test_split_is_by_document_deterministic_and_disjoint():
    docs = [f"doc {i}" for i in range(50)] + ["doc 3"]  # one exact duplicate
    train, evals = split_documents(docs, eval_fraction=0.2, seed=1)
    assert split_documents(docs, eval_fraction=0.2, seed=1) == (train, evals)
    assert len(evals) == 10 and len(train) == 40  # 50 unique documents
    assert not set(train) & set(evals)
    assert set(train) | set(evals) == set(docs)
    assert train == sorted(train, key=docs.index) and evals == sorted(evals, key=docs.index)  # order kept
    assert split_documents(docs, 0.2, seed=2)[1] != evals
    assert split_documents(docs, 0.0, seed=1) == (docs[:50], [])
    assert len(split_documents(docs[:3], 0.01, seed=0)[1]) == 1  # at least one eval document
    with pytest.raises(ValueError, match="eval_fraction"):
        split_documents(docs, 1.0)


@needs_shared
def test_real_split_tokens_disjoint(tok):
    docs = load_documents(SAMPLE)
    train, evals = split_documents(docs, eval_fraction=0.25, seed=0)
    assert len(train) + len(evals) == 17  # 19 lines, 2 exact duplicates
    assert not set(train) & set(evals)
    ids = tokenize_documents(evals, tok)
    starts = (ids == tok.bos_id).nonzero().flatten().tolist()
    assert len(starts) == len(evals) and starts[0] == 0
    assert tok.decode(ids[starts[0] : starts[1]].tolist()) == evals[0]


def test_tokenize_with_hf_style_tokenizer():
    class HFLike:
        bos_token_id = None
        eos_token_id = 0

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    assert tokenize_documents(["ab", "c"], HFLike()).tolist() == [0, 97, 98, 0, 99]


def test_max_tokens_is_the_whole_stream_cut_and_stops_encoding_early():
    encoded = []

    class Counting:
        bos_id = 1

        def encode(self, text, bos=True, eos=False):
            encoded.append(text)
            return [1] * bos + [ord(c) for c in text]

    docs = ["abc", "de", "fghij", "k"]
    whole = tokenize_documents(docs, Counting())
    for cap in (1, 4, 5, 6, 12, 13, 50):
        encoded.clear()
        assert torch.equal(tokenize_documents(docs, Counting(), max_tokens=cap), whole[:cap]), cap
        assert len(encoded) == min(len(docs), 1 + (cap > 4) + (cap > 7) + (cap > 13)), (cap, encoded)


# ------------------------------------------------------------------------------------------------ blocks


def test_pack_blocks_shapes_and_tail():
    blocks = pack_blocks(torch.arange(103), 10)
    assert blocks.shape == (10, 10) and blocks.dtype == torch.long
    assert torch.equal(blocks.flatten(), torch.arange(100))  # contiguous, ragged tail (3 tokens) dropped
    assert pack_blocks(torch.arange(10), 10).shape == (1, 10)
    with pytest.raises(ValueError, match=r"story\.txt.*too short.*9 tokens"):
        pack_blocks(torch.arange(9), 10, source="story.txt")


@needs_shared
def test_load_text_data_and_too_short_file(tok, tmp_path):
    data = load_text_data(SAMPLE, tok, block_len=129, eval_fraction=0.25, seed=0)
    assert data.train_blocks.shape[1] == 129 and data.train_blocks.shape[0] >= 60
    assert data.eval_ids[0] == tok.bos_id and not set(data.train_docs) & set(data.eval_docs)
    short = tmp_path / "short_story.txt"
    short.write_text("Once upon a time.\nThe end.\nBye.\n")
    with pytest.raises(ValueError, match=r"short_story\.txt.*too short"):
        load_text_data(short, tok, block_len=129, eval_fraction=0.3)


# ------------------------------------------------------------------------------------------------ batches


def test_batches_are_deterministic_resumable_and_cover_epochs():
    blocks = torch.arange(23 * 4).view(23, 4)
    run = [get_batch(blocks, 5, s, seed=3) for s in range(20)]
    assert all(b.shape == (5, 4) for b in run)
    resumed = list(batch_iterator(blocks, 5, seed=3, start_step=12, steps=8))
    assert all(torch.equal(a, b) for a, b in zip(run[12:], resumed, strict=True))
    assert torch.equal(batch_fn(blocks, 5, seed=3)(7), run[7])
    # Each epoch (23 consecutive samples) is a permutation of all blocks.
    order = torch.cat([batch_indices(23, 5, s, seed=3) for s in range(20)])
    for e in range(4):
        assert sorted(order[e * 23 : (e + 1) * 23].tolist()) == list(range(23))
    assert not torch.equal(order[:23], order[23:46])  # reshuffled per epoch
    assert not torch.equal(get_batch(blocks, 5, 0, seed=4), run[0])
    big = get_batch(blocks, 50, 0, seed=0)  # batch larger than the data spans epochs
    assert big.shape == (50, 4)
    with pytest.raises(ValueError, match="step"):
        get_batch(blocks, 5, -1)
