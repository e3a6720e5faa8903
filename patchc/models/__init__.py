"""Where models come from: the loaders patchc ships for llama2.c checkpoints and Hugging Face models.

Before the pipeline: a `ModelBundle` (`load_model`) gives the job a model, its tokenizer, how to export
it for `patchc.transform` and how to read its logits or embeddings.

    shared.py             where the real material lives (../shared, or $PATCHC_SHARED)
    llama2c.py            a plain PyTorch Llama-2 reading llama2.c checkpoints (stories260K), generate
    llama2c_tokenizer.py  llama2.c's BPE tokenizer
    hf.py                 transformers loaders (causal LMs, encoders, all-MiniLM-L6-v2), offline
    hf_export.py          their torch.export (dynamic, else per length; untraceable layers named)
    traceable.py          vectorised forms of layers torch.export cannot trace (Qwen4-Exp's indexer, DBRX's experts)
    bundle.py             `ModelBundle`: a model with its tokenizer, export and logits, whatever its source
    spec.py               `load_model(spec)`: which loader a spec (file, folder, cached name) names
    outputs.py            logits of any model call, a model's device
    per_length.py         `PerLengthExport`: a model torch.export traces only at fixed sequence lengths
    dims.py               dynamic export dimensions that every supported torch keeps symbolic
    offload.py            --offload: a model's blocks in host memory, each copied to the GPU for its forward

Example:
    >>> from patchc.models import load_llama2c, load_tokenizer, STORIES260K_DIR
    >>> model = load_llama2c(STORIES260K_DIR / "stories260K.bin")
"""

from patchc.models.shared import SHARED_DIR, STORIES260K_DIR, shared_dir
from patchc.utils.lazy import lazy_exports, names_of

# Imported on first use: shared.py (where ../shared is) is all the command line's defaults need, and the
# loaders import torch (transformers only on a first load).
_LAZY = {
    **names_of("patchc.models.llama2c", "CheckpointError", "Llama", "LlamaConfig", "export_llama", "generate",
               "load_llama2c"),
    **names_of("patchc.models.llama2c_tokenizer", "BOS_ID", "EOS_ID", "Tokenizer", "load_tokenizer"),
    **names_of("patchc.models.bundle", "HFTokenizer", "ModelBundle"),
    **names_of("patchc.models.hf", "EncoderWrapper", "HFLoadError", "minilm_dir"),
    **names_of("patchc.models.hf_export", "export_causal_lm", "export_encoder"),
    **names_of("patchc.models.spec", "load_model"),
    **names_of("patchc.models.offload", "stream_blocks"),
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["SHARED_DIR", "STORIES260K_DIR", "shared_dir", *_LAZY]
