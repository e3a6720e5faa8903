"""The main job and its command line: a real model and real text in, a plan and a quality report out.

    options.py        `PruneOptions`: every `patchc prune` setting, validated
    model.py          opening the model: device, dtype, weight and length checks, CPU threads; parking it
    memory.py         will the model, the mask state fit on the device? refused up front, with the leaner modes
    data.py           text files -> documents -> train / held-out split by document -> token blocks, batches
    records.py        JSON Lines / JSON / Parquet records -> documents (a text field, or a chat)
    sampling.py       nucleus sampling of next-token logits, on their device (binned past 1,024 tokens)
    selfdata.py       text the dense model writes itself (seeded, cached)
    corpus.py         the job's text: real + generated training blocks, held-out ids, extra scored files
    losses.py         LM, distillation from the dense model, or both
    evaluate.py       perplexity on held-out text (causal LMs)
    encoder_eval.py   sentence-embedding agreement and distillation (encoders such as all-MiniLM-L6-v2)
    distributed.py    torchrun: ranks, batch shares
    fsdp.py           FSDP2: each block's frozen weights and mask logits sharded together; teacher, hardening
    fsdp_checkpoint.py  FSDP2: the sharded checkpoint folder every rank writes
    runs.py           run folders: claimed atomically, resumed only with their own settings
    resume.py         the rows a run has scored, kept as they are scored: what --resume reuses after a crash
    stages.py         one function per stage: batches, losses, calibrate, train, score a copy, one-shot, recover
    prune.py          `run_prune`: load -> calibrate -> transform -> train -> harden -> evaluate -> report
    results.py        the report's rows and the report dict of a run (report.json)
    recover.py        `patchc recover`: fine-tune the kept weights of a finished run, masks fixed
    rescore.py        `patchc eval`: a saved plan on its own held-out split, and on whole files
    sample.py         `patchc sample`: the dense model's own text as a file
    report/           statistics, pictures, report.json / report.md
    cli.py            `patchc prune | eval | recover | sample | export | import | report | generate | tune | bench`
    prune_args.py     `patchc prune`'s flags -> `PruneOptions`

It drives every stage before it (`patchc.passes`, `patchc.masking`, `patchc.ir`, `patchc.pruning`) and
writes what users read.

Example:
    >>> report = run_prune(PruneOptions(steps=50, out="runs/quick"))
    >>> print(format_results(report))
"""

from patchc.utils.lazy import lazy_exports, names_of

# Imported on first use: `patchc --help` reads only options.py, which does not import torch.
_LAZY = {
    **names_of("patchc.job.options", "DEFAULT_DATA", "DEFAULT_MODEL", "PruneOptions"),
    **names_of("patchc.job.report", "format_results"),
    **names_of("patchc.job.prune", "run_prune"),
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = list(_LAZY)
