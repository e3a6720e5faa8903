"""`patchc import`: a model that is already 2:4 (or hybrid) in, a folder `patchc.from_pretrained` serves out.

People with sparse models keep them in one of these layouts, and all of them come in:

    dense weights        the pruned weights are zeros (what SparseGPT / Wanda scripts save,
                         compressed-tensors' "dense" sparsity format, a llama2.c checkpoint)
    sparse-24-bitmask    compressed-tensors' own (`legacy.py`), which transformers and compressed-tensors
                         no longer read: kept values + a bitmask per weight, float or FP8 / int8 with scales;
                         and its unstructured "sparse-bitmask", which 2:4 checkpoints were saved in too
    marlin-24            int4 / int8 2:4 values in Sparse-Marlin's layout (`marlin24.py`: the "w4a16"
                         releases), dequantized: served as fp16 / bf16 2:4 tiles

The stages (`import_sparse`):

    decode    a compressed checkpoint -> a dense-weight folder beside the output, one decoded tensor at a
              time into files of 256 MiB (deleted at the end): transformers then loads it, with its own
              key conversions
    load      `patchc.models.load_model` in the checkpoint's dtype (offline; a missing weight is an error)
    survey    which weights to plan (nn.Linear, Conv1D and fused experts' slices: `survey_linears`) and
              their tile kinds, packing nothing: a tile is 2:4 iff every group of 4 holds at most 2
              nonzeros; weights without a 2:4 tile stay plain. Without a tile, the widest square that
              keeps the model's 2:4 tiles and fits its shapes (`infer_tile`: 128 x 128 for a large model
              2:4 throughout)
    export    `write_export`: the folder, written atomically, each layer packed as the weights file
              reaches it and dropped once written (the plan is never held whole)

Example:
    >>> summary = import_sparse("my-llama-2of4/", "served/")   # tile: inferred, (128, 128) here
    >>> print(summary.format())
    >>> model = patchc.from_pretrained("served/", device="cuda")
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from patchc.config import check_tile_sides
from patchc.export.format import ExportError
from patchc.export.legacy import LAYOUTS, MARLIN, decoded_tensors
from patchc.export.outdir import DECODED, prepare_out
from patchc.export.pretrained import shard_limit, write_export
from patchc.export.shards import DEFAULT_MAX_SHARD, INDEX, write_index
from patchc.ir import targets
from patchc.ir.file_format import FLOAT_DTYPES
from patchc.ir.from_pruned import MAX_PADDING, layer_from_linear, pick_tile, sparse_coverage, survey_linears
from patchc.ir.layer_slot import LayerSlot
from patchc.ir.tiles import padded_numel, tile_pair
from patchc.utils.files import check_apart
from patchc.utils.owners import owner_tag

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".gguf", ".msgpack", ".h5")


@dataclass(frozen=True)
class ImportSummary:
    """What `import_sparse` wrote: the folder, the source layout and the plan's tile counts."""

    out: Path
    layout: str
    dtype: str
    tile: tuple[int, int]
    layers: int
    sparse_tiles: int
    dense_tiles: int
    plan_bytes: int
    dense_bytes: int
    left_dense: dict[str, str] = field(default_factory=dict)
    coverage: dict[int, int] | None = None  # inferred tile: `sparse_coverage`, {side: weights in 2:4 tiles}
    padded: dict[int, int] | None = None  # and {side: weights with the edge tiles' padding}

    def format(self) -> str:
        """A few lines for the terminal: tiles, bytes, the layers left dense and how to load the folder."""
        total = self.sparse_tiles + self.dense_tiles
        lines = [
            f"source layout: {self.layout}; {self.layers} layers planned at tile {self.tile[0]}x{self.tile[1]}"
            f"{' (inferred from the zeros; --tile sets it)' if self.coverage else ''}, "
            f"{self.dtype}: {self.sparse_tiles} of {total} tiles 2:4 ({self.sparse_tiles / max(total, 1):.1%}), "
            f"{self.dense_tiles} dense",
            f"planned weights: {self.plan_bytes / 2**20:.2f} MiB against {self.dense_bytes / 2**20:.2f} MiB dense "
            f"({self.plan_bytes / max(self.dense_bytes, 1):.3f}x)",
        ]
        if self.layout == MARLIN:
            lines.append(f"its int4 / int8 values are served dequantized, as {self.dtype} 2:4 tiles: larger than the "
                         "checkpoint (patchc has no int4 kernels)")
        if self.coverage and self.padded and self.tile[0] < 64 and self.coverage[64] and \
                self.padded[64] <= MAX_PADDING * self.padded[16]:  # 64 x 64 keeps some and fits the shapes
            share = self.coverage[64] / self.coverage[16]
            lines.append(f"at 64x64 the 2:4 tiles would hold {share:.0%} of these 2:4 weights: tiles under 64x64 keep "
                         "them but stream weights more slowly on a large model (--tile 64 64 for speed)")
        if self.left_dense:
            reasons = Counter(self.left_dense.values())
            lines.append(f"left as plain weights: {len(self.left_dense)} ("
                         + "; ".join(f"{n}: {why}" for why, n in reasons.most_common()) + ")")
        lines.append(f"wrote {self.out.resolve()}; load it with patchc.from_pretrained({str(self.out)!r})")
        return "\n".join(lines)


def import_sparse(src: str | os.PathLike, out: str | os.PathLike, *, tile: tuple[int, int] | int | None = None,
                  dtype: torch.dtype | None = None, overwrite: bool = False,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD) -> ImportSummary:
    """Write the 2:4 / hybrid model `src` (see the module docstring) as a patchc export folder `out`.

    `tile`: None infers it from the zeros (`from_pruned.infer_tile`); `dtype`: the served weights' dtype (None: the
    checkpoint's own, fp32 when it names none; fp16 for marlin-24, whose int4 values times fp16 scales are fp16
    numbers, as Sparse-Marlin ran them); `max_shard_size`: as `export_pretrained`. Raises ExportError naming the
    checkpoint when no linear layer holds a 2:4 tile, or when `out` is in the way.

    Example:
        >>> import_sparse("runs/sparsegpt-2of4/", "served/", tile=64).sparse_tiles
        4096
        >>> import_sparse("runs/sparsegpt-2of4/", "served/", overwrite=True).tile
        (128, 128)
    """
    from patchc.models import load_model

    tile = None if tile is None else _check_tile(tile_pair(tile, "patchc import"))
    coverage = padded = None
    out = Path(out)
    # --overwrite replaces --out whole: it must not be (or hold) the checkpoint it reads
    check_apart(out, [("the checkpoint", src)] * Path(src).exists(),
                "choose an --out apart from it (inside it is fine)", error=ExportError)
    prepare_out(out, overwrite, decoded=True)  # before any long stage; the export checks both again as it writes
    shard_limit(out, max_shard_size)
    config = checkpoint_config(src)
    layout = checkpoint_layout(src, config)
    with decoded(src, layout, out.parent) as folder:
        bundle = load_model(folder, dtype=dtype or (torch.float16 if layout == MARLIN else checkpoint_dtype(config)))
        model = bundle.model
        if tile is None:
            coverage, padded = sparse_coverage(model)
            tile = pick_tile(coverage, padded=padded)
        where, slots, left = survey(model, tile, str(src))
        weight = next(model.parameters())
        plan_bytes = sum(s.nbytes() for s in slots.values())
        dense_bytes = sum(s.numel * weight.element_size() for s in slots.values())
        stored = sum(padded_numel(s.shape, tile) for s in slots.values())
        if stored > 2 * sum(s.numel for s in slots.values()):  # edge tiles holding more padding than weights
            raise ExportError(f"{src}: tile {tile[0]}x{tile[1]} is wider than its weights: the planned weights would "
                              f"take {plan_bytes / 2**20:.2f} MiB against {dense_bytes / 2**20:.2f} MiB dense, most "
                              "of it padding; give a smaller --tile, or none to have it inferred")
        # each layer is packed as the file reaches it; no provenance check: it is packed from these very weights
        write_export(model, out, where, slots, lambda fqn: layer_from_linear(model, fqn, where[fqn], tile),
                     skipped=left, meta={"source": "patchc import", "tile": list(tile), **targets.recorded_meta(where)},
                     tokenizer_from=bundle.source if bundle.tokenizer is not None else None, overwrite=overwrite,
                     info={"imported": str(src), "layout": layout}, max_shard_size=max_shard_size)
    return ImportSummary(
        out=out, layout=layout, dtype=str(weight.dtype).removeprefix("torch."), tile=tile, layers=len(slots),
        sparse_tiles=sum(s.n_sparse for s in slots.values()), dense_tiles=sum(s.n_dense for s in slots.values()),
        plan_bytes=plan_bytes, dense_bytes=dense_bytes, left_dense=left, coverage=coverage, padded=padded)


def _check_tile(tile: tuple[int, int]) -> tuple[int, int]:
    check_tile_sides(tile, f"--tile {tile[0]} {tile[1]}", "e.g. --tile 128 128, or no --tile to have it inferred")
    return tile


def checkpoint_config(src: str | os.PathLike) -> dict:
    """The transformers config.json of a folder or of a name in the local Hugging Face cache, as a dict;
    {} for anything else (a llama2.c checkpoint; what does not load is named by `load_model` later)."""
    from patchc.models.hf import HFLoadError, hf_config

    path = Path(src)
    config = path / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise ExportError(f"{config}: not valid JSON ({e})") from None
    if path.exists():
        return {}
    try:
        return hf_config(str(src)).to_dict()
    except HFLoadError:
        return {}


def checkpoint_layout(src: str | os.PathLike, config: dict) -> str:
    """The compressed-tensors layout of a checkpoint stored sparse (`legacy.LAYOUTS`), else "dense weights"."""
    from patchc.models.hf import sparse_layout

    for key in ("quantization_config", "compression_config"):
        found = sparse_layout(config.get(key) or {})
        if found is not None:
            return found
    return "dense weights"


def checkpoint_dtype(config: dict) -> torch.dtype:
    """The float dtype a transformers config names ("dtype" / "torch_dtype"), else float32."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return FLOAT_DTYPES.get(name, torch.float32)


@contextlib.contextmanager
def decoded(src: str | os.PathLike, layout: str, parent: Path) -> Iterator[str]:
    """The checkpoint as dense weights: `src` itself, or for a compressed layout (`legacy.LAYOUTS`) a decoded
    copy in a temporary folder under `parent`, deleted when the block ends."""
    if layout not in LAYOUTS:
        yield str(src)
        return
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{DECODED}{owner_tag()}.", dir=parent))  # owner: a kill's is swept
    try:
        write_decoded(local_folder(str(src)), tmp, layout)
        yield str(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def local_folder(src: str) -> Path:
    """`src` itself when it is a folder, else its snapshot in the local Hugging Face cache (offline)."""
    if Path(src).is_dir():
        return Path(src)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(src, local_files_only=True))


def write_decoded(src: Path, dst: Path, layout: str = "sparse-24-bitmask", file_bytes: int = 1 << 28) -> None:
    """Write the dense-weight form of a `layout` (`legacy.LAYOUTS`) folder `src` into `dst`: the decoded tensors
    in files of about `file_bytes` each ("decoded-00001.safetensors", ...) with an index naming them, config.json
    without its quantization / sparsity config, and the other small top-level files (tokenizer, generation
    config) copied; other weights (an ``original/`` folder of .pth files, say) are not. Holds one file's worth
    of decoded tensors at a time, however large the checkpoint's own shards are."""
    from patchc.utils.progress import progress

    weight_map: dict[str, str] = {}
    batch: dict[str, torch.Tensor] = {}
    files = held = total = 0
    for key, tensor in progress(decoded_tensors(src, layout), desc=f"decoding {layout}", unit="tensor"):
        batch[key] = tensor.contiguous()
        held += tensor.nbytes
        if held >= file_bytes:
            files, total, held = _write_batch(dst, batch, weight_map, files), total + held, 0
        del tensor  # written away or in the batch: not held here while the next one decodes
    if batch or not weight_map:
        _write_batch(dst, batch, weight_map, files)
    write_index(dst, weight_map, total + held, {})
    config = json.loads((src / "config.json").read_text())
    for key in ("quantization_config", "compression_config"):
        config.pop(key, None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for p in src.iterdir():
        if p.is_file() and p.suffix not in WEIGHT_SUFFIXES and p.name not in (INDEX, "config.json"):
            shutil.copyfile(p, dst / p.name)
        elif p.is_dir() and p.name == "1_Pooling":  # a sentence-transformers encoder's pooling set-up
            shutil.copytree(p, dst / p.name)


def _write_batch(dst: Path, batch: dict[str, torch.Tensor], weight_map: dict[str, str], files: int) -> int:
    """Save `batch` as the next decoded file, record its names in `weight_map`, empty it; returns the file count."""
    from patchc.utils.safetensors_stream import write_streamed

    name = f"decoded-{files + 1:05d}.safetensors"
    layout = {key: (t.dtype, tuple(t.shape)) for key, t in batch.items()}
    write_streamed(dst / name, layout, batch.items(), {"format": "pt"})  # no second copy, as save_file makes
    weight_map.update(dict.fromkeys(batch, name))
    batch.clear()
    return files + 1


def survey(model: nn.Module, tile: tuple[int, int], src: str) -> tuple[dict[str, targets.Target],
                                                                      dict[str, LayerSlot], dict[str, str]]:
    """(where, slots, left) of every linear weight with a 2:4 tile (`survey_linears`: nothing packed yet);
    ExportError when no linear weight of `model` holds a 2:4 tile."""
    where, slots, left = survey_linears(model, tile)
    if not slots:
        raise ExportError(f"{src}: none of its {len(left)} linear weights holds a 2:4 tile at "
                          f"{tile[0]}x{tile[1]} (a 2:4 tile keeps at most 2 of every 4 weights along a row); not a "
                          "2:4 model? `patchc prune` learns a hybrid one from a dense model")
    return where, slots, left


__all__ = ["ImportSummary", "checkpoint_config", "checkpoint_dtype", "checkpoint_layout", "import_sparse", "survey",
           "write_decoded"]
