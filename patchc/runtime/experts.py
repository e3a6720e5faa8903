"""`TileExperts`: the drop-ins for transformers' fused MoE experts whose expert slices are planned.

`TileExperts` takes the routed call (hidden_states, top_k_index, top_k_weights) of experts held as 3-D weights
(gate_up_proj or up_proj, and down_proj); `TileBmmExperts` Llama 4's, which multiply every expert's rows at
once; `patchc.runtime.flat_experts.TileFlatExperts` DBRX's, held flat. On a GPU each projection is one
`TileGroupedLinear` (every expert in one launch), on a CPU a loop over the experts' W * M.

LongCat-Flash's experts also route tokens to zero-computation experts (ids past the ones every projection holds),
which give the token back scaled by its routing weight: `TileExperts` serves the held experts and adds those
tokens itself. The rows its gate_up_proj holds for them are never read, so it drops them; `save_pretrained`
writes them as zeros. Experts that norm each expert's output before the routing weight (transformers'
`has_post_expert_norm`, Ergo's per-expert RMSNorm) keep that norm module and run it on the same rows.

Example:
    >>> mlp.experts = experts_module(mlp.experts, plan, "model.layers.0.mlp.experts")   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from patchc.ir.targets import (EXPERT_PROJECTIONS, bmm_experts, held_experts, post_expert_norm, row_ends,
                                zero_computation_experts)
from patchc.models.traceable_experts import llama4_picked_rows
from patchc.runtime import op as _op
from patchc.runtime.tuner import LayerTuning


class TileExperts(nn.Module):
    """Drop-in for a transformers fused-experts module (gate_up_proj / up_proj and down_proj, 3-D) whose
    expert slices are planned. On CUDA (or under the Triton interpreter) each projection is one
    `TileGroupedLinear`: the tokens are sorted by expert on the device and every expert's rows run in one
    launch, with no host synchronisation (CUDA-graph safe). On CPU each expert runs F.linear on its W * M
    (dense fallback, same numbers).

    forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H), as HF's experts.

    Example:
        >>> mlp.experts = TileExperts(mlp.experts, plan, "model.layers.0.mlp.experts")   # doctest: +SKIP
    """

    PROJECTIONS = EXPERT_PROJECTIONS

    STORED_KN = False  # weights stored (E, K, N) only where the module says so (`is_transposed`)
    zero_experts = 0  # routing ids past the held experts that give the token back (LongCat-Flash's)
    post_norm: str | None = None  # "plain" / "per_expert": how each expert's output is normed (`post_expert_norm`)

    def __init__(self, experts: nn.Module, plan: Any, path: str, tunings: dict[str, LayerTuning | None] | None = None,
                 dtype: torch.dtype | None = None, device: Any = None) -> None:
        super().__init__()
        self._take_settings(experts, path)
        self.is_transposed = self.STORED_KN or bool(getattr(experts, "is_transposed", False))
        gate = getattr(type(experts), "_apply_gate", None)
        self._gate = (lambda h: gate(self, h)) if gate is not None else None
        names = [p for p in self.PROJECTIONS if isinstance(getattr(experts, p, None), torch.Tensor)]
        if "down_proj" not in names or len(names) != 2:
            raise ValueError(f"{path}: TileExperts needs gate_up_proj or up_proj, and down_proj; has {names}")
        held = held_experts(experts)
        self.zero_experts = zero_computation_experts(experts)  # ids held.. give their token back
        self.unread_rows = {p: getattr(experts, p).shape[0] - held for p in names}  # saved as zeros
        weights = {p: getattr(experts, p).detach()[:held] for p in names}
        stored = {p: w.transpose(1, 2) if self.is_transposed else w for p, w in weights.items()}  # (E, N, K)
        self._pack(plan, stored, {p: getattr(experts, f"{p}_bias", None) for p in names}, tunings, dtype, device)
        self.post_norm = post_expert_norm(experts)  # each expert's output normed before its routing weight
        if self.post_norm is not None:  # kept under its own name: the state dict's key stays the model's
            on = device if device is not None else stored["down_proj"].device
            self.post_expert_norm = experts.post_expert_norm.to(on)

    def _take_settings(self, experts: nn.Module, path: str) -> None:
        """The experts module's routing / gating settings (ints, bools, config, act_fn) and where it was."""
        self.path = path
        for key, value in vars(experts).items():
            if not key.startswith("_") and not isinstance(value, (torch.Tensor, nn.Module)):
                setattr(self, key, value)
        self.act_fn = getattr(experts, "act_fn", None)

    def _pack(self, plan: Any, stored: dict[str, torch.Tensor], biases: dict[str, torch.Tensor | None],
              tunings: dict[str, LayerTuning | None] | None, dtype: torch.dtype | None, device: Any) -> None:
        """Each projection's experts from `plan.layers["<path>.<projection>.<e>"]`, an unplanned one from its
        `stored` (E, N, K) weight: one `TileGroupedLinear` on a GPU (or interpreted), W * M stacked on a CPU."""
        from patchc.runtime.grouped_op import TileGroupedLinear

        self.names = list(stored)
        w0 = stored[self.names[0]]
        self.num_experts = int(w0.shape[0])
        dtype, device = dtype or w0.dtype, device if device is not None else w0.device
        on_gpu = torch.device(device).type == "cuda"
        self.kernels = nn.ModuleDict()
        for proj, weight in stored.items():
            bias = biases.get(proj)
            self.register_buffer(f"{proj}_bias", None if bias is None else bias.detach().to(device=device, dtype=dtype))
            if on_gpu or _op.kernels_interpreted():  # every expert in one launch
                self.kernels[proj] = TileGroupedLinear.from_plan(plan, f"{self.path}.{proj}", weight,
                                                                 (tunings or {}).get(proj), dtype=dtype, device=device)
            dense = None
            if not on_gpu:  # the CPU fallback's W * M; on a GPU the stacked packed experts are all there is
                layers = [plan.layers.get(f"{self.path}.{proj}.{e}") for e in range(self.num_experts)]
                dense = torch.stack([weight[e] if lp is None else lp.to_dense().to(weight)
                                     for e, lp in enumerate(layers)])
                dense = dense.to(device=device, dtype=dtype)
            self.register_buffer(f"{proj}_dense", dense)

    def replaced_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{parameter name in the replaced module: tensor} from each projection's (E, N, K) W * M, stored as the
        module stored it (`dense_state_dict`)."""
        out = {}
        for p, w in weights.items():
            unread = self.unread_rows[p]  # zero-computation experts' rows: never read
            w = torch.cat([w, w.new_zeros(unread, *w.shape[1:])]) if unread else w
            out[p] = w.transpose(1, 2).contiguous() if self.is_transposed else w
        return out

    def _grouped(self, x: torch.Tensor) -> bool:
        """Whether this call runs the grouped kernels (CUDA; CPU when the kernels are interpreted)."""
        # len(), not bool(): torch 2.11's dynamo cannot call bool() on a ModuleDict, and breaks the graph there
        return len(self.kernels) > 0 and _op.use_triton(x)

    def _project(self, proj: str, x: torch.Tensor, offs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Rows of `x` sorted by expert (row ends `offs`, each row's `expert`) times their expert's slice."""
        bias = getattr(self, f"{proj}_bias")
        y = self.kernels[proj](x, offs)
        return y if bias is None else y + bias[expert.clamp(max=self.num_experts - 1)]

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        """The experts class's own gate (`_apply_gate`, which transformers' experts decorator gives), else for
        gate_up_proj its default, act(gate) * up (LongCat-Flash's experts have no decorator)."""
        if self.names[0] != "gate_up_proj":
            return self.act_fn(h)
        if self._gate is not None:
            return self._gate(h)
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _normed(self, y: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each row's expert output through the module's post-expert norm, where it has one (`post_expert_norm`)."""
        if self.post_norm == "per_expert":
            return self.post_expert_norm(y, expert.clamp(max=self.num_experts - 1))
        return self.post_expert_norm(y) if self.post_norm == "plain" else y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if not self._grouped(hidden_states):
            return self._forward_dense(hidden_states, top_k_index, top_k_weights)
        k = top_k_index.shape[-1]
        ids = self._computed(top_k_index, top_k_weights)
        order = torch.argsort(ids, stable=True)  # (token, slot) pairs sorted by expert, on the device
        expert = ids[order]
        offs = row_ends(ids, self.num_experts)
        x = hidden_states[order // k]
        h = self._activate(self._project(self.names[0], x, offs, expert))
        y = self._normed(self._project("down_proj", h, offs, expert), expert)
        if self.zero_experts:  # their pairs sort past the last row end (zeros there): the token itself
            y = torch.where(expert[:, None] < self.num_experts, y, x.to(y.dtype))
        y = y * top_k_weights.reshape(-1)[order, None]  # the pairs skipped: 0 * the zeros past the last end
        return per_token_sum(y, order, k).to(hidden_states.dtype)

    def _computed(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pair's expert, flat, a pair at routing weight 0 given an id past every expert: it
        adds nothing, so no expert reads its row (LongCat-Flash under transformers >= 5.25 sends its
        zero-computation pairs to routed experts at weight 0; an expert only they hit is not read at all)."""
        skip = self.num_experts + self.zero_experts
        return top_k_index.reshape(-1).masked_fill(top_k_weights.reshape(-1) == 0, skip)

    def _forward_dense(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
        """CPU: a host loop over the experts, F.linear on each W * M."""
        k = top_k_index.shape[-1]
        ids, weights = self._computed(top_k_index, top_k_weights), top_k_weights.reshape(-1)
        tokens = torch.arange(ids.numel(), device=ids.device) // k
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        for e in range(self.num_experts):
            rows = (ids == e).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            h = self._activate(self._linear(self.names[0], e, hidden_states[tokens[rows]]))
            y = self._normed(self._linear("down_proj", e, h), ids[rows]) * weights[rows, None]
            out.index_add_(0, tokens[rows], y.float())
        if self.zero_experts:
            rows = ((ids >= self.num_experts) & (ids < self.num_experts + self.zero_experts)).nonzero().squeeze(-1)
            out.index_add_(0, tokens[rows], hidden_states[tokens[rows]].float() * weights[rows, None].float())
        return out.to(hidden_states.dtype)

    def _linear(self, proj: str, e: int, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self, f"{proj}_bias")
        y = F.linear(x, getattr(self, f"{proj}_dense")[e])
        return y if bias is None else y + bias[e]


class TileBmmExperts(TileExperts):
    """Drop-in for experts that multiply every expert's rows at once, `torch.bmm(x, W)` with W stored
    (E, K, N) (Llama 4's `Llama4TextExperts`): forward(hidden_states (E * T, H)) -> (E * T, H), the rows
    already grouped by expert (T per expert); gate_up_proj's output is (gate, up), down_proj reads
    up * act(gate). The experts run as in `TileExperts`.

    Llama 4's MoE block hands every expert every token, scaled by its router score: 0 for the experts the
    router did not pick (all but `top_k` per token). Without biases an all-zero row gives a zero row, so only
    the other rows are computed: an expert no token picked is not read at all (at decode, `top_k` of the E
    experts' weights move). `rows_per_token` (the block's `top_k`, which `patchc.compile` passes) bounds the
    rows computed to T * top_k, so kernels are picked for that many rows, not E * T; a call with more
    non-zero rows per token than that is not the block's, and is wrong under it.
    """

    STORED_KN = True

    def __init__(self, experts: nn.Module, plan: Any, path: str, tunings: dict[str, LayerTuning | None] | None = None,
                 dtype: torch.dtype | None = None, device: Any = None, rows_per_token: int | None = None) -> None:
        super().__init__(experts, plan, path, tunings, dtype=dtype, device=device)
        if rows_per_token is not None and rows_per_token < 1:
            raise ValueError(f"{path}: rows_per_token must be at least 1 (the MoE block's top_k), got {rows_per_token}")
        self.rows_per_token = rows_per_token
        self.skips_zero_rows = self._zero_in_zero_out()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        per = hidden_states.shape[0] // self.num_experts
        expert = torch.arange(self.num_experts, device=hidden_states.device).repeat_interleave(per)
        if not self.skips_zero_rows:
            offs = (torch.arange(self.num_experts, device=hidden_states.device, dtype=torch.int32) + 1) * per
            return self._experts(hidden_states, offs, expert)
        live = hidden_states.ne(0).any(-1)  # the rows the router scored; a zero row gives a zero row
        if not self._grouped(hidden_states):  # CPU: each expert's live rows (a host read, as its loop does)
            return self._experts(hidden_states, None, torch.where(live, expert, self.num_experts))
        key = torch.where(live, expert, self.num_experts)
        order = torch.argsort(key, stable=True)  # live rows by expert, then the zero rows
        order = order[:self.launched_per_token() * per]  # every live row: the router scores top_k per token
        y = self.run_sorted(hidden_states[order], key[order])
        out = hidden_states.new_zeros(hidden_states.shape[0], y.shape[-1])
        return out.index_copy(0, order, y)

    def run_sorted(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Rows already sorted by `expert` through both projections, on the grouped kernels (the routed form
        `TileLlama4Moe` calls). Rows of id E (zero rows, sorted last) lie past the last row end, where the
        kernels write zeros."""
        if not self._grouped(rows):
            return self._experts(rows, None, expert)
        return self._experts(rows, row_ends(expert, self.num_experts), expert)

    def _zero_in_zero_out(self) -> bool:
        """Whether a zero row gives a zero row and a zero input gradient: gated, without biases, act(0) = 0
        (then up(0) * act(gate(0)) = 0, and its derivative at 0, up' * act(0) + up(0) * ..., is 0 too)."""
        if self.names[0] != "gate_up_proj" or any(getattr(self, f"{p}_bias") is not None for p in self.names):
            return False
        try:
            return bool(self.act_fn(torch.zeros(1)).eq(0).all())
        except Exception:  # noqa: BLE001 - an activation that cannot run on a CPU scalar: every row computed
            return False

    def launched_per_token(self) -> int:
        """The rows the grouped kernels get per token: the block's top_k, else every expert's."""
        bounded = self.skips_zero_rows and self.rows_per_token is not None
        return min(self.rows_per_token, self.num_experts) if bounded else self.num_experts

    def _experts(self, x: torch.Tensor, offs: torch.Tensor | None, expert: torch.Tensor) -> torch.Tensor:
        """Rows `x` sorted by `expert` (row ends `offs`) through both projections, on the grouped kernels; `offs`
        None (CPU): x is every row in the module's order, each expert's F.linear on its rows with `expert` < E."""
        h = self._projected(self.names[0], x, offs, expert)
        if self.names[0] == "gate_up_proj":
            gate, up = h.chunk(2, dim=-1)
            h = up * self.act_fn(gate)
        else:
            h = self.act_fn(h)
        return self._projected("down_proj", h, offs, expert)

    def _projected(self, proj: str, x: torch.Tensor, offs: torch.Tensor | None, expert: torch.Tensor) -> torch.Tensor:
        if offs is not None and self._grouped(x):
            return self._project(proj, x, offs, expert)
        out = None
        for e in range(self.num_experts):
            rows = (expert == e).nonzero().squeeze(-1)
            if rows.numel():
                y = self._linear(proj, e, x[rows])
                out = x.new_zeros(x.shape[0], y.shape[-1]) if out is None else out
                out[rows] = y
        if out is None:  # no row live: the output width from the weight
            width = getattr(self, f"{proj}_dense").shape[1]
            out = x.new_zeros(x.shape[0], width)
        return out


class TileLlama4Moe(nn.Module):
    """Drop-in for Llama 4's MoE block once its experts are a `TileBmmExperts`: the router's picks only, never the
    block's E x T rows. The block hands every expert every token, `hidden.repeat(E, 1) * scores`, then sums E x T
    output rows; at prefill that is E times the activations (128 for Maverick). Here each picked (token, expert)
    pair's row, scaled by its router score as the block scales it, is sorted by expert on the device and runs
    through the experts' kernels (`TileBmmExperts.run_sorted`), then each token's top_k rows are summed in a
    fixed order, plus the shared expert. The submodules keep their names: the state dict is the block's.

    forward(hidden_states (..., H)) -> (out (T, H), router_logits (T, E)), as the block.
    """

    def __init__(self, block: nn.Module, experts: TileBmmExperts) -> None:
        super().__init__()
        self.hidden_dim, self.top_k = block.hidden_dim, block.router.top_k
        self.router, self.shared_expert, self.experts = block.router, block.shared_expert, experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.hidden_dim)
        rows, ids, order, logits = llama4_picked_rows(self.router, x)
        routed = per_token_sum(self.experts.run_sorted(rows, ids), order, self.top_k)
        return self.shared_expert(x) + routed.to(x.dtype), logits


def per_token_sum(y: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 (T, N): the rows `y` of each token's k (token, slot) pairs, sorted by `order` (row i is pair
    order[i], pair p is token p // k's), put back and summed in a fixed order (index_add_'s atomics would
    make the sum run-dependent)."""
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.float().view(-1, k, y.shape[-1]).sum(1)


def experts_module(experts: nn.Module, plan: Any, path: str, tunings: dict[str, LayerTuning | None] | None = None,
                   device: Any = None, top_k: int | None = None) -> TileExperts:
    """The drop-in for a fused-experts module: `TileBmmExperts` when its forward takes the rows alone
    (every expert at once), else `TileExperts` (forward(hidden_states, top_k_index, top_k_weights)).
    `tunings`: {projection: the tuning of its first planned slice}, shared by all its experts; `device`: where
    its buffers go (default: the experts' weights' device); `top_k`: the experts the calling block's router
    scores per token (`TileBmmExperts.rows_per_token`)."""
    if bmm_experts(experts):
        return TileBmmExperts(experts, plan, path, tunings, device=device, rows_per_token=top_k)
    return TileExperts(experts, plan, path, tunings, device=device)


__all__ = ["TileBmmExperts", "TileExperts", "TileLlama4Moe", "experts_module"]
