"""Which model an exported folder holds, its config.json and tokenizer files, and rebuilding it offline.

Two families:

  * ``"transformers"``: a `PreTrainedModel`, or patchc's `EncoderWrapper` around one (MiniLM as
    `load_model` gives it). config.json (+ generation_config.json) is the model's own
    `save_pretrained` output; the model is rebuilt with its transformers class from that config
    (never a hub download) and, for a wrapper, wrapped again. Tensor names drop the wrapper's
    ``model.`` prefix, so the file reads like the HF checkpoint it came from.
  * ``"llama2c"``: patchc's llama2.c `Llama` (stories260K). It is stored with patchc's own config
    (``"model_type": "patchc-llama2c"`` and the `LlamaConfig` fields) and rebuilt with
    `patchc.models.llama2c`, not converted to transformers' LlamaForCausalLM: llama2.c rotates
    interleaved pairs where HF rotates halves, so q/k rows would need a per-head permutation that
    moves rows across tile boundaries whenever b1 does not align with head_dim (the plan would no
    longer describe the weights), and HF builds its RoPE tables in fp32 where llama2.c uses fp64, so
    logits would differ in the last bits. patchc's own model gives the exact logits.

Example:
    >>> spec = describe(model)                 # ModelSpec(family="llama2c", cls="Llama", kind="causal", ...)
    >>> save_config(spec, model, folder); rebuilt = rebuild(folder, spec)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patchc.export.format import ExportError
from patchc.models.hf import EncoderWrapper, hf_kind
from patchc.models.llama2c import Llama, LlamaConfig
from patchc.utils.files import read_record

FAMILIES = ("transformers", "llama2c")
LLAMA2C_TYPE = "patchc-llama2c"
# Files a transformers tokenizer (and sentence-transformers' pooling set-up) may be saved as.
HF_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
    "sentence_bert_config.json", "modules.json", "config_sentence_transformers.json",
)


@dataclass(frozen=True)
class ModelSpec:
    """How to rebuild an exported model: family, class name, causal / encoder, wrapper and its name prefix.

    Example:
        >>> ModelSpec(family="transformers", cls="BertModel", kind="encoder", wrapper=True, prefix="model.")
    """

    family: str
    cls: str
    kind: str
    wrapper: bool = False
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ExportError(f"model family {self.family!r} is not one of {FAMILIES} (re-export the model)")
        if self.kind not in ("causal", "encoder"):
            raise ExportError(f"model kind {self.kind!r} must be 'causal' or 'encoder'")
        if self.wrapper != bool(self.prefix):
            raise ExportError(f"a wrapped model needs a name prefix and only it has one, got {self.prefix!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def describe(model: nn.Module) -> ModelSpec:
    """The `ModelSpec` of a model patchc can export; `ExportError` naming the class for anything else."""
    if isinstance(model, Llama):
        return ModelSpec(family="llama2c", cls="Llama", kind="causal")
    wrapped = isinstance(model, EncoderWrapper)
    inner = model.model if wrapped else model
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "save_pretrained") or not hasattr(inner, "_from_config"):
        raise ExportError(
            f"cannot export a {type(model).__name__}: give a transformers PreTrainedModel, patchc's EncoderWrapper "
            "or patchc's llama2.c Llama (what patchc.models.load_model returns)")
    kind = "encoder" if wrapped else hf_kind(config)
    return ModelSpec(family="transformers", cls=type(inner).__name__, kind=kind, wrapper=wrapped,
                     prefix="model." if wrapped else "")


def save_config(spec: ModelSpec, model: nn.Module, folder: Path, config: Any = None) -> None:
    """Write config.json (and generation_config.json where the model has one) into `folder`.

    `config` overrides the model's own (a transformers config, or a llama2.c `LlamaConfig`)."""
    if spec.family == "llama2c":
        cfg = config if config is not None else model.config
        if not isinstance(cfg, LlamaConfig):
            raise ExportError(f"a llama2.c model needs a patchc LlamaConfig as config, got {type(cfg).__name__}")
        body = {"model_type": LLAMA2C_TYPE, "architectures": ["Llama"], **dataclasses.asdict(cfg)}
        (folder / "config.json").write_text(json.dumps(body, indent=2) + "\n")
        return
    inner = model.model if spec.wrapper else model
    (config if config is not None else inner.config).save_pretrained(str(folder))
    gen = getattr(inner, "generation_config", None)
    if gen is not None and spec.kind == "causal":
        gen.save_pretrained(str(folder))


def rebuild(folder: Path, spec: ModelSpec, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A model of `spec`'s class from `folder`'s config.json (offline), in `dtype`. HF models are built without
    random initialisation (`skipped_init`): their weights hold garbage until `from_pretrained` loads the folder's.
    They are built in `dtype` as transformers' from_pretrained builds them, not cast after: buffers it computes in
    fp32 stay fp32 (RoPE's inverse frequencies: rounded to bf16 they turn positions in the thousands by
    radians), and the model never exists in fp32 (twice a bf16 model's memory)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ExportError(f"{folder}: config.json missing; not a complete exported model")
    if spec.family == "llama2c":
        body = read_record(path, "llama2.c config", "export the model again")  # one line, not a JSONDecodeError
        fields = {f.name for f in dataclasses.fields(LlamaConfig)}
        if body.get("model_type") != LLAMA2C_TYPE:
            raise ExportError(f"{path}: model_type {body.get('model_type')!r}, expected {LLAMA2C_TYPE!r}")
        return Llama(LlamaConfig(**{k: v for k, v in body.items() if k in fields})).to(dtype)
    import transformers

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError by version
        raise ExportError(f"{path}: transformers cannot read it ({type(e).__name__}: {e})") from None
    cls = getattr(transformers, spec.cls, None)
    if cls is None or not hasattr(cls, "_from_config"):
        raise ExportError(f"{folder}: transformers {transformers.__version__} has no model class {spec.cls!r}")
    with skipped_init(transformers):  # every weight is overwritten from the folder (a missing one is an error)
        model = cls._from_config(cfg, dtype=dtype)  # as AutoModel*.from_config: attention implementation, dtype
    model.tie_weights()  # skipped with the initialisation: a tied LM head would be a second, separate matrix
    gen_path = folder / "generation_config.json"
    if gen_path.is_file() and hasattr(model, "generation_config"):
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(folder))
    return EncoderWrapper(model) if spec.wrapper else model


def skipped_init(transformers: Any) -> contextlib.AbstractContextManager:
    """transformers' own `no_init_weights` (its place moved in 5.0), which from_pretrained builds models under:
    random initialisation of every weight is most of a rebuild's time."""
    for where in ("initialization", "modeling_utils"):
        try:
            module = importlib.import_module(f"{transformers.__name__}.{where}")
        except ImportError:
            continue
        if hasattr(module, "no_init_weights"):
            return module.no_init_weights()
    return contextlib.nullcontext()


def copy_tokenizer(source: Any, folder: Path, spec: ModelSpec) -> list[str]:
    """Copy the tokenizer from `source` (a folder, a checkpoint file beside its tokenizer, or an object with
    `save_pretrained`) into `folder`; returns the file names written ([] when `source` is None)."""
    if source is None:
        return []
    if hasattr(source, "save_pretrained"):
        before = set(p.name for p in folder.iterdir())
        source.save_pretrained(str(folder))
        return sorted(set(p.name for p in folder.iterdir()) - before)
    src = Path(source)
    if not src.exists():
        raise ExportError(f"tokenizer_from={source}: no such file or folder")
    src_dir = src if src.is_dir() else src.parent
    if spec.family == "llama2c":
        found = [p for p in src_dir.glob("tok*.bin") if p.name == "tokenizer.bin" or p.stem[3:].isdigit()]
    else:
        found = [src_dir / n for n in HF_TOKENIZER_FILES if (src_dir / n).is_file()]
        pooling = src_dir / "1_Pooling"
        if pooling.is_dir():  # sentence-transformers' mean pooling set-up (MiniLM)
            shutil.copytree(pooling, folder / pooling.name)
            found.append(folder / pooling.name)
    if not found:
        raise ExportError(f"tokenizer_from={source}: no tokenizer files in {src_dir}")
    for p in found:
        if p.is_file():
            shutil.copyfile(p, folder / p.name)
    return sorted(p.name for p in found)
