"""`MaskedProgram`: the exported model with a HybridMask before every masked weight; only logits train.

What `transform` returns and every later stage takes: training runs its forward (sampled masks), reads
its regulariser and advances its schedules; hardening reads its masks and frozen weights; calibration
observes its matmul inputs.

Example:
    >>> prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16)))
    >>> with prog.mask_mode("ones"):
    ...     y = prog(ids)                      # the original model's output
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import fx, nn

from patchc.config import PatchConfig
from patchc.masking import regularizer as reg
from patchc.ir.targets import Target, matrix
from patchc.masking.hybrid_mask import MODES, HybridMask, fp32_kept
from patchc.masking.param_mask import hybrid_masks
from patchc.masking.schedule import schedule_at
from patchc.passes.find_linears import LinearSite
from patchc.passes.insert_masks import InsertObservers, RemoveObservers, module_key
from patchc.passes.seq_graphs import SeqGraphs, sequence_length


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
        masks: dict[str, nn.Module],
        skipped: dict[str, str],
        cfg: PatchConfig,
        targets: dict[str, Target] | None = None,
        call_kwargs: dict | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "graph_module", graph_module)
        self.cfg, self.sites, self.skipped = cfg, sites, skipped
        # layer name -> (N, K) matrix in a parameter; plain weights resolve to themselves
        self.targets: dict[str, Target] = dict(targets or {})
        self.call_kwargs = dict(call_kwargs or {})  # what the export was called with, e.g. use_cache=False
        self.masks = nn.ModuleDict({module_key(fqn): m for fqn, m in masks.items()})
        self.register_buffer("schedule_step", torch.zeros((), dtype=torch.int64))
        self._forced_mode: str | None = None
        hybrids = hybrid_masks(self.masks.values())
        self._groups = reg.density_groups(hybrids, cfg.scope)
        self._step = 0  # host copy of `schedule_step`: reading the buffer would sync a GPU every step
        # One graph per sequence length, for models that export only at a fixed length (`seq_graphs`).
        self.seq_graphs: SeqGraphs | None = None
        # Set by graph rewrites that move weights out of their exported module (`patchc.job.fsdp`).
        self._homes: dict[str, tuple[nn.Module, str]] = {}
        # name -> E[sum(M)] computed where the logits are whole; None reads each mask (see `regularizer`).
        self.kept_source: Callable[[bool], dict[str, torch.Tensor]] | None = None
        for m in hybrids:
            m.track_sum, m.track_norm = cfg.density_mode == "sampled", cfg.lambda_norm > 0
        self.register_load_state_dict_post_hook(lambda module, _keys: module._restore_step())
        # Constant denominator of the magnitude term; a buffer so it follows .to(device).
        w_sq = sum(self.weight(m.name).detach().float().square().sum() for m in hybrids)
        self.register_buffer("weight_sq_norm", torch.as_tensor(w_sq), persistent=False)
        self._sync_schedule()

    # -- the model -------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        mode = self._forced_mode or ("sample" if self.training else self.cfg.eval_mask)
        for m in self._hybrids():
            m.mode = mode
        gm = self.graph_module if self.seq_graphs is None else self.seq_graphs.graph(sequence_length(args, kwargs))[0]
        return gm(*args, **{**self.call_kwargs, **kwargs})

    def train(self, mode: bool = True) -> "MaskedProgram":
        self.training = mode
        for m in self.masks.values():
            m.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        super()._apply(fp32_kept(fn), recurse)  # masks and weight norms: fp32 whatever the weights become
        self.graph_module._apply(fn, recurse)  # weights live in the unregistered graph module
        if self.seq_graphs is not None:
            self.seq_graphs.apply(fn, recurse)
        return self

    # -- masks ---------------------------------------------------------------------------
    def _hybrids(self) -> list[HybridMask]:
        return hybrid_masks(self.masks.values())

    @property
    def layers(self) -> dict[str, HybridMask]:
        """Plan layer name -> its HybridMask, in graph order: the weight FQN, or "<fqn>.<e>" per expert
        of a fused 3-D expert weight (`patchc.ir.targets`)."""
        return {m.name: m for m in self._hybrids()}

    def plan_targets(self) -> dict[str, Target]:
        """Layer name -> `Target` for every masked layer (plain weights: the parameter itself)."""
        return {name: self.targets.get(name, Target(name, name)) for name in self.layers}

    def mask_parameters(self) -> list[nn.Parameter]:
        """The trainable logits (tile and / or 2:4); weights are never among them."""
        return [p for p in self.parameters() if p.requires_grad]

    def weight(self, fqn: str) -> torch.Tensor:
        """The frozen weight (or bias) with this FQN; for a layer name the (N, K) matrix (an expert's
        slice, a Conv1D weight's transpose)."""
        target = self.targets.get(fqn)
        if target is None:
            return self._parameter(fqn)
        return matrix(self._parameter(target.param), target)

    def _parameter(self, fqn: str) -> torch.Tensor:
        home = self._homes.get(fqn)
        if home is None:
            return self.graph_module.get_parameter(fqn)
        owner, attr = home
        return getattr(owner, attr)

    def relocate(self, fqn: str, owner: nn.Module, attr: str) -> None:
        """Record that parameter `fqn` of the exported module now lives at `owner.<attr>`.

        For graph rewrites that regroup weights (per-block FSDP2 shards): `weight(fqn)` follows it.

        >>> prog.relocate("model.layers.0.mlp.up_proj.weight", shard.weights, "model_layers_0_mlp_up_proj_weight")
        """
        self._homes[fqn] = (owner, attr)

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
        graphs = self.seq_graphs
        if graphs is not None:
            graphs.observe(callback)  # every length's graph, and those built inside the block
        else:
            InsertObservers(self.sites, callback)(self.graph_module)
        try:
            yield self
        finally:
            if graphs is not None:
                graphs.observe(None)
            else:
                RemoveObservers()(self.graph_module)

    # -- schedules -----------------------------------------------------------------------
    def schedule(self) -> dict[str, float]:
        """Current tau (tile), tau_nm, kappa_tile, kappa_nm (linear in the optimizer step, held after T)."""
        return schedule_at(self.cfg, self._step)

    def _sync_schedule(self) -> None:
        s = self.schedule()
        for m in self._hybrids():
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
        mode = mode or self.cfg.density_mode
        masks = self._regularised(fresh=True)[0] if mode == "expected" else self._hybrids()
        return reg.density(masks, mode)

    def _regularised(self, fresh: bool) -> tuple[list, list[list]]:
        """The masks and density groups the regulariser reads.

        When the logits are sharded outside their block's forward (FSDP2), `kept_source` supplies each
        mask's expected kept count: from the last forward (`fresh=False`: the training loss, with its
        graph) or computed now (`fresh=True`: logging).
        """
        if self.kept_source is None or (not fresh and self.cfg.density_mode != "expected"):
            return self._hybrids(), self._groups
        kept = self.kept_source(fresh)
        view = {m.name: _Kept(m, kept[m.name]) if m.name in kept else m for m in self._hybrids()}
        return list(view.values()), [[view[m.name] for m in group] for group in self._groups]

    def regularizer(self) -> torch.Tensor:
        """lambda1 * |density - rho| - lambda2 * (1 - t/T) * sum ||M*W||^2 / sum ||W||^2.

        The density term is global and parameter-weighted (`scope="global"`) or the mean of one term
        per transformer block (`scope="block"`). The magnitude term uses the masks of the last
        training forward and is 0 before one. See `patchc.masking.regularizer`.
        """
        masks, groups = self._regularised(fresh=False)
        return reg.regularizer(masks, groups, self.cfg, self._step, self.weight_sq_norm)


class _Kept:
    """A mask as the regulariser reads it, with its expected kept count computed elsewhere."""

    def __init__(self, mask: HybridMask, kept: torch.Tensor) -> None:
        self.name, self.numel, self.kept = mask.name, mask.numel, kept
        self.last_sum, self.last_sq_norm = mask.last_sum, mask.last_sq_norm

    def expected_kept(self) -> torch.Tensor:
        return self.kept

