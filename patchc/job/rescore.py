"""`patchc eval`: score a saved plan against the dense model on the held-out text of the plan's own split.

A plan made by `patchc prune` records its split in `plan.meta["data"]` (files, seed, fraction, encoding and
the ids of its training documents) and its model in `plan.meta["model"]`. `patchc eval` uses them unless
told otherwise, and refuses to score on documents the plan was trained on (`--allow-overlap` to insist):
a plan scored on its own training text looks better than it is.

Example:
    >>> scores = rescore("runs/x/plan.patch")
    >>> scores["pruned"]["perplexity"] / scores["dense"]["perplexity"]
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from patchc.job.options import DEFAULT_DATA, DEFAULT_MODEL, PruneOptions


def recorded_split(plan: Any) -> dict:
    """The plan's recorded split (empty for plans made outside `patchc prune` or by older versions)."""
    data = plan.meta.get("data")
    return data if isinstance(data, dict) else {}


def eval_options(plan: Any, model: str | None = None, data: list[str] | None = None, seed: int | None = None,
                 eval_fraction: float | None = None, eval_context: int = 256, device: str = "cpu",
                 encoding: str | None = None, text_field: str | None = None,
                 texts: list[str] | None = None, eval_tokens: int = PruneOptions.eval_tokens,
                 offload: bool = False) -> PruneOptions:
    """The options `patchc eval` runs with: each one given, else the plan's recorded one, else the default.
    `seed` is the data split's seed; `texts` are files scored unsplit, on their first `eval_tokens` tokens
    (`--text`); `offload`: stream the blocks from host memory (`patchc.models.offload`)."""
    split = recorded_split(plan)
    if not split and (data is None or seed is None or eval_fraction is None):
        warnings.warn("the plan records no data split (made outside `patchc prune` or by an older patchc): "
                      "scoring on the defaults, which may overlap its training text", stacklevel=2)
    pick = lambda given, key, default: given if given is not None else split.get(key, default)  # noqa: E731
    return PruneOptions(
        model=model or plan.meta.get("model") or DEFAULT_MODEL,
        data=tuple(data or split.get("files") or DEFAULT_DATA),
        split_seed=pick(seed, "seed", 0), eval_fraction=pick(eval_fraction, "eval_fraction", 0.2),
        train_data="real", eval_data=tuple(texts or ()), eval_tokens=eval_tokens,
        encoding=pick(encoding, "encoding", "utf-8"), text_field=pick(text_field, "text_field", None),
        bos=split.get("bos", True), eval_context=eval_context,
        device=device, offload=offload,
    )


def check_overlap(plan: Any, eval_docs: list[str], allow_overlap: bool, text: str | None = None) -> int:
    """How many evaluation documents the plan was trained on; raises unless `allow_overlap`. `text`: the
    --text file they come from, else the split's held-out documents."""
    from patchc.job.data import doc_hashes

    split = recorded_split(plan)
    trained = set(split.get("train_documents") or ()) | set(split.get("train_extra_documents") or ())
    seen = sum(h in trained for h in doc_hashes(eval_docs))
    if seen and not allow_overlap:
        way_out = (f"drop --text {text} (the plan's held-out documents are scored without it)" if text else
                   "drop --seed/--eval-fraction/--data to use the plan's own split")
        raise ValueError(f"{seen} of the {len(eval_docs)} evaluation documents{f' in {text}' if text else ''} were "
                         f"used to train this plan, so its score would flatter it; {way_out}, or pass --allow-overlap")
    return seen


def rescore(plan_path: str | os.PathLike, allow_overlap: bool = False, force: bool = False,
            **options: Any) -> dict[str, Any]:
    """{"options", "overlap", "dense", "pruned", "kind", "held_out", "scored"}: metrics of the dense model and
    the plan applied to it; "held_out" is how many tokens (a causal LM's) or sentences (an encoder's) of
    held-out text were scored, "scored" the same per --text file."""
    from patchc.ir import TilePlan
    from patchc.job.corpus import check_text_files, read_documents, scored_texts, split_data, text_size
    from patchc.job.model import load_bundle
    from patchc.job.records import chat_renderer
    from patchc.job.stages import dense_reference, evaluate

    plan = TilePlan.load(plan_path)
    opts = eval_options(plan, **options)
    trained_on = recorded_split(plan).get("files")
    check_text_files(opts, eval_flag="--text", data_note=f" (the plan was trained on {', '.join(trained_on)})"
                     if trained_on else "")
    bundle = load_bundle(opts, training=False)
    chat = chat_renderer(bundle.tokenizer)  # a chat record's text is what the model's template makes of it
    _, eval_docs = split_data(opts, chat)
    overlap = check_overlap(plan, eval_docs, allow_overlap)
    for path in opts.eval_data:  # a whole file must not hold training documents either
        overlap += check_overlap(plan, read_documents(path, opts, chat), allow_overlap, text=path)
    data = scored_texts(bundle, opts, eval_docs, ", ".join(opts.data))  # what load_data(training=False) gives
    dense_ref = dense_reference(bundle, data)
    dense = evaluate(bundle, bundle.model, data, opts, dense_ref)
    # the dense model is scored: the plan goes into it in place, not into a second copy read from disk again
    # (a 70B model under --offload would need twice its weights in host memory)
    pruned = evaluate(bundle, plan.apply(bundle.model, force=force), data, opts, dense_ref)
    return {"plan": plan, "options": opts, "overlap": overlap, "dense": dense, "pruned": pruned, "kind": bundle.kind,
            "held_out": text_size(bundle.kind, data["eval"]),
            "scored": {path: text_size(bundle.kind, v) for path, v in data["extra"].items()}}


def format_rescore(r: dict[str, Any], name: str | os.PathLike) -> str:
    """`patchc eval`'s output: what was scored, then the dense and pruned metrics (extra texts by file name).

    Example:
        >>> print(format_rescore(rescore("runs/x"), "runs/x"))       # doctest: +SKIP
        runs/x: density 0.6500, 35 layers; held-out 20% of tinystories_sample.txt (split seed 0, 2920 tokens)
          dense    perplexity 5.2570
          pruned   perplexity 7.6560
    """
    from patchc.job.report import scored_files

    opts, plan = r["options"], r["plan"]
    unit = "tokens" if r["kind"] == "causal" else "sentences"
    lines = [f"{name}: density {plan.density:.4f}, {len(plan.layers)} layers; held-out {opts.eval_fraction:.0%} "
             f"of {', '.join(opts.data)} (split seed {opts.split_seed}, {r['held_out']} {unit})"
             + (f"; {r['overlap']} documents seen in training" if r["overlap"] else "")
             + scored_files(r["scored"], r["kind"], opts.eval_tokens)]
    for row in ("dense", "pruned"):
        metrics = {k: v for k, v in r[row].items() if k != "extra" and v is not None}
        metrics.update(r[row].get("extra") or {})
        lines.append(f"  {row:<8} " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return "\n".join(lines)
