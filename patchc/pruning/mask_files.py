"""Mask file interop: the published PATCH and MaskLLM `.npz` release formats.

PATCH format (`format="patch"`), one `np.savez_compressed` archive:
    "<fqn>"            uint8  np.packbits of the flattened (row-major) bool mask, True = kept
    "<fqn>.__shape__"  int64  (N, K)
    "__meta__"         0-d unicode array holding a JSON object (producer, version, per-layer info)
MaskLLM format (`format="maskllm"`):
    "<fqn>.mask"       uint8  np.packbits of the flattened bool mask; no shape (the model gives it)
`load_npz` detects the format from the keys. Bits are big-endian within a byte (np.packbits default).

Example:
    >>> save_npz(plan, "mask.npz")                      # or a {fqn: bool (N, K)} dict
    >>> masks = load_npz("mask.npz", model)             # {fqn: bool (N, K)}, checked against the model
    >>> plan2 = patchc.TilePlan.from_masks(model, masks, tile=plan_tile)
"""

from __future__ import annotations

import fnmatch
import json
import os
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from patchc.config import DEFAULT_EXCLUDE
from patchc.ir import targets
from patchc.utils.files import atomic_path
from patchc.pruning.calibrate import default_layers

FORMATS = ("patch", "maskllm")
META_KEY = "__meta__"
SHAPE_SUFFIX = ".__shape__"
MASKLLM_SUFFIX = ".mask"
VERSION = 1


def _masks_of(plan_or_masks: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """{fqn: bool mask} and per-layer metadata from a TilePlan or a mapping of masks."""
    if hasattr(plan_or_masks, "layers") and not isinstance(plan_or_masks, Mapping):
        masks, info = {}, {}
        for fqn, layer in plan_or_masks.layers.items():
            masks[fqn] = layer.mask()
            info[fqn] = {"tile": list(layer.tile), "density": float(layer.density)}
        return masks, info
    if not isinstance(plan_or_masks, Mapping):
        raise TypeError(f"save_npz takes a TilePlan or a dict of masks, got {type(plan_or_masks).__name__}")
    return dict(plan_or_masks), {}


def _pack(fqn: str, mask: torch.Tensor) -> np.ndarray:
    mask = torch.as_tensor(mask)
    if mask.dim() != 2:
        raise ValueError(f"{fqn}: masks must be 2-D (N, K), got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if not torch.all((mask == 0) | (mask == 1)):
            raise ValueError(f"{fqn}: mask values must be 0/1 (or bool)")
        mask = mask.bool()
    return np.packbits(mask.detach().cpu().numpy().reshape(-1))


def save_npz(plan_or_masks: Any, path: str | os.PathLike, format: str = "patch", meta: dict | None = None) -> Path:
    """Write masks as a PATCH or MaskLLM `.npz`, atomically; returns the path written.

    Args:
        plan_or_masks: a `patchc.TilePlan` (its layers' masks) or {weight FQN: bool (N, K)}.
        path: the file; written exactly there (no ".npz" appended), via a temp file + os.replace.
        format: "patch" (masks + shapes + JSON "__meta__") or "maskllm" ("<fqn>.mask" only).
        meta: extra JSON-serialisable metadata for the PATCH "__meta__" entry.

    Example:
        >>> save_npz({"fc.weight": torch.ones(4, 8, dtype=torch.bool)}, "m.npz", format="maskllm")
    """
    if format not in FORMATS:
        raise ValueError(f"save_npz: unknown format {format!r}; choose one of {FORMATS}")
    masks, info = _masks_of(plan_or_masks)
    arrays: dict[str, np.ndarray] = {}
    for fqn, mask in masks.items():
        if fqn == META_KEY or fqn.endswith(SHAPE_SUFFIX):
            raise ValueError(f"{fqn}: this weight name collides with the PATCH format's reserved keys")
        packed = _pack(fqn, mask)
        if format == "patch":
            arrays[fqn] = packed
            arrays[fqn + SHAPE_SUFFIX] = np.asarray(tuple(mask.shape), dtype=np.int64)
        else:
            arrays[fqn + MASKLLM_SUFFIX] = packed
    if format == "patch":
        header = {"producer": "patchc", "format": "patch", "version": VERSION, "layers": info, **(meta or {})}
        arrays[META_KEY] = np.asarray(json.dumps(header, default=str))
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # a file object: numpy appends no ".npz"
        np.savez_compressed(f, **arrays)
    return path


def detect_format(keys: list[str]) -> str:
    """"patch" if the archive has "__meta__" or "<key>.__shape__" entries, else "maskllm" if every key ends in
    ".mask"."""
    if META_KEY in keys or any(k.endswith(SHAPE_SUFFIX) for k in keys):
        return "patch"
    if keys and all(k.endswith(MASKLLM_SUFFIX) for k in keys):
        return "maskllm"
    raise ValueError(
        "not a PATCH mask file (no '__meta__' / '<key>.__shape__' entries) nor a MaskLLM one "
        f"(not every key ends in '.mask'); keys: {sorted(keys)[:8]}"
    )


def _model_weights(model: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(every weight FQN -> the (N, K) shape its mask has, the FQNs a mask file is expected to cover).

    Masks are (N, K) as plans and `oneshot` give them: a GPT-2 Conv1D weight, stored (K, N), is read as its
    transpose, and a fused expert weight as one "<param>.<e>" matrix per expert (`patchc.ir.targets`).
    """
    if isinstance(model, Mapping):  # a state_dict: no module to say which weights are stored transposed
        shapes = {k: tuple(v.shape) for k, v in model.items()}
        expected = {k for k, s in shapes.items() if len(s) == 2 and s[1] % 4 == 0 and not _excluded(k)}
        return shapes, expected
    if hasattr(model, "observe_inputs") and hasattr(model, "graph_module"):  # a MaskedProgram
        params = dict(model.graph_module.named_parameters(remove_duplicate=False))
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        return shapes | {fqn: tuple(mask.shape) for fqn, mask in model.layers.items()}, set(model.layers)
    if isinstance(model, nn.Module):
        params = dict(model.named_parameters(remove_duplicate=False))
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        shapes |= {name: tuple(targets.read(model, t).shape) for name, t in targets.model_matrices(model).items()}
        expected = {f for f, k in default_layers(model).items() if k % 4 == 0}
        return shapes, expected
    raise TypeError(f"load_npz needs an nn.Module, a MaskedProgram or a state_dict, got {type(model).__name__}")


def _excluded(fqn: str) -> bool:
    return any(fnmatch.fnmatchcase(fqn, g) for g in DEFAULT_EXCLUDE)


def load_npz(path: str | os.PathLike, model: Any, strict: bool = True) -> dict[str, torch.Tensor]:
    """Read a PATCH or MaskLLM mask file (auto-detected) and check it against `model`.

    Args:
        path: the `.npz` file.
        model: an nn.Module, a `MaskedProgram` or a state_dict: gives the weight names and shapes. A mask is
            (N, K) as plans and `oneshot` give it: through a module, a GPT-2 Conv1D weight reads as its
            transpose and a fused expert weight as "<param>.<e>" per expert; a state_dict knows neither, so
            pass the module for such a model.
        strict: also require a mask for every layer masked by default (every nn.Linear weight with
            K % 4 == 0, not matched by DEFAULT_EXCLUDE and not a tied LM head; a program's masked
            layers; for a state_dict, its 2-D weights so selected); False allows partial files.

    Returns {weight FQN: bool (N, K)} on the CPU.

    Raises ValueError naming the file and listing exactly the keys that are missing, unexpected
    (not weights of the model), wrong-shaped (file vs model shape) or of the wrong packed length.

    Example:
        >>> masks = load_npz("maskllm_masks.npz", model)
    """
    path = Path(path)
    data = read_arrays(path)
    try:
        fmt = detect_format(list(data))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    shapes, expected = _model_weights(model)

    problems: dict[str, list[str]] = {"missing": [], "unexpected": [], "wrong shape": [], "wrong packed length": []}
    packed: dict[str, np.ndarray] = {}
    file_shapes: dict[str, tuple[int, ...]] = {}
    if fmt == "patch":
        for key, arr in data.items():
            if key == META_KEY:
                continue
            if key.endswith(SHAPE_SUFFIX):
                fqn = key[: -len(SHAPE_SUFFIX)]
                file_shapes[fqn] = tuple(int(v) for v in np.asarray(arr).reshape(-1))
                if fqn not in data:
                    problems["missing"].append(f"{fqn} (has '{key}' but no packed mask)")
            else:
                packed[key] = arr
                if key + SHAPE_SUFFIX not in data:
                    problems["missing"].append(f"{key + SHAPE_SUFFIX} (shape of the mask '{key}')")
    else:
        packed = {k[: -len(MASKLLM_SUFFIX)]: v for k, v in data.items()}

    masks: dict[str, torch.Tensor] = {}
    for fqn, bits in packed.items():
        if fqn not in shapes:
            param, index = targets.expert_slice(fqn)
            expert = index is not None and param in shapes  # a state dict's fused expert weight
            problems["unexpected"].append(f"{fqn} (" + ("an expert of a fused weight: pass the model, whose experts "
                                          "it reads, not a state dict)" if expert else "the model has no such weight)"))
            continue
        shape = shapes[fqn]
        if len(shape) != 2:
            problems["wrong shape"].append(f"{fqn}: the model's weight has shape {shape}, not 2-D")
            continue
        if fqn in file_shapes and file_shapes[fqn] != shape:
            problems["wrong shape"].append(f"{fqn}: file {file_shapes[fqn]} vs model {shape}")
            continue
        numel = shape[0] * shape[1]
        want = (numel + 7) // 8
        if bits.dtype != np.uint8 or bits.ndim != 1 or bits.size != want:
            problems["wrong packed length"].append(
                f"{fqn}: {bits.size} {bits.dtype} values (shape {bits.shape}) vs {want} uint8 for shape {shape}"
            )
            continue
        flat = np.unpackbits(bits, count=numel).astype(bool)
        masks[fqn] = torch.from_numpy(flat.reshape(shape).copy())
    if strict:
        problems["missing"] += [f"{f} (a masked layer of the model)" for f in sorted(expected - set(packed))]

    lines = [f"  {what}: {', '.join(items)}" for what, items in problems.items() if items]
    if lines:
        raise ValueError(
            f"{path}: {fmt} mask file does not match the model:\n" + "\n".join(lines)
            + ("\n(pass strict=False to allow files that cover only some layers)" if problems["missing"] else "")
        )
    return masks


def read_arrays(path: Path, keys: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The arrays of the .npz at `path` (only those of `keys` it holds, when given: a 7B file's masks are GBs), or
    ValueError `PATH: cannot read as a .npz mask file (<why>)`: numpy's errors name no file, and one advises
    allow_pickle, which would unpickle whatever a foreign file holds."""
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            why = "one .npy array, not a .npz archive of masks"
        else:
            with archive:
                return {k: archive[k] for k in archive.files if keys is None or k in keys}
    except OSError as e:
        why = e.strerror or str(e)
    except EOFError:
        why = "empty"
    except (zipfile.BadZipFile, zlib.error) as e:  # cut short, or a member's bytes changed
        why = f"a damaged zip archive: {e}"
    except ValueError as e:  # numpy refuses pickles: name what the file is instead
        why = ("holds Python objects, not arrays of numbers" if "Object arrays" in str(e)
               else "neither a .npz (zip) archive nor a .npy array" if "pickle" in str(e) else str(e))
    raise ValueError(f"{path}: cannot read as a .npz mask file ({why})")


def read_meta(path: str | os.PathLike) -> dict:
    """The PATCH "__meta__" JSON of a mask file ({} for MaskLLM files); ValueError naming the file if unreadable."""
    data = read_arrays(Path(path), (META_KEY,))
    if META_KEY not in data:
        return {}
    try:
        meta = json.loads(str(data[META_KEY][()]))
    except ValueError as e:
        raise ValueError(f"{path}: its {META_KEY} entry is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: its {META_KEY} entry is JSON {type(meta).__name__}, not an object")
    return meta


__all__ = ["save_npz", "load_npz", "read_arrays", "read_meta", "detect_format", "FORMATS"]
