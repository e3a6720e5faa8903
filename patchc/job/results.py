"""What a `patchc prune` run reports: its rows (one per method scored) and the report dict around them.

report.json is this dict; report.md and `patchc eval` read it back (`report/markdown.py`, `rescore.py`).

Example:
    >>> row("dense", "dense", "-", 0.0, {"perplexity": 5.257})["perplexity"]
    5.257
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from patchc.config import PatchConfig
from patchc.job.corpus import data_summary
from patchc.job.distributed import world
from patchc.job.options import PruneOptions
from patchc.utils.env import device_name, versions


def row(name: str, method: str, pattern: str, sparsity: float, metrics: dict, seconds: float | None = None) -> dict:
    """One line of the report; "extra" scores (per --eval-data file) are filed under the metric they are."""
    extra_key = "cosine_extra" if metrics.get("cosine") is not None else "perplexity_extra"
    return {"name": name, "method": method, "pattern": pattern, "sparsity": round(float(sparsity), 6),
            "perplexity": metrics.get("perplexity"), "perplexity_extra": {}, "cosine_extra": {},
            extra_key: metrics.get("extra") or {},
            "cosine": metrics.get("cosine"),
            "retrieval_agreement": metrics.get("retrieval_agreement"),
            "seconds": round(seconds, 2) if seconds is not None else None}


def protocol(bundle, opts: PruneOptions) -> str:
    """How the rows were scored, in words (report.json's evaluation.protocol)."""
    if bundle.kind == "causal":
        return (f"perplexity over the held-out {opts.eval_fraction:.0%} of documents (split by document, seed "
                f"{opts.split_seed}), BOS per document, non-overlapping windows of {opts.eval_context} tokens, every "
                f"next-token prediction scored")
    return ("mean cosine between pruned and dense mean-pooled sentence embeddings of held-out sentences, and the "
            "share of sentences whose nearest neighbour is unchanged; on each --eval-data file, the mean cosine over "
            "up to 512 of its sentences")


def run_report(bundle, data: dict, cfg: PatchConfig, opts: PruneOptions, plan, trained, results: list[dict],
               out: Path, command: str | None, timings: dict[str, float]) -> dict:
    """The report dict of a finished run (its "files" are added once they are written)."""
    recover = None
    if opts.recover:
        recover = {"steps": opts.recover, "lr": opts.recovery_lr(bundle.kind), "loss": opts.recover_loss,
                   "scope": opts.recover_scope, "splice": opts.recovery_splice(bundle.kind, bundle.name)}
    return {
        "command": command or "",
        "model": bundle.name,
        "model_spec": opts.model,
        "kind": bundle.kind,
        "data": data_summary(bundle, data, opts),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.to_dict().items()},
        "recover": recover,
        "train": {"steps": opts.steps, "schedule_steps": cfg.steps, "batch_size": opts.batch_size, "lr": opts.lr,
                  "tile_lr": opts.tile_lr, "loss": opts.loss if bundle.kind == "causal" else "distil embeddings",
                  "kd_temperature": opts.kd_temperature, "seed": opts.seed, "processes": world()[1],
                  "seconds": round(trained.seconds, 2), "final": trained.history[-1] if trained.history else {}},
        "plan": {"path": str(out / "plan.patch"), "density": plan.density, "sparsity": plan.sparsity,
                 "n_layers": len(plan.layers), "skipped": plan.skipped},
        "metric": "perplexity" if bundle.kind == "causal" else "cosine",
        "evaluation": {"protocol": protocol(bundle, opts), "context": opts.eval_context,
                       "eval_tokens": opts.eval_tokens},
        "results": results,
        "speed": {"skipped": "no CUDA device" if not torch.cuda.is_available()
                  else "not measured by prune: run `make gpu` (patchc bench) on a CUDA GPU"},
        "versions": versions(),
        "device": device_name(opts.device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timings": timings,
    }


__all__ = ["protocol", "row", "run_report"]
