"""The transform driver, `patchc.transform`: an exported program in, a trainable masked program out.

The stages, in order:

    export (if given a module) -> ep.module() -> freeze weights -> annotate matmuls
        -> build one HybridMask per masked weight (+ one-shot prior) -> insert mask nodes
        -> MaskedProgram

Example:
    >>> ep = torch.export.export(model, (ids,), {"use_cache": False})   # an HF LM: no KV cache in its output
    >>> prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35))
    >>> opt = torch.optim.Adam(prog.mask_parameters(), lr=1e-3)
    >>> loss = task_loss(prog(ids)) + prog.regularizer(); loss.backward(); opt.step(); prog.step()
"""

from __future__ import annotations

import fnmatch
import inspect
import warnings
from collections.abc import Mapping

import torch
from torch import fx, nn

from patchc.config import DEFAULT_EXCLUDE, SMALLER_THAN_TILE, PatchConfig
from patchc.ir.targets import Target, matrix
from patchc.masking.hybrid_mask import HybridMask
from patchc.masking.param_mask import ParamMask
from patchc.models.per_length import PerLengthExport
from patchc.passes.find_linears import LinearSite, find_linear_sites
from patchc.passes.insert_masks import MASKS_ATTR, InsertMasks
from patchc.passes.program import MaskedProgram
from patchc.passes.seq_graphs import SeqGraphs


def _freeze_weights(gm: fx.GraphModule) -> None:
    """Give the graph module its own frozen Parameter objects over the same storage.

    `ep.module()` holds the user's Parameter objects; flipping their requires_grad would change the
    user's model, and copying would double memory. Tied weights stay tied.
    """
    replaced: dict[int, nn.Parameter] = {}
    for name, param in list(gm.named_parameters(remove_duplicate=False)):
        owner_name, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        frozen = replaced.setdefault(id(param), nn.Parameter(param.detach(), requires_grad=False))
        owner._parameters[leaf] = frozen


def _export(module: nn.Module, example_inputs: tuple, example_kwargs: dict | None, dynamic: bool):
    if example_inputs is None:
        raise ValueError("patchc.transform(module, cfg) needs example_inputs=(x,) to export the module")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    dynamic_shapes = None
    if dynamic:
        # Every tensor dim may vary (batch, sequence): training batches differ from the example.
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        dynamic_shapes = {
            name: {d: torch.export.Dim.AUTO for d in range(v.dim())} if isinstance(v, torch.Tensor) else None
            for name, v in bound.items()
        }
    try:
        return torch.export.export(module, args, kwargs=kwargs or None, dynamic_shapes=dynamic_shapes)
    except Exception as error:  # noqa: BLE001 - data-dependent control flow: one line naming the layer
        from patchc.models.hf_export import explain_export_failure

        explain_export_failure(module, error)
        raise


def no_sites_error(skipped: dict[str, str], tile: tuple[int, int]) -> ValueError:
    """Nothing to mask: say why, leading with the tile when it is larger than the weights."""
    small = sum(SMALLER_THAN_TILE in why for why in skipped.values())
    hint = f"; the tile {tuple(tile)} is larger than {small} of them: choose a smaller tile" if small else ""
    shown = dict(list(skipped.items())[:3])
    more = f" (+{len(skipped) - len(shown)} more)" if len(skipped) > len(shown) else ""
    return ValueError(f"patchc.transform found no maskable linear layer{hint}; skipped: {shown or 'none seen'}{more}")


def glob_warning(cfg: PatchConfig, masked: list[str], skipped: list[str]) -> str | None:
    """What the include / exclude globs did not do, or None: a glob of the user's that matched no weight a matmul
    reads (FQNs end in ".weight": "*q_proj" matches none), and weights that a default exclude would keep dense and
    a user's exclude, which replaces the default, leaves masked. Selection is unchanged: a typo only warns."""
    names = list(dict.fromkeys(masked + skipped))
    if not names:
        return None  # no matmul weight at all: `no_sites_error` says so

    def hits(glob: str, among: list[str] = names) -> list[str]:
        return [n for n in among if fnmatch.fnmatchcase(n, glob)]

    said = []
    for kind, globs in (("include", cfg.include), ("exclude", [g for g in cfg.exclude if g not in DEFAULT_EXCLUDE])):
        for glob in dict.fromkeys(globs):
            if not hits(glob):
                fix = next(((f, found[0]) for f in (glob + ".weight", glob + "*") if (found := hits(f))), None)
                said.append(f"{kind} glob {glob!r} matched no matmul weight" + (
                    f" (names end in '.weight': {fix[0]!r} would match {fix[1]!r})" if fix else ""))
    for glob in (g for g in DEFAULT_EXCLUDE if g not in cfg.exclude):
        if found := hits(glob, list(dict.fromkeys(masked))):
            more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
            said.append(f"{found[0]}{more} is masked: your exclude replaces the default (patchc.DEFAULT_EXCLUDE); "
                        f"add {glob!r} to keep it dense")
    return f"patchc.transform: {'; '.join(said)}" if said else None


def site_targets(sites: list[LinearSite]) -> dict[str, Target]:
    """Plan layer name -> where its (N, K) matrix lives (`patchc.ir.targets`), in graph order."""
    out: dict[str, Target] = {}
    for site in sites:
        for e, name in enumerate(site.names):
            out.setdefault(name, Target(name, site.fqn, e if site.experts is not None else None, site.transposed))
    return out


def build_masks(
    sites: list[LinearSite],
    gm: fx.GraphModule,
    cfg: PatchConfig,
    calib=None,
    prior_masks: Mapping[str, torch.Tensor] | None = None,
    prior: bool = True,
) -> dict[str, nn.Module]:
    """One mask module per masked parameter (graph order): a HybridMask, or a ParamMask holding one
    HybridMask per expert / over the transpose; each initialised N(0, init_std) + prior (unless not `prior`)."""
    from patchc.pruning.sparsegpt import shared_factors

    gen = torch.Generator().manual_seed(cfg.seed)
    masks: dict[str, nn.Module] = {}
    count = 0
    fallback: list[str] = []
    with shared_factors():  # a SparseGPT prior factors each input's Hessian once (q, k, v; 2:4, unstructured)
        for site in sites:
            if site.fqn in masks:
                continue
            param = gm.get_parameter(site.fqn)
            hybrids = []
            for e, name in enumerate(site.names):
                target = Target(name, site.fqn, e if site.experts is not None else None, site.transposed)
                mask = HybridMask(name, site.shape, cfg.tile, cfg.variant, index=count, seed=cfg.seed, hard=cfg.hard,
                                  nm_param=cfg.nm_param)
                count += 1
                mask.init_logits(cfg.init_std, gen)
                if cfg.prior != "random" and prior:
                    layer_cfg = cfg
                    if _uncalibrated(site, name, cfg, calib):
                        layer_cfg = cfg.replace(prior="magnitude")
                        fallback.append(name)
                    nm_prior, tile_prior = prior_logits(name, matrix(param, target), layer_cfg, calib, prior_masks)
                    # add_prior keeps the prior's choice as the argmax, so the "tile" variant's frozen 2:4
                    # logits harden to exactly the one-shot pattern.
                    mask.add_prior(nm_prior, tile_prior, cfg.init_std * cfg.prior_strength)
                hybrids.append(mask.to(param.device))
            plain = site.experts is None and not site.transposed
            masks[site.fqn] = hybrids[0] if plain else ParamMask(site.fqn, hybrids, site.experts is not None,
                                                                   site.transposed)
    if fallback:
        warnings.warn(f"patchc.transform: no calibration statistics for {len(fallback)} expert / Conv1D layer(s) "
                      f"(calibrate this model, or the program, with their plan names: patchc.calibrate(model, batches) "
                      f"covers them): they start from the magnitude prior instead of {cfg.prior!r}: {fallback[:4]}...",
                      stacklevel=3)
    return masks


def _uncalibrated(site: LinearSite, name: str, cfg: PatchConfig, calib) -> bool:
    """An expert slice or a (K, N) weight the calibration did not see, under a calibration-based prior."""
    needs = cfg.prior in ("wanda", "sparsegpt") and calib is not None
    return needs and name not in calib and (site.experts is not None or site.transposed)


def prior_logits(fqn: str, weight: torch.Tensor, cfg: PatchConfig, calib=None,
                 prior_masks: Mapping[str, torch.Tensor] | None = None):
    """(2:4 prior (N*K/4, 6), tile prior (Tn, Tk)) from one-shot masks, values in {-1, 0, 1}.

    `prior_masks[fqn]`, where present, is taken as the one-shot 2:4 mask of `cfg.prior` instead of
    computing it again (SparseGPT's costs seconds per layer).
    """
    from patchc.pruning import prune_weight
    from patchc.pruning.priors import nm_prior, tile_prior

    stats = None
    if cfg.prior in ("wanda", "sparsegpt"):
        if calib is None:
            raise ValueError(
                f"prior={cfg.prior!r} needs calibration statistics: pass calib=patchc.calibrate(model, batches)"
            )
        if fqn not in calib:
            raise ValueError(f"{fqn}: no calibration statistics for this layer (prior={cfg.prior!r})")
        stats = calib[fqn]
    w = weight.detach().float()
    mask24 = prior_masks.get(fqn) if prior_masks is not None else None
    if mask24 is None:
        mask24 = prune_weight(w, cfg.prior, "2:4", stats=stats)
    nm = nm_prior(mask24)
    tiles = None
    if cfg.variant != "nm":
        unstructured = prune_weight(w, cfg.prior, "unstructured", stats=stats, sparsity=cfg.sparsity)
        tiles = tile_prior(unstructured, cfg.tile, cfg.density)
    return nm, tiles


def transform(
    program: torch.export.ExportedProgram | nn.Module,
    cfg: PatchConfig | None = None,
    *,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
    dynamic: bool = True,
    calib=None,
    prior_masks: Mapping[str, torch.Tensor] | None = None,
    prior: bool = True,
) -> MaskedProgram:
    """Insert a learnable hybrid mask before every selected matmul weight.

    Args:
        program: a `torch.export.ExportedProgram` (training IR or after `run_decompositions()`),
            a `PerLengthExport` (a model exported at fixed sequence lengths: one graph per length,
            one set of masks), or an nn.Module, exported here with `example_inputs` (every dim
            dynamic when `dynamic`).
        cfg: the PatchConfig (default PatchConfig()).
        calib: `patchc.calibrate(...)` statistics, needed by the "wanda" and "sparsegpt" priors.
        prior_masks: {weight FQN: bool (N, K)} one-shot 2:4 masks of `cfg.prior` already computed for
            these very weights (`patchc.oneshot(model, cfg.prior, "2:4", calib=calib)`), reused for the
            prior; layers missing from it are computed here.
        prior: False leaves the logits at their seeded random init, without `cfg.prior` (and needs no
            `calib`): for a program whose logits a checkpoint replaces next (`train_masks(resume=True)`).

    Returns a `MaskedProgram`. The exported program's module shares weight storage with the user's
    model; patchc never writes to it. Include / exclude globs that matched no weight warn (`glob_warning`).

    Example:
        >>> prog = patchc.transform(model, PatchConfig(tile=(16, 16)), example_inputs=(ids,),
        ...                         example_kwargs={"use_cache": False})
        >>> sorted(prog.layers)[:1]
        ['layers.0.mlp.down_proj.weight']
    """
    cfg = cfg or PatchConfig()
    _refuse_transformed(program)
    per_length = program if isinstance(program, PerLengthExport) else None
    if per_length is not None:
        program = per_length.first
    if isinstance(program, nn.Module) and not isinstance(program, fx.GraphModule):
        program = _export(program, example_inputs, example_kwargs, dynamic)
    if not isinstance(program, (torch.export.ExportedProgram, fx.GraphModule)):
        raise TypeError(f"patchc.transform takes an ExportedProgram or nn.Module, got {type(program).__name__}")
    gm = program.module() if isinstance(program, torch.export.ExportedProgram) else program
    _refuse_transformed(gm)
    _refuse_unloaded(gm)
    _freeze_weights(gm)
    _warn_live_dropout(gm)
    sites, skipped = find_linear_sites(gm, cfg)
    if (unmatched := glob_warning(cfg, [s.fqn for s in sites], list(skipped))) is not None:
        warnings.warn(unmatched, stacklevel=2)
    if not sites:
        raise no_sites_error(skipped, cfg.tile)
    masks = build_masks(sites, gm, cfg, calib, prior_masks, prior)
    InsertMasks(sites, masks)(gm)
    prog = MaskedProgram(gm, sites, masks, skipped, cfg, targets=site_targets(sites),
                         call_kwargs=export_kwargs(program))
    if per_length is not None:
        prog.seq_graphs = SeqGraphs(per_length, gm, sites, masks, cfg)
    return prog


def _refuse_transformed(program) -> None:
    """A program that already has masks would get masks on masks (or an unrelated torch error)."""
    if isinstance(program, MaskedProgram) or (isinstance(program, nn.Module) and hasattr(program, MASKS_ATTR)):
        raise ValueError(
            "patchc.transform: this program is already transformed (it holds patchc masks); pass the original "
            "ExportedProgram or model, or keep training the MaskedProgram you have"
        )


DROPOUTS = ("aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default",
            "aten.alpha_dropout.default", "aten.feature_alpha_dropout.default")


def _warn_live_dropout(gm: fx.GraphModule) -> None:
    """Warn of dropout exported in training mode: the graph holds it with train=True, so `prog.eval()`
    cannot turn it off, and eval-mode scores and hardened masks see random noise (transformers models
    start in train mode: `model.eval()` before exporting)."""
    live = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in DROPOUTS
            and len(n.args) > 2 and n.args[2] is True and isinstance(n.args[1], (int, float)) and n.args[1] > 0]
    if live:
        warnings.warn(f"patchc.transform: the graph holds {len(live)} dropout op(s) in training mode (p = "
                      f"{live[0].args[1]}): the model was exported in train mode, and they stay on in prog.eval(); "
                      "call model.eval() before exporting", stacklevel=3)


def _refuse_unloaded(gm: fx.GraphModule) -> None:
    """Weights without values (the meta device, fake or lazy tensors): the masks would start there too, and
    harden would fail much later on torch's 'Cannot copy out of meta tensor'."""
    from torch._subclasses.fake_tensor import FakeTensor

    empty = [(name, "on the meta device" if p.is_meta else f"a {type(p).__name__}") for name, p in gm.named_parameters()
             if p.is_meta or isinstance(p, (FakeTensor, nn.parameter.UninitializedTensorMixin))]
    if empty:
        (name, where), more = empty[0], f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise ValueError(
            f"patchc.transform: weight {name!r}{more} holds no values ({where}): load the weights "
            "first (model.to_empty(device='cpu') then model.load_state_dict(state), or from_pretrained without a "
            "meta device), then transform")


def export_kwargs(program) -> dict:
    """The constant keyword arguments an ExportedProgram was exported with (e.g. use_cache=False).

    The exported module requires them on every call; the program passes them unless the caller does.
    """
    example = getattr(program, "example_inputs", None) if isinstance(program, torch.export.ExportedProgram) else None
    kwargs = example[1] if isinstance(example, tuple) and len(example) == 2 else {}
    return {k: v for k, v in (kwargs or {}).items() if v is None or isinstance(v, (bool, int, float, str))}
