"""`patchc sample`: the dense model's own text, the text `--train-data self` trains on, written to a file.

Why a file: an encoder cannot write text but can train on a causal LM's (all-MiniLM-L6-v2 PATCH 35% masks
trained with 4,096 sentences of stories260K's text and 4,096 of TinyShakespeare beside the 452 keep 0.955
cosine instead of 0.939, and 0.980 after recovery: README, seeds 0-2);
a file can also be read, checked, and passed to any run with `--train-extra`. Prompts are the first
tokens of the training documents of --data only, under the same split rule and --split-seed as
`patchc prune`, so no sample starts from a held-out document. One sample per generated block,
separated by blank lines (`load_documents` reads them back one document each).

Example:
    >>> info = write_samples(PruneOptions(self_tokens=65536), "gen.txt")
    >>> info["documents"]
    509
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from patchc.job.options import PruneOptions
from patchc.utils.files import atomic_path, check_apart, check_writable


def check_out(opts: PruneOptions, out: Path, overwrite: bool) -> None:
    """Refuse, before any work, to replace an existing file (unless `overwrite`) or ever one of --data's, or to
    write where this process cannot."""
    read = [(f"the {flag} file", p) for flag, paths in (("--data", opts.data), ("--eval-data", opts.eval_data),
                                                         ("--train-extra", opts.train_extra)) for p in paths]
    check_apart(out, read, "write the samples to a new file")
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a folder; give a file name such as {out / 'samples.txt'}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} exists; pass --overwrite to replace it, or choose another name")
    check_writable(out.parent, f"--out {out}")


def sample_texts(bundle: Any, opts: PruneOptions) -> list[str]:
    """`opts.self_tokens` tokens of the dense model's text as decoded samples, one per generated block."""
    from patchc.job.corpus import self_generated, split_data
    from patchc.job.records import chat_renderer

    if bundle.kind != "causal":
        raise ValueError(f"--model {opts.model} is an {bundle.kind}: it cannot write text. Sample from a causal "
                         "LM (e.g. the default stories260K) and pass the file to this model's --train-extra")
    tokenizer = bundle.require_tokenizer()
    docs_train, _ = split_data(opts, chat_renderer(tokenizer))
    blocks, _ = self_generated(bundle, opts, docs_train, tokenizer, cache_dir=None)
    return [tokenizer.decode(row.tolist()) for row in blocks]


def write_samples(opts: PruneOptions, out: str | os.PathLike, overwrite: bool = False) -> dict[str, Any]:
    """Generate with `opts.model` and write the samples to `out` atomically; returns what was written."""
    from patchc.job.corpus import check_text_files
    from patchc.job.model import load_bundle

    out = Path(out)
    check_out(opts, out, overwrite)
    check_text_files(opts)  # before the model loads
    start = time.perf_counter()
    bundle = load_bundle(opts)
    texts = sample_texts(bundle, opts)
    text = "\n\n".join(texts)
    with atomic_path(out) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
    return {"out": str(out), "model": opts.model, "documents": len(texts), "tokens": opts.self_tokens,
            "characters": len(text), "seconds": time.perf_counter() - start}


__all__ = ["write_samples", "sample_texts"]
