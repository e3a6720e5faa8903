"""`patchc sample`: the dense model's text as a file for --train-extra (issue 15)."""

from __future__ import annotations

import pytest
import torch

import patchc.job.selfdata as selfdata
from patchc.job.cli import main
from patchc.job.data import load_documents, split_files
from patchc.job.options import DEFAULT_DATA, PruneOptions
from patchc.job.sample import write_samples
from patchc.models import load_model

SMALL = ["--tokens", "60", "--block-len", "19", "--threads", "1", "--no-progress"]  # 3 samples of 20 tokens


def test_cli_writes_one_document_per_sample_and_is_deterministic(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    assert main(["sample", "--out", str(a), *SMALL]) == 0
    assert "wrote 3 samples (60 tokens" in capsys.readouterr().out
    assert main(["sample", "--out", str(b), *SMALL]) == 0
    assert a.read_bytes() == b.read_bytes()
    docs = load_documents(a)
    assert len(docs) == 3 and all(len(d) > 20 for d in docs)
    assert main(["sample", "--out", str(b), "--split-seed", "1", "--overwrite", *SMALL]) == 0
    assert a.read_bytes() != b.read_bytes()  # the seed picks the prompts and the sampling noise


def test_prompts_come_from_training_documents_only(monkeypatch, tmp_path):
    seen = []
    real = selfdata.generate_blocks

    def spy(bundle, spec, prompts, **kw):
        seen.append(prompts)
        return real(bundle, spec, prompts, **kw)

    monkeypatch.setattr(selfdata, "generate_blocks", spy)
    write_samples(PruneOptions(self_tokens=40, block_len=19, threads=1, progress=False), tmp_path / "s.txt")
    tokenizer = load_model(PruneOptions().model).tokenizer
    docs_train, docs_eval = split_files(DEFAULT_DATA, 0.2, 0)
    train = selfdata.prompts_from(docs_train, tokenizer, 4)
    every = selfdata.prompts_from(docs_train + docs_eval, tokenizer, 4)
    assert len(seen) == 1 and torch.equal(seen[0], train)
    assert every.shape[0] > train.shape[0]  # held-out documents would have added rows (most share a first line)


def test_refuses_before_any_work(tmp_path, capsys):
    out = tmp_path / "s.txt"
    out.write_text("mine")
    assert main(["sample", "--out", str(out), *SMALL]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err and out.read_text() == "mine"
    assert main(["sample", "--out", str(out), "--data", str(out), "--overwrite", *SMALL]) == 2
    assert f"--out {out} is the --data file {out}; write the samples" in capsys.readouterr().err
    assert out.read_text() == "mine"
    assert main(["sample", "--out", str(tmp_path), *SMALL]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["sample", "--out", str(tmp_path / "t.txt"), "--top-p", "0", *SMALL]) == 2
    assert "--self-top-p" in capsys.readouterr().err
    assert main(["sample", "--out", str(tmp_path / "t.txt"), *SMALL, "--data", str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--data {tmp_path / 'none.txt'}: no such file")
    # stories260K has 512 positions: a longer sample is refused before generating (shared model checks)
    assert main(["sample", "--out", str(tmp_path / "t.txt"), *SMALL, "--block-len", "600"]) == 2
    assert "--block-len 600 is longer than the 512 positions" in capsys.readouterr().err
    assert not (tmp_path / "t.txt").exists()


def test_an_encoder_cannot_write_text(tmp_path, capsys):
    assert main(["sample", "--model", "minilm", "--out", str(tmp_path / "s.txt"), *SMALL]) == 2
    assert "is an encoder: it cannot write text" in capsys.readouterr().err
    assert not (tmp_path / "s.txt").exists()
