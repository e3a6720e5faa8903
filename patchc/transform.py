"""`patchc.transform`: an exported program in, a trainable masked program out.

The stages, in order:

    export (if given a module) -> ep.module() -> freeze weights -> annotate matmuls
        -> build one HybridMask per masked weight (+ one-shot prior) -> insert mask nodes
        -> MaskedProgram

Example:
    >>> ep = torch.export.export(model, (ids,))
    >>> prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35))
    >>> opt = torch.optim.Adam(prog.mask_parameters(), lr=1e-3)
    >>> loss = task_loss(prog(ids)) + prog.regularizer(); loss.backward(); opt.step(); prog.step()
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import fx, nn

from patchc.config import PatchConfig, schedule_value
from patchc.hybrid_mask import MODES, HybridMask
from patchc.names import block_index
from patchc.passes.find_linears import LinearSite, find_linear_sites
from patchc.passes.insert_masks import InsertMasks, InsertObservers, RemoveObservers, module_key

def density_groups(masks: list[HybridMask], scope: str) -> list[list[HybridMask]]:
    """The layers each density term covers: all of them ("global"), or one group per block ("block").

    A weight outside any transformer block forms a group of its own.
    """
    if scope == "global":
        return [masks]
    by_block: dict[object, list[HybridMask]] = {}
    for m in masks:
        block = block_index(m.name)
        by_block.setdefault(m.name if block is None else block, []).append(m)
    return list(by_block.values())


class MaskedProgram(nn.Module):
    """A model whose masked linears read W * M; only the mask logits are parameters.

    Train mode samples masks with Gumbel noise; eval mode uses `cfg.eval_mask` ("hard" by default:
    exactly the mask `patchc.harden` will produce). The exported GraphModule is held, not
    registered as a child: exported modules refuse `.train()` / `.eval()`, and its weights are
    frozen and not part of this program's state_dict (which holds logits, noise counters and
    the schedule step, so a checkpoint restores training exactly).
    """

    def __init__(
        self,
        graph_module: fx.GraphModule,
        sites: list[LinearSite],
        masks: dict[str, HybridMask],
        skipped: dict[str, str],
        cfg: PatchConfig,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "graph_module", graph_module)
        self.cfg, self.sites, self.skipped = cfg, sites, skipped
        self.masks = nn.ModuleDict({module_key(fqn): m for fqn, m in masks.items()})
        self.register_buffer("schedule_step", torch.zeros((), dtype=torch.int64))
        self._forced_mode: str | None = None
        self._groups = density_groups(list(masks.values()), cfg.scope)
        self._step = 0  # host copy of `schedule_step`: reading the buffer would sync a GPU every step
        for m in masks.values():
            m.track_sum, m.track_norm = cfg.density_mode == "sampled", cfg.lambda_norm > 0
        self.register_load_state_dict_post_hook(lambda module, _keys: module._restore_step())
        # Constant denominator of the magnitude term; a buffer so it follows .to(device).
        w_sq = sum(graph_module.get_parameter(f).detach().float().square().sum() for f in masks)
        self.register_buffer("weight_sq_norm", torch.as_tensor(w_sq), persistent=False)
        self._sync_schedule()

    # -- the model -------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        mode = self._forced_mode or ("sample" if self.training else self.cfg.eval_mask)
        for m in self.masks.values():
            m.mode = mode
        return self.graph_module(*args, **kwargs)

    def train(self, mode: bool = True) -> "MaskedProgram":
        self.training = mode
        for m in self.masks.values():
            m.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.graph_module._apply(fn, recurse)  # weights live in the unregistered graph module
        return self

    # -- masks ---------------------------------------------------------------------------
    @property
    def layers(self) -> dict[str, HybridMask]:
        """Masked weight FQN -> its HybridMask, in graph order."""
        return {m.name: m for m in self.masks.values()}

    def mask_parameters(self) -> list[nn.Parameter]:
        """The trainable logits (tile and / or 2:4); weights are never among them."""
        return [p for p in self.parameters() if p.requires_grad]

    def weight(self, fqn: str) -> torch.Tensor:
        """The frozen weight (or bias) tensor with this FQN."""
        return self.graph_module.get_parameter(fqn)

    @contextlib.contextmanager
    def mask_mode(self, mode: str) -> Iterator["MaskedProgram"]:
        """Force every mask into `mode` ("sample", "hard", "soft", "ones") inside the block.

        >>> with prog.mask_mode("ones"): y = prog(x)   # the original model's output
        """
        if mode not in MODES:
            raise ValueError(f"unknown mask mode {mode!r}; choose one of {MODES}")
        previous, self._forced_mode = self._forced_mode, mode
        try:
            yield self
        finally:
            self._forced_mode = previous

    @contextlib.contextmanager
    def observe_inputs(self, callback: Callable[[str, torch.Tensor], None]) -> Iterator["MaskedProgram"]:
        """Call `callback(weight_fqn, x)` with each masked matmul's activation input (calibration)."""
        gm = self.graph_module
        InsertObservers(self.sites, callback)(gm)
        try:
            yield self
        finally:
            RemoveObservers()(gm)

    # -- schedules -----------------------------------------------------------------------
    def schedule(self) -> dict[str, float]:
        """Current tau (tile), tau_nm, kappa_tile, kappa_nm (linear in the optimizer step, held after T)."""
        t, total = self._step, self.cfg.steps
        return {
            "tau": schedule_value(self.cfg.tau, t, total),
            "tau_nm": schedule_value(self.cfg.tau_nm, t, total),
            "kappa_tile": schedule_value(self.cfg.kappa_tile, t, total),
            "kappa_nm": schedule_value(self.cfg.kappa_nm, t, total),
        }

    def _sync_schedule(self) -> None:
        s = self.schedule()
        for m in self.masks.values():
            m.tau_tile, m.tau_nm = s["tau"], s["tau_nm"]
            m.kappa_tile, m.kappa_nm = s["kappa_tile"], s["kappa_nm"]

    def step(self) -> None:
        """Advance the tau / kappa schedules by one optimizer step."""
        self._step += 1
        self.schedule_step += 1
        self._sync_schedule()

    def _restore_step(self) -> None:
        self._step = int(self.schedule_step)
        self._sync_schedule()

    # -- regulariser ---------------------------------------------------------------------
    def density(self, mode: str | None = None) -> torch.Tensor:
        """Parameter-weighted density over all masked layers ("expected" or "sampled")."""
        masks = list(self.masks.values())
        return self._density(masks, mode or self.cfg.density_mode)

    def _density(self, masks: Sequence[HybridMask], mode: str) -> torch.Tensor:
        if mode == "expected":
            kept = [m.expected_kept() for m in masks]
        elif mode == "sampled":
            if any(m.last_sum is None for m in masks):
                raise RuntimeError("density_mode='sampled' needs a training-mode forward before regularizer()")
            kept = [m.last_sum for m in masks]
        else:
            raise ValueError(f"unknown density mode {mode!r}; choose 'expected' or 'sampled'")
        return torch.stack(kept).sum() / sum(m.numel for m in masks)

    def regularizer(self) -> torch.Tensor:
        """lambda1 * |density - rho| - lambda2 * (1 - t/T) * sum ||M*W||^2 / sum ||W||^2.

        The density term is global and parameter-weighted (`scope="global"`) or the mean of one term
        per transformer block (`scope="block"`). The magnitude term uses the masks of the last
        training forward and is 0 before one.
        """
        cfg, masks = self.cfg, list(self.masks.values())
        rho = cfg.density
        density_term = torch.stack([(self._density(g, cfg.density_mode) - rho).abs() for g in self._groups]).mean()
        loss = cfg.lambda_density * density_term
        if cfg.lambda_norm > 0 and all(m.last_sq_norm is not None for m in masks):
            decay = max(0.0, 1.0 - self._step / cfg.steps)
            kept_norm = torch.stack([m.last_sq_norm for m in masks]).sum()
            loss = loss - cfg.lambda_norm * decay * kept_norm / self.weight_sq_norm
        return loss


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
    return torch.export.export(module, args, kwargs=kwargs or None, dynamic_shapes=dynamic_shapes)


def check_tile_fits(sites: list[LinearSite], tile: tuple[int, int]) -> None:
    """Refuse a tile larger than a masked weight: the weight would be one partial tile, nothing to learn."""
    for site in sites:
        n, k = site.shape
        if tile[0] > n or tile[1] > k:
            raise ValueError(
                f"tile {tile} does not fit {site.fqn} of shape ({n}, {k}): choose a tile no larger than "
                "the smallest masked weight, or exclude that layer"
            )


def build_masks(
    sites: list[LinearSite],
    gm: fx.GraphModule,
    cfg: PatchConfig,
    calib=None,
    prior_masks: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, HybridMask]:
    """One HybridMask per masked weight (graph order), initialised N(0, init_std) + prior."""
    gen = torch.Generator().manual_seed(cfg.seed)
    masks: dict[str, HybridMask] = {}
    for site in sites:
        if site.fqn in masks:
            continue
        mask = HybridMask(site.fqn, site.shape, cfg.tile, cfg.variant, index=len(masks), seed=cfg.seed, hard=cfg.hard)
        mask.init_logits(cfg.init_std, gen)
        if cfg.prior != "random":
            weight = gm.get_parameter(site.fqn)
            nm_prior, tile_prior = prior_logits(site.fqn, weight, cfg, calib, prior_masks)
            # add_prior keeps the prior's choice as the argmax, so the "tile" variant's frozen 2:4
            # logits harden to exactly the one-shot pattern.
            mask.add_prior(nm_prior, tile_prior, cfg.init_std * cfg.prior_strength)
        masks[site.fqn] = mask.to(gm.get_parameter(site.fqn).device)
    return masks


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
) -> MaskedProgram:
    """Insert a learnable hybrid mask before every selected matmul weight.

    Args:
        program: a `torch.export.ExportedProgram` (training IR or after `run_decompositions()`),
            or an nn.Module, exported here with `example_inputs` (every dim dynamic when `dynamic`).
        cfg: the PatchConfig (default PatchConfig()).
        calib: `patchc.calibrate(...)` statistics, needed by the "wanda" and "sparsegpt" priors.
        prior_masks: {weight FQN: bool (N, K)} one-shot 2:4 masks of `cfg.prior` already computed for
            these very weights (`patchc.oneshot(model, cfg.prior, "2:4", calib=calib)`), reused for the
            prior; layers missing from it are computed here.

    Returns a `MaskedProgram`. The exported program's module shares weight storage with the user's
    model; patchc never writes to it.

    Example:
        >>> prog = patchc.transform(model, PatchConfig(tile=(16, 16)), example_inputs=(ids,))
        >>> sorted(prog.layers)[:1]
        ['layers.0.mlp.down_proj.weight']
    """
    cfg = cfg or PatchConfig()
    if isinstance(program, nn.Module) and not isinstance(program, fx.GraphModule):
        program = _export(program, example_inputs, example_kwargs, dynamic)
    if not isinstance(program, (torch.export.ExportedProgram, fx.GraphModule)):
        raise TypeError(f"patchc.transform takes an ExportedProgram or nn.Module, got {type(program).__name__}")
    gm = program.module() if isinstance(program, torch.export.ExportedProgram) else program
    _freeze_weights(gm)
    sites, skipped = find_linear_sites(gm, cfg)
    if not sites:
        raise ValueError(f"patchc.transform found no maskable linear layer; skipped: {skipped or 'none seen'}")
    check_tile_fits(sites, cfg.tile)
    masks = build_masks(sites, gm, cfg, calib, prior_masks)
    InsertMasks(sites, masks)(gm)
    return MaskedProgram(gm, sites, masks, skipped, cfg)
