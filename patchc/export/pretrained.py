"""`export_pretrained` / `export_run`: a pruned model as an HF-style folder; `from_pretrained`: load it back.

The folder (written atomically: built in a temporary sibling, then renamed into place)::

    config.json               the model's config (transformers), or patchc's llama2.c config (`arch.py`)
    generation_config.json    causal transformers models that have one
    model.safetensors         plain tensors as-is + plan layers as tile-plan buffers (`format.py`): a weight,
                              a Conv1D weight as (N, K), or an expert slice "<3-D param>.<e>"; a 3-D
                              expert weight with an unplanned slice is also stored whole. Above
                              `max_shard_size`: model-0000i-of-0000n.safetensors + model.safetensors.index.json
                              (`shards.py`, transformers' layout; a layer's buffers stay in one shard)
    patchc_config.json        format + version, how to rebuild the model, tied names, the model dtype,
                              per planned layer shape / tile / dtype / tiles / density, plan skipped + meta
    tokenizer files           copied (HF tokenizer files; llama2.c's tok*.bin)

`from_pretrained` rebuilds the model from config.json (never a download), loads the plain tensors and,
for the planned weights, installs the runtime's `TileLinear` through `patchc.runtime.compile` (on CPU the
exact dense fallback runs), or with `dense=True` writes W * M into plain modules.

Example:
    >>> export_pretrained(plan, model, "out/stories-pruned", tokenizer_from=STORIES260K_DIR)
    >>> model = patchc.from_pretrained("out/stories-pruned")           # TileLinear where planned
    >>> tok = load_tokenizer("out/stories-pruned")
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patchc.export.arch import ModelSpec, copy_tokenizer, describe, rebuild, save_config
from patchc.export.format import (CONFIG, FORMAT, SHARDED_VERSION, VERSION, WEIGHTS, ExportError, check_header,
                                  read_weights, write_weights)
from patchc.export.outdir import atomic_dir, prepare_out
from patchc.export.shards import DEFAULT_MAX_SHARD, parse_size
from patchc.ir import LayerPlan, PlanError, TilePlan, targets
from patchc.ir.file_format import FLOAT_DTYPES, dtype_name
from patchc.ir.layer_slot import LayerSlot
from patchc.ir.provenance import check_weights
from patchc.utils.files import check_apart, read_record
from patchc.utils.progress import progress

Run = str | os.PathLike


def export_pretrained(plan: TilePlan, model: nn.Module, out_dir: Run, *, tokenizer_from: Any = None,
                      config: Any = None, overwrite: bool = False, info: dict | None = None,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD) -> Path:
    """Write `plan` applied to `model` as an HF-style folder `out_dir` (see the module docstring); returns it.
    Written atomically (`outdir.atomic_dir`), which first cleans up what a killed export left beside it.

    `model` is the dense model the plan was made for (it is not modified); `tokenizer_from` a folder or
    checkpoint file whose tokenizer files to copy, or a tokenizer with `save_pretrained`; `config`
    overrides the model's config; `info` is stored in patchc_config.json under "source"; weights above
    `max_shard_size` (bytes, or "5GB" / "2GiB" as `save_pretrained` takes it) are split into shards.
    Refuses an existing non-empty `out_dir` unless `overwrite=True`.

    Example:
        >>> export_pretrained(plan, bundle.model, "out/pruned", tokenizer_from=bundle.source)
    """
    plan.verify()
    where = layer_targets(plan, model, f"the {type(model).__name__}", "export the model the plan was made for")
    check_weights(plan, model)  # the plan's kept weights must be this model's, or the export mixes two models
    return write_export(model, out_dir, where, {fqn: layer.slot() for fqn, layer in plan.layers.items()},
                        plan.layers.__getitem__, skipped=plan.skipped, meta=plan.meta, tokenizer_from=tokenizer_from,
                        config=config, overwrite=overwrite, info=info, max_shard_size=max_shard_size)


def write_export(model: nn.Module, out_dir: Run, where: dict[str, targets.Target], slots: dict[str, LayerSlot],
                 pack: Callable[[str], LayerPlan], *, skipped: dict[str, str], meta: dict, tokenizer_from: Any = None,
                 config: Any = None, overwrite: bool = False, info: dict | None = None,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD) -> Path:
    """The folder of `export_pretrained` for the layers `slots` names (where each lives in `model`: `where`),
    each packed by `pack(fqn)` only as the weights file reaches it: the plan is never held whole (`patchc
    import` plans a model larger than memory this way). `skipped` and `meta` are stored as the plan's."""
    out = Path(out_dir)
    shard_bytes = shard_limit(out, max_shard_size)
    spec = describe(model)
    plain, tied = split_state(model, planned_params(model, where), spec.prefix)
    stored = {fqn: fqn.removeprefix(spec.prefix) for fqn in slots}
    weight = next(model.parameters())
    with atomic_dir(out, overwrite) as tmp:
        save_config(spec, model, tmp, config)
        tokenizer = copy_tokenizer(tokenizer_from, tmp, spec)
        packed = ((stored[fqn], pack(fqn)) for fqn in progress(slots, desc="writing planned layers", unit="layer",
                                                              disable=len(slots) < 64))
        weights = write_weights(tmp, plain, {stored[fqn]: slot for fqn, slot in slots.items()}, packed, shard_bytes)
        numel = sum(slot.numel for slot in slots.values())
        body = {
            "format": FORMAT, "version": VERSION if weights == WEIGHTS else SHARDED_VERSION, "weights": weights,
            "model": spec.to_dict(), "tied": tied,
            "dtype": dtype_name(weight.dtype), "tokenizer": tokenizer,
            "layers": {stored[fqn]: {"shape": list(s.shape), "tile": list(s.tile), "dtype": dtype_name(s.dtype),
                                     "dense_tiles": s.n_dense, "sparse_tiles": s.n_sparse,
                                     "density": round(s.density, 6)}
                       for fqn, s in slots.items()},
            "plan": {"density": sum(s.n_kept for s in slots.values()) / numel if numel else 1.0,
                     "skipped": dict(skipped), "meta": dict(meta)},
            "bytes": {"plan": sum(s.nbytes() for s in slots.values()),
                      "plain": sum(t.numel() * t.element_size() for t in plain.values())},
            "source": dict(info or {}),
        }
        (tmp / CONFIG).write_text(json.dumps(body, indent=2) + "\n")
    return out


def shard_limit(out: Path, max_shard_size: int | str) -> int:
    """`max_shard_size` in bytes (`shards.parse_size`), or ExportError naming the output folder."""
    try:
        return parse_size(max_shard_size)
    except ValueError as e:
        raise ExportError(f"{out}: {e}") from None


def layer_targets(plan: TilePlan, model: nn.Module, what: str, todo: str) -> dict[str, targets.Target]:
    """{layer: where it lives in `model`} (a parameter, its transpose or an expert slice: `patchc.ir.targets`),
    or ExportError naming the layer when `model` lacks it or holds it in another shape."""
    try:
        return targets.resolve_layers(plan, model)
    except PlanError as e:
        raise ExportError(f"{what}: {e}; {todo}") from None  # e names the layer and what is wrong


def planned_params(model: nn.Module, where: dict[str, targets.Target]) -> set[str]:
    """Parameters the plan's buffers hold whole: 2-D planned weights, and 3-D expert weights whose every
    slice is planned (one with an unplanned slice is stored as-is; its planned slices are overwritten)."""
    slices: dict[str, set[int]] = {}
    out = set()
    for t in where.values():
        if t.expert is None:
            out.add(t.param)
        else:
            slices.setdefault(t.param, set()).add(t.expert)
    out |= {p for p, seen in slices.items() if len(seen) == model.get_parameter(p).shape[0]}
    return out


def split_state(model: nn.Module, planned: set[str], prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(plain tensors to store, {tied alias: stored name}), names without `prefix`; planned weights left out.

    A tensor shared by several names (a tied LM head) is stored once, under its first name."""
    first: dict[int, str] = {}
    plain: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not name.startswith(prefix):
            raise ExportError(f"tensor {name!r} lies outside the wrapped model ({prefix!r}); cannot store it")
        short = name.removeprefix(prefix)
        if id(t) in first:
            tied[short] = first[id(t)]
            continue
        first[id(t)] = short
        if name not in planned:
            plain[short] = t.detach()
    return plain, tied


def export_run(run_dir: Run, out_dir: Run, *, model: str | None = None, overwrite: bool = False,
               max_shard_size: int | str = DEFAULT_MAX_SHARD) -> Path:
    """Export a `patchc prune` run folder's plan.patch, or a plan file (its plan-recovered.patch, say), to
    `out_dir`; returns it.

    The model is loaded with `patchc.models.load_model` from `model`, else from the spec the run's report.json
    records, else the plan's own record of it; `max_shard_size` as `export_pretrained`.
    Example: `export_run("runs/stories260K", "out/stories260K-pruned")`,
    `export_run("runs/stories260K/plan-recovered.patch", "out/stories260K-recovered")`.
    """
    from patchc.models import load_model

    shard_limit(Path(out_dir), max_shard_size)  # before the model loads
    given = Path(run_dir)
    plan_file = given if given.is_file() else given / "plan.patch"
    if not plan_file.is_file():
        raise ExportError(f"{given}: no plan.patch; give the folder `patchc prune` wrote (runs/<name>) or a plan file")
    run = plan_file.parent
    plan = TilePlan.load(plan_file)
    spec = model or recorded_spec(run, plan)
    # --overwrite replaces --out whole: it must not be (or hold) the run, or the model it loads
    sources = [("the run folder", run)] + [("the model", spec)] * Path(spec).exists()
    check_apart(out_dir, sources, "choose an --out apart from it (inside it is fine)", error=ExportError)
    prepare_out(Path(out_dir), overwrite)  # before the model loads; the export checks again as it writes
    bundle = load_model(spec)
    source = bundle.source if bundle.tokenizer is not None else None
    return export_pretrained(plan, bundle.model, out_dir, tokenizer_from=source, overwrite=overwrite,
                             info={"run": str(run), "plan": plan_file.name, "model": spec},
                             max_shard_size=max_shard_size)


def recorded_spec(run: Path, plan: TilePlan) -> str:
    """The model spec of the run that made `plan`: its report.json's (`model_spec`), else the plan's record."""
    if (run / "report.json").is_file():
        return model_spec(read_record(run / "report.json", "report", "pass model= (CLI: --model)"), run)
    if isinstance(plan.meta.get("model"), str) and plan.meta["model"]:
        return plan.meta["model"]
    raise ExportError(f"{run}: no report.json, and the plan records no model; pass model= (CLI: --model)")


def model_spec(report: dict, run: Path) -> str:
    """The model spec a run used: a recorded spec, the command's --model, the prune default, or its name."""
    for key in ("model_spec", "model_source", "source"):
        if isinstance(report.get(key), str) and report[key]:
            return report[key]
    words = shlex.split(str(report.get("command") or ""))
    for i, w in enumerate(words):
        if w == "--model" and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--model="):
            return w.split("=", 1)[1]
    if words[:2] == ["patchc", "prune"]:
        from patchc.job.options import DEFAULT_MODEL

        return DEFAULT_MODEL
    if isinstance(report.get("model"), str) and report["model"]:
        return report["model"]
    raise ExportError(f"{run / 'report.json'}: records no model spec; pass model= (CLI: --model)")


def read_config(folder: Path) -> dict:
    """patchc_config.json of an exported folder, its format and version checked."""
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such folder")
    path = folder / CONFIG
    if not path.is_file():
        raise ExportError(f"{folder}: no {CONFIG}; not a folder written by patchc export "
                          "(a plain transformers folder loads with patchc.models.load_model)")
    return check_header(path, path.read_text(), CONFIG)


def load_plan(path: Run) -> TilePlan:
    """The TilePlan stored in an exported folder, keyed by the loaded model's weight names.

    Example: `load_plan("out/pruned").summary()`."""
    return read_export(Path(path))[2]


def read_export(folder: Path) -> tuple[dict, ModelSpec, TilePlan, dict[str, torch.Tensor]]:
    """(patchc_config.json, model spec, plan, plain tensors by the model's names) of an exported folder."""
    body = read_config(folder)
    spec = ModelSpec(**body["model"])
    weights = body.get("weights", WEIGHTS)
    if not isinstance(weights, str) or Path(weights).name != weights:
        raise ExportError(f"{folder / CONFIG}: 'weights' must name a file in the folder, not {weights!r}")
    plain, layers = read_weights(folder / weights, spec.prefix)
    expected = {spec.prefix + fqn for fqn in body["layers"]}
    if set(layers) != expected:
        odd = sorted(set(layers) ^ expected)[0]
        raise ExportError(f"{folder}: layer {odd} is in one of {CONFIG} / {weights} but not the other")
    # fingerprints describe the dense weights, which an export does not hold: loading checks kept values
    meta = {k: v for k, v in body["plan"].get("meta", {}).items() if k != "fingerprints"}
    plan = TilePlan(layers=layers, skipped=body["plan"].get("skipped", {}), meta=meta)
    return body, spec, plan, {spec.prefix + k: v for k, v in plain.items()}


def from_pretrained(path: Run, *, dense: bool = False, device: Any = "cpu", dtype: torch.dtype | None = None,
                    tune: bool | str = True) -> nn.Module:
    """Load an exported folder: the model in eval mode, `TileLinear` where planned (or W * M dense).

    `dtype`: None keeps the exported model's dtype. `tune`: as `patchc.compile` (CPU: defaults).
    Errors name the folder: missing files, another format version, a planned layer the model lacks.

    Example:
        >>> model = patchc.from_pretrained("out/pruned")                 # CPU: exact dense fallback
        >>> model = patchc.from_pretrained("out/pruned", device="cuda", dtype=torch.float16)
    """
    folder = Path(path)
    body, spec, plan, plain = read_export(folder)
    model = rebuild(folder, spec, dtype or FLOAT_DTYPES.get(body.get("dtype"), torch.float32))
    load_plain(folder, model, plan, plain, {spec.prefix + a: spec.prefix + t for a, t in body["tied"].items()})
    del plain  # loaded: the model holds its own copies
    if dense:
        plan.apply(model.to(device=device), force=True)
        return model.eval()
    from patchc.runtime import compile as compile_model

    # compiled where the model was built (CPU) with the packed layers placed on `device`, then the rest moved:
    # the weights the TileLinears replace are never written, so their dense size is never taken on the device.
    # force: they hold no values yet (the plan is the folder's own), so there is nothing to check them against
    model = compile_model(model, plan, tune=tune, inplace=True, force=True, device=device)
    return model.to(device=device).eval()


def load_plain(folder: Path, model: nn.Module, plan: TilePlan, plain: dict[str, torch.Tensor],
               tied: dict[str, str]) -> None:
    """Load the plain tensors into `model`; refuse any name mismatch. The planned weights are left for
    `plan.apply` (which `patchc.compile` runs too) to fill with W * M, except one that another name is tied to."""
    params = dict(model.named_parameters(remove_duplicate=False))
    where = layer_targets(plan, model, f"{folder}: the model built from config.json",
                          "config.json and the weights do not match")
    result = model.load_state_dict(plain, strict=False)
    if result.unexpected_keys:
        raise ExportError(f"{folder}: tensor {result.unexpected_keys[0]!r} in the weights is not in the model "
                          "built from config.json")
    missing = sorted(set(result.missing_keys) - planned_params(model, where) - set(tied))
    if missing:
        raise ExportError(f"{folder}: tensor {missing[0]!r} of the model is missing from the weights")
    with torch.no_grad():
        for fqn, layer in plan.layers.items():
            if where[fqn].param in tied.values():  # copied to its alias below: needs its values now
                targets.read(model, where[fqn]).copy_(layer.to_dense())  # a view: the slice / transpose in place
        for alias, target in tied.items():
            src = model.get_parameter(target) if target in params else model.get_buffer(target)
            dst = params.get(alias)
            if dst is not None and dst is not src:
                dst.copy_(src)


def load_tokenizer(path: Run) -> Any:
    """The tokenizer saved in an exported folder: llama2.c's `Tokenizer`, or patchc's `HFTokenizer`.

    Example: `load_tokenizer("out/pruned").encode("Once upon a time")`."""
    folder = Path(path)
    body = read_config(folder)
    spec = ModelSpec(**body["model"])
    if spec.family == "llama2c":
        from patchc.models import load_tokenizer as load_llama2c_tokenizer

        files = sorted(folder.glob("tok*.bin"))
        if not files:
            raise ExportError(f"{folder}: no llama2.c tokenizer (tok*.bin) was exported with this model")
        return load_llama2c_tokenizer(files[0])
    from patchc.models.bundle import HFTokenizer
    from patchc.models.hf import load_hf_tokenizer

    hf = load_hf_tokenizer(folder)
    if hf is None:
        raise ExportError(f"{folder}: no tokenizer files were exported with this model")
    return HFTokenizer(hf, spec.kind)
