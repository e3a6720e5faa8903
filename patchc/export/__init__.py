"""Stage 5, export: getting a pruned model out of patchc and loading it back, ready to serve.

It owns the exported checkpoint (an HF-style folder whose planned weights are stored compressed as the
tile plan's buffers), writing it from a plan and a model or from a `patchc prune` run folder, rebuilding
the model from it offline with the runtime's `TileLinear` layers (or plain dense ones), and bringing in
models that are already 2:4 (zeros in dense weights, or compressed-tensors' legacy `sparse-24-bitmask`
checkpoints). It takes TilePlans (ir),
models (models) and the runtime's `patchc.compile`; it hands users a folder and a model.

    format.py      model.safetensors: plain tensors + "<fqn>.patchc.<part>" plan buffers, versioned header
    shards.py      weights above max_shard_size as shards + model.safetensors.index.json (transformers')
    arch.py        which model a folder holds: config.json, tokenizer files, rebuilding it
    pretrained.py  export_pretrained, write_export (layers packed as the file is written), export_run,
                   from_pretrained, load_plan, load_tokenizer
    legacy.py      compressed-tensors' sparse-24-bitmask files: plan_from_compressed_tensors, decoded_tensors
    marlin24.py    its int4 / int8 marlin-24 layout (Sparse-Marlin's): decode_marlin24
    importing.py   import_sparse (`patchc import`): a model that is already 2:4 in, an exported folder out
    outdir.py      --out checked before any work, written atomically, a killed run's hidden folders swept

Example:
    >>> from patchc.export import export_pretrained, from_pretrained
    >>> export_pretrained(plan, model, "out/pruned", tokenizer_from=STORIES260K_DIR)
    >>> fast = from_pretrained("out/pruned")            # TileLinear where planned; dense=True for plain
"""

from patchc.utils.lazy import lazy_exports, names_of

# Imported on first use: the command line reads shards.py (--max-shard-size) without importing torch.
_LAZY = {
    **names_of("patchc.export.format", "CONFIG", "FORMAT", "VERSION", "WEIGHTS", "ExportError"),
    **names_of("patchc.export.importing", "ImportSummary", "import_sparse"),
    **names_of("patchc.export.legacy", "decode_24_bitmask", "plan_from_compressed_tensors"),
    **names_of("patchc.export.pretrained", "export_pretrained", "export_run", "from_pretrained", "load_plan",
               "load_tokenizer"),
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = sorted(_LAZY)
