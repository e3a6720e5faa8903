"""Model definitions patchc ships for its own tests and examples.

Example:
    >>> from patchc.models import load_llama2c, load_tokenizer, STORIES260K_DIR
    >>> model = load_llama2c(STORIES260K_DIR / "stories260K.bin")
"""

from patchc.models.llama2c import (
    BOS_ID,
    EOS_ID,
    SHARED_DIR,
    STORIES260K_DIR,
    CheckpointError,
    Llama,
    LlamaConfig,
    Tokenizer,
    export_llama,
    generate,
    load_llama2c,
    load_tokenizer,
    shared_dir,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "SHARED_DIR",
    "STORIES260K_DIR",
    "CheckpointError",
    "Llama",
    "LlamaConfig",
    "Tokenizer",
    "export_llama",
    "generate",
    "load_llama2c",
    "load_tokenizer",
    "shared_dir",
]

# Hugging Face models and the one-stop loader (transformers is imported lazily, on first load).
from patchc.models.bundle import HFTokenizer, ModelBundle, load_model  # noqa: E402
from patchc.models.hf import EncoderWrapper, HFLoadError, export_causal_lm, export_encoder, minilm_dir  # noqa: E402

__all__ += [
    "EncoderWrapper",
    "HFLoadError",
    "HFTokenizer",
    "ModelBundle",
    "export_causal_lm",
    "export_encoder",
    "load_model",
    "minilm_dir",
]
