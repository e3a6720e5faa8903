"""Traceable forms of MoE experts and blocks (`patchc.models.traceable` swaps them in: `SUBSTITUTES`).

DBRX's experts (`DbrxExperts`) loop over the experts the router picked, one matmul per expert hit, on slices
of flat (E * F, H) weights w1, v1, w2. Traced, every expert runs on every token as plain matmuls over the flat
weights, and each expert's output is scaled by its routing weight (0 where it was not picked): the loop's sum
over picked experts is (r * h) @ w2, with h = act(x w1^T) * (x v1^T) viewed (T, E, F). So each flat weight is
one plan layer (w2, read (K, N), is masked as its transpose: 2:4 groups along E * F). While masks train, it costs
E / top_k times the loop's expert FLOPs (4x for DBRX's 16 / 4).

LongCat-Flash's experts (`LongcatFlashExperts`) loop in Python over the experts hit, and route some tokens to
zero-computation experts, which return the token itself: ids R.. of `total_experts`, where R =
`num_routed_experts`. `gate_up_proj` holds rows for all of them, `down_proj` for the R routed ones. Traced, the
(token, slot) pairs are sorted by expert as transformers' grouped-mm experts do; the routed ones run as one
grouped mm over `gate_up_proj[:R]` and one over `down_proj`, and the zero-computation pairs, sorted to the tail
beyond the last row end, give their token. So each routed expert's slices are plan layers
(`patchc.passes.find_linears` reads the dim-0 slice) and the rows no token reads are never planned.

transformers 5.25 moves that into LongCat-Flash's MoE block (`LongcatFlashMoE`): its experts hold the routed
experts only, and the block sends each zero-computation pair to a routed expert at routing weight 0 (spread
over them), then adds the tokens itself. Those pairs change no output, but an expert computes them, the masks
train on them, and calibration would count them among the expert's tokens: its SparseGPT / Wanda statistics
would hold tokens the router never gave it. The block's traced form runs the same grouped mms on the router's
own picks instead, the zero-computation pairs giving their token.

Llama 4's MoE block (`Llama4TextMoe`) hands every expert every token, scaled by its router score, which is 0
for all but the `top_k` experts the router picked, and its experts multiply them all at once (`bmm` over
(E, T, K)). Traced, the block runs the picked (token, expert) pairs only, sorted by expert, through two
grouped mms over the stored (E, K, N) weights: the same output and gradients (a zero row adds nothing and
takes no gradient: up(x) * silu(gate(x)) at x = 0), top_k / E of the expert FLOPs and activations while
masks train (1 / 16 for Scout), and calibration sees each expert's own tokens only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from patchc.ir.targets import bmm_experts, row_ends


def dbrx_experts_dense(experts: nn.Module, original: Callable, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """`DbrxExperts.forward` with every expert on every token, weighted by the routing (0 where not picked)."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, experts.hidden_size)
    mlp, n_experts, ffn = experts.mlp, experts.num_experts, experts.ffn_hidden_size
    routing = x.new_zeros(x.shape[0], n_experts).scatter_add(1, top_k_index, top_k_weights.to(x.dtype))
    inner = mlp.activation_fn(F.linear(x, mlp.w1)) * F.linear(x, mlp.v1)  # (T, E * F)
    weighted = (inner.view(-1, n_experts, ffn) * routing.unsqueeze(-1)).reshape(-1, n_experts * ffn)
    return torch.matmul(weighted, mlp.w2).view(shape)


def longcat_experts_grouped(experts: nn.Module, original: Callable, hidden_states: torch.Tensor,
                            top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """`LongcatFlashExperts.forward` as two grouped mms over the routed experts; zero-computation experts
    (ids >= `num_routed_experts`) give their token, scaled by its routing weight as the loop does."""
    return _routed_grouped(experts, experts.num_routed_experts, hidden_states, top_k_index, top_k_weights)


def longcat_moe_grouped(moe: nn.Module, original: Callable, hidden_states: torch.Tensor) -> torch.Tensor:
    """`LongcatFlashMoE.forward` (transformers >= 5.25) as `longcat_experts_grouped` on the router's own picks:
    each routed expert computes, and is observed on, the tokens routed to it only (the block sends each
    zero-computation pair to a routed expert at weight 0, then adds the tokens itself). A block whose experts
    were swapped (a served copy, when the class runs this form) runs its own forward."""
    if not _is_longcat_moe(moe):
        return original(hidden_states)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    _, top_k_weights, top_k_index = moe.router(x)
    return _routed_grouped(moe.experts, moe.num_routed_experts, x, top_k_index, top_k_weights).reshape(shape)


def _routed_grouped(experts: nn.Module, routed: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed pairs through two grouped mms over experts 0..routed-1, the others giving their token, each
    scaled by its routing weight."""
    from transformers.integrations.moe import _grouped_mm  # transformers' dispatch: torch's op or its fallback

    k = top_k_index.shape[-1]
    ids, order = torch.sort(top_k_index.reshape(-1), stable=True)  # zero-computation pairs sort to the tail
    x = hidden_states[order // k]
    offs = row_ends(ids, routed)  # the routed pairs only: the zero-computation ones lie past the last end
    is_routed = (ids < routed).unsqueeze(-1)
    # torch's grouped mm leaves the rows past the last end unwritten (possibly NaN), forward and in its input
    # gradient: zeroing them in the input masks that gradient, and `where` (not a product) masks the output
    routed_x = x.masked_fill(~is_routed, 0)
    gate_up = experts.gate_up_proj  # whole where it holds only the routed ones: the backend serves a parameter
    gate_up = gate_up if gate_up.shape[0] == routed else gate_up[:routed]
    gate, up = _grouped_mm(routed_x, gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
    y = _grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1), offs)
    y = torch.where(is_routed, y, x) * top_k_weights.reshape(-1)[order, None]
    out = torch.zeros_like(hidden_states, dtype=y.dtype)
    return out.index_add(0, order // k, y).to(hidden_states.dtype)


def _is_longcat_moe(module: nn.Module) -> bool:
    """LongcatFlashMoE as transformers 5.25 builds it: zero-computation experts, and experts holding the routed
    ones as (R, 2F, H) gate_up_proj and (R, H, F) down_proj, with no bias, norm or other gate than act * up."""
    zero, routed = getattr(module, "zero_expert_num", None), getattr(module, "num_routed_experts", None)
    experts = getattr(module, "experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(zero, int) and zero > 0 and isinstance(routed, int) and hasattr(module, "router")
            and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and hasattr(experts, "act_fn")):
        return False
    plain = not any(getattr(experts, flag, False) for flag in ("has_bias", "has_post_expert_norm", "is_transposed"))
    gate = getattr(type(experts), "_apply_gate", None)
    plain = plain and (gate is None or gate.__name__ == "_default_apply_gate")
    return (plain and gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0] == routed
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1])


def _is_longcat_experts(module: nn.Module) -> bool:
    """LongcatFlashExperts as transformers 5.17-5.24 build it: gate_up_proj over every expert, down_proj over
    the routed ones."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    routed = getattr(module, "num_routed_experts", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and isinstance(routed, int) and down.shape[0] == routed <= gate_up.shape[0]
            and hasattr(module, "act_fn"))


def _is_dbrx_experts(module: nn.Module) -> bool:
    """DbrxExperts as transformers 5.17-5.24 build it: flat (E * F, H) w1, v1, w2 on `mlp`."""
    mlp = getattr(module, "mlp", None)
    if mlp is None or not all(hasattr(module, n) for n in ("hidden_size", "ffn_hidden_size", "num_experts")):
        return False
    flat = (module.num_experts * module.ffn_hidden_size, module.hidden_size)
    return hasattr(mlp, "activation_fn") and all(
        tuple(getattr(getattr(mlp, w, None), "shape", ())) == flat for w in ("w1", "v1", "w2"))


def llama4_moe_routed(moe: nn.Module, original: Callable, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`Llama4TextMoe.forward` over the (token, expert) pairs its router picks: each picked expert's rows, scaled
    by the router score as the block scales them, through two grouped mms over the stored (E, K, N) weights,
    summed per token, plus the shared expert. A block whose experts were swapped runs its own forward."""
    from transformers.integrations.moe import _grouped_mm  # transformers' dispatch: torch's op or its fallback

    if not _is_llama4_moe(moe):
        return original(hidden_states)
    experts = moe.experts
    x = hidden_states.reshape(-1, moe.hidden_dim)
    rows, ids, order, logits = llama4_picked_rows(moe.router, x)
    tokens = order // moe.router.top_k
    offs = row_ends(ids, experts.num_experts)
    gate, up = _grouped_mm(rows, experts.gate_up_proj, offs).chunk(2, dim=-1)
    y = _grouped_mm(up * experts.act_fn(gate), experts.down_proj, offs)
    routed = torch.zeros(x.shape[0], y.shape[-1], dtype=y.dtype, device=y.device).index_add(0, tokens, y)
    return moe.shared_expert(x) + routed.to(x.dtype), logits


def llama4_picked_rows(router: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(rows, their expert ids, the sort order, router logits) for Llama 4's block: each (token, expert) pair
    its router picks, sorted by expert (`order[i] // top_k` is row i's token), the token scaled by its score as
    the block scales it. Every other score is 0: those pairs add nothing."""
    scores, logits = router(x)
    picked = torch.topk(logits, router.top_k, dim=1).indices  # the router's own picks
    ids, order = torch.sort(picked.reshape(-1), stable=True)
    rows = x[order // router.top_k] * scores.gather(1, picked).reshape(-1)[order, None]
    return rows, ids, order, logits


def _is_llama4_moe(module: nn.Module) -> bool:
    """Llama4TextMoe as transformers 5 builds it: a router returning (scores (T, E), logits) for `top_k` experts,
    and experts that run every expert on every row by bmm over (E, K, 2F) gate_up_proj and (E, F, K) down_proj,
    with no biases (so a row the router scored 0 gives 0, and the routed forms may leave it out). (transformers
    4's router returned its scores in another layout: its block keeps its own forward.)"""
    from patchc.models.hf import transformers_major

    if transformers_major() < 5:
        return False
    experts, router = getattr(module, "experts", None), getattr(module, "router", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    biased = any(isinstance(getattr(experts, f"{p}_bias", None), torch.Tensor) for p in ("gate_up_proj", "down_proj"))
    if biased or not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and bmm_experts(experts)
            and isinstance(getattr(router, "top_k", None), int) and isinstance(getattr(module, "hidden_dim", None), int)
            and hasattr(module, "shared_expert") and hasattr(experts, "act_fn")):
        return False
    return (gate_up.dim() == down.dim() == 3 and gate_up.shape[0] == down.shape[0] == getattr(experts, "num_experts", 0)
            and gate_up.shape[1] == down.shape[2] == module.hidden_dim and gate_up.shape[2] == 2 * down.shape[1])


__all__ = ["dbrx_experts_dense", "llama4_moe_routed", "llama4_picked_rows", "longcat_experts_grouped",
           "longcat_moe_grouped"]
