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
from patchc.masking.hybrid_mask import MODES, HybridMask
from patchc.masking.schedule import schedule_at
from patchc.passes.find_linears import LinearSite
from patchc.passes.insert_masks import InsertObservers, RemoveObservers, module_key


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
        self._groups = reg.density_groups(list(masks.values()), cfg.scope)
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
        return schedule_at(self.cfg, self._step)

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
        return reg.density(list(self.masks.values()), mode or self.cfg.density_mode)

    def regularizer(self) -> torch.Tensor:
        """lambda1 * |density - rho| - lambda2 * (1 - t/T) * sum ||M*W||^2 / sum ||W||^2.

        The density term is global and parameter-weighted (`scope="global"`) or the mean of one term
        per transformer block (`scope="block"`). The magnitude term uses the masks of the last
        training forward and is 0 before one. See `patchc.masking.regularizer`.
        """
        return reg.regularizer(list(self.masks.values()), self._groups, self.cfg, self._step, self.weight_sq_norm)

