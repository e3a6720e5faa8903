"""Traceable forms of layers torch.export cannot trace, swapped in while patchc exports a model.

A few transformers layers compute with Python control flow on tensor values, which torch.export cannot
trace, although the same computation has a vectorised form. While `export_causal_lm` traces a model (and
while `patchc.calibrate` observes one with DBRX's, LongCat-Flash's or Llama 4's experts: `EXPERTS`), the forward of each
such layer (`SUBSTITUTES`, by class name) is replaced on the instance by that form, and restored after: the
model itself is left as it was, and its own forward still runs with a KV cache.

Qwen4-Exp's QSA indexer (`Qwen4ExpTextQSAIndexer`) keeps, for each query, the `budget / ratio` blocks of
`ratio` consecutive visible keys its heads score highest, plus the keys after the last complete block.
transformers loops over batch and query in Python around `torch.nonzero` of the attention mask. Under the
causal mask of patchc's exports (ids only: no padding, no cache; sdpa's boolean mask) query q sees keys 0..q,
so the blocks are the same for every query and the choice is one masked top-k over (batch, query, block)
scores. It picks the same blocks as the loop except among equal scores (`torch.topk` breaks ties by the
vector's length; the ReLU-summed scores tie at zero when every head scores a block negative).

Kolibri 1.1's indexer (`Kolibri1_1Indexer`) picks, for each query that sees more keys than its budgets, a
pool of key blocks by their averaged keys, then its top keys of that pool (NVFP4-rounded scores, ties to the
lowest index). transformers loops over batch and groups of queries sharing their first visible key, around
`.unique().tolist()` and `nonzero`. Under patchc's exports every query's first visible key is key 0, so there
is one group per batch and every query is scored at once with the indexer's own top-k.

The MoE experts and blocks with such forms (DBRX's, LongCat-Flash's, Llama 4's) are in
`patchc.models.traceable_experts`.

Example:
    >>> with traceable_layers(model):                     # doctest: +SKIP
    ...     ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from patchc.models.traceable_experts import (_is_dbrx_experts, _is_llama4_moe, _is_longcat_experts, _is_longcat_moe,
                                              dbrx_experts_dense, llama4_moe_routed, longcat_experts_grouped,
                                              longcat_moe_grouped)

log = logging.getLogger(__name__)


def _rope(module: nn.Module) -> Callable:
    """The model file's own `apply_rotary_pos_emb` (partial rotary dims and all)."""
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


def qsa_queries_and_blocks(indexer: nn.Module, hidden: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries (B, T, H, d) after norm and rope, block keys (B, T // ratio, d)): each block's keys averaged in
    fp32, normed and rotated at its first position, as the loop does for a query that sees every block."""
    batch, length, _ = hidden.shape
    d, ratio, rope = indexer.index_head_dim, indexer.compress_ratio, _rope(indexer)
    cos, sin = position_embeddings
    q, keys = torch.split(indexer.index_qk_proj(hidden), [indexer.index_n_heads * d, d], dim=-1)
    q = rope(indexer.q_layernorm(q.reshape(batch, length, -1, d)), cos=cos[:, -length:], sin=sin[:, -length:],
             unsqueeze_dim=2)
    n_blocks = length // ratio
    grouped = keys[:, : n_blocks * ratio].reshape(batch, n_blocks, ratio, d)
    pooled = indexer.k_layernorm(grouped.float().mean(dim=2).to(keys.dtype))
    starts = torch.arange(n_blocks, device=hidden.device) * ratio
    blocks = rope(pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2).squeeze(2)
    return q, blocks


def qsa_block_scores(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """(B, T, n_blocks) fp32: the sum over heads of ReLU(q_h . k_block) / sqrt(d)."""
    scores = torch.einsum("bqhd,bjd->bqjh", q.float(), blocks.float())
    return torch.relu(scores).sum(dim=-1) / math.sqrt(q.shape[-1])


def qsa_selection(scores: torch.Tensor, ratio: int, top: int) -> torch.Tensor:
    """(B, T, T) bool, the keys each query keeps: its `top` best complete blocks, and every visible key after
    them. Blocks a query does not see yet score -inf; `top` -inf columns are appended so the top-k never
    asks for more columns than exist, at any length."""
    batch, length, n_blocks = scores.shape
    pos = torch.arange(length, device=scores.device)
    complete = (pos + 1) // ratio  # blocks query q sees whole
    seen = torch.arange(n_blocks, device=scores.device)[None, :] < complete[:, None]
    padded = torch.cat([scores.masked_fill(~seen, float("-inf")), scores.new_full((batch, length, top), float("-inf"))],
                       dim=-1)
    best = padded.topk(top, dim=-1).indices
    picked = torch.zeros_like(padded, dtype=torch.bool).scatter(-1, best, True)[..., :n_blocks] & seen
    picked = torch.cat([picked, picked.new_zeros(batch, length, 1)], dim=-1)  # column n_blocks: no block
    in_block = picked[..., torch.clamp(pos // ratio, max=n_blocks)]
    in_tail = (pos[None, :] >= complete[:, None] * ratio) & (pos[None, :] <= pos[:, None])
    return in_block | in_tail


def qsa_indexer_causal(indexer: nn.Module, original: Callable, hidden_states: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor,
                       cache: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`Qwen4ExpTextQSAIndexer.forward` for a causal mask without cache, as one top-k: (B, 1, T, T) bool.
    Anything else runs the layer's own forward: a cache, a mask over other keys, and eager attention's
    additive float mask (transformers 5.17's indexer then returns an additive mask too, 5.24's a bool one).
    The attention kwargs transformers 5.25 passes on (its loop reads none of them) do not change the choice."""
    length = hidden_states.shape[1]
    if (cache is not None or args or attention_mask.dtype != torch.bool
            or attention_mask.shape[-1] != length):
        return original(hidden_states, position_embeddings, attention_mask, cache, *args, **kwargs)
    q, blocks = qsa_queries_and_blocks(indexer, hidden_states, position_embeddings)
    keep = qsa_selection(qsa_block_scores(q, blocks), indexer.compress_ratio, indexer.block_topk)
    return keep.unsqueeze(1)


def kolibri_indexer_causal(indexer: nn.Module, original: Callable, query_states: torch.Tensor,
                           key_states: torch.Tensor, attention_mask: torch.Tensor | None,
                           index_pool: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Kolibri1_1Indexer.forward` for a boolean mask without cache, every query at once: (the keys each query
    attends to (B, 1, T, T), the pool they were picked from (B, T, T)). Its own forward runs otherwise (a cache,
    an additive float mask). Each query's first visible key must be key 0, as under patchc's exports."""
    length = query_states.shape[-2]
    if (attention_mask is None or attention_mask.dtype != torch.bool or key_states.shape[-2] != length
            or attention_mask.shape[-1] != length):
        return original(query_states, key_states, attention_mask, index_pool)
    quantize = sys.modules[type(indexer).__module__].nvfp4_fake_quantize
    visible = attention_mask[:, 0]
    # keys from key 0 to each query's last visible one, as the loop counts them (B, T, 1)
    lengths = ((length - visible.flip(-1).int().argmax(-1)) * visible.any(-1))[..., None]
    queries = quantize(query_states.detach()[:, : indexer.num_heads]).float()  # (B, heads, T, d)
    keys = key_states.detach()[:, 0]  # (B, T, d): the scores read key head 0
    if indexer.is_pool_source:
        index_pool = _kolibri_pool(indexer, queries, keys, visible, lengths, quantize)
    selected = _kolibri_tokens(indexer, queries, keys, visible, index_pool, lengths, quantize)
    return selected.unsqueeze(1), index_pool


def _kolibri_scores(indexer: nn.Module, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, T, K): the indexer's `score` for every batch, heads summed in the loop's order."""
    scores = queries.new_zeros(queries.shape[0], queries.shape[2], keys.shape[1])
    for head in range(queries.shape[1]):
        scores = scores + (queries[:, head] @ keys.transpose(1, 2)).relu()
    return scores * indexer.head_weight


def _kolibri_pool(indexer: nn.Module, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                  lengths: torch.Tensor, quantize: Callable) -> torch.Tensor:
    """(B, T, T) bool: for a query seeing more than `pool_size` keys, the keys of its best blocks of
    `compression` keys by their averaged key (an incomplete last block scores 0); every visible key otherwise."""
    ratio, length = indexer.compression, keys.shape[1]
    n_blocks = length // ratio
    summaries = quantize(keys[:, : n_blocks * ratio].float().unflatten(1, (n_blocks, ratio)).sum(2) / ratio)
    scores = F.pad(_kolibri_scores(indexer, queries, summaries), (0, 1))  # column n_blocks: the incomplete block
    blocks = torch.arange(n_blocks + 1, device=keys.device)
    scores = torch.where(blocks < lengths // ratio, scores, 0.0)
    scores = scores.masked_fill(blocks >= (lengths + ratio - 1) // ratio, float("-inf"))
    chosen = indexer.top_k_mask(scores, indexer.pool_size // ratio).repeat_interleave(ratio, dim=-1)[..., :length]
    return torch.where(lengths > indexer.pool_size, chosen & visible, visible)


def _kolibri_tokens(indexer: nn.Module, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                    pool: torch.Tensor, lengths: torch.Tensor, quantize: Callable) -> torch.Tensor:
    """(B, T, T) bool: for a query seeing more keys than its budget, the sink and local tokens and its `topk`
    best keys of the pool; every visible key otherwise."""
    scores = _kolibri_scores(indexer, queries, quantize(keys).float())
    positions = torch.arange(keys.shape[1], device=keys.device)
    sinks = positions < indexer.num_sink_tokens
    local = (positions >= lengths - indexer.num_local_tokens) & (positions < lengths)
    candidates = pool & ~sinks & (positions < lengths - indexer.num_local_tokens)
    chosen = indexer.top_k_mask(scores.masked_fill(~candidates, float("-inf")), indexer.topk)
    budget = indexer.topk + indexer.num_local_tokens + indexer.num_sink_tokens
    return torch.where(lengths > budget, (chosen | sinks | local) & visible, visible)


def _is_qsa_indexer(module: nn.Module) -> bool:
    """The indexer as transformers 5.17-5.24 build it: one key head (its config requires it) and the parts read."""
    names = ("index_qk_proj", "q_layernorm", "k_layernorm", "index_head_dim", "index_n_heads", "compress_ratio",
             "block_topk")
    return all(hasattr(module, n) for n in names) and getattr(module, "index_kv_heads", None) == 1


def _is_kolibri_indexer(module: nn.Module) -> bool:
    """The indexer as transformers 5.25 builds it: the settings and the tie-breaking top-k the substitute reads."""
    names = ("num_heads", "topk", "pool_size", "compression", "num_local_tokens", "num_sink_tokens", "head_weight",
             "is_pool_source", "top_k_mask")
    return all(hasattr(module, n) for n in names) and hasattr(sys.modules[type(module).__module__],
                                                              "nvfp4_fake_quantize")


# class name -> (does this instance have the form the substitute reads, the traceable forward)
SUBSTITUTES: dict[str, tuple[Callable[[nn.Module], bool], Callable]] = {
    "Qwen4ExpTextQSAIndexer": (_is_qsa_indexer, qsa_indexer_causal),
    "Kolibri1_1Indexer": (_is_kolibri_indexer, kolibri_indexer_causal),
    "DbrxExperts": (_is_dbrx_experts, dbrx_experts_dense),
    "LongcatFlashExperts": (_is_longcat_experts, longcat_experts_grouped),
    "LongcatFlashMoE": (_is_longcat_moe, longcat_moe_grouped),
    "Llama4TextMoe": (_is_llama4_moe, llama4_moe_routed),
}


# the experts (and MoE blocks) among them: calibration observes these in their traced form, the matmuls the
# program reads
EXPERTS = frozenset({"DbrxExperts", "LongcatFlashExperts", "LongcatFlashMoE", "Llama4TextMoe"})


def substitutable(model: nn.Module, classes: Collection[str] | None = None) -> list[tuple[str, nn.Module]]:
    """(path, module) of each layer of `model` that has a traceable form (of `classes` only, when given)."""
    return [(path, m) for path, m in model.named_modules()
            if type(m).__name__ in SUBSTITUTES and SUBSTITUTES[type(m).__name__][0](m)
            and (classes is None or type(m).__name__ in classes)]


@contextlib.contextmanager
def traceable_layers(model: nn.Module, every_instance: bool = False,
                     classes: Collection[str] | None = None) -> Iterator[list[str]]:
    """Run `model`'s layers with a traceable form (`SUBSTITUTES`) in that form inside the block; yields their
    paths. `every_instance`: patch the classes instead, so copies made inside the block (a plan applied to a
    deepcopy) run the same form too, as tests comparing them need. `classes`: only layers of these classes
    (`EXPERTS`: the experts).

    Example:
        >>> with traceable_layers(model) as swapped:       # doctest: +SKIP
        ...     ep = export_causal_lm(model)
    """
    found = substitutable(model, classes)
    restore: list[Callable[[], None]] = []
    try:
        for cls in {type(m) for _, m in found} if every_instance else ():
            own, substitute = cls.forward, SUBSTITUTES[cls.__name__][1]
            restore.append(functools.partial(setattr, cls, "forward", own) if "forward" in vars(cls) else
                           functools.partial(delattr, cls, "forward"))  # an inherited forward stays inherited
            # wraps: the substitute is called as the forward it stands for, and its signature says so
            cls.forward = functools.wraps(own)(
                lambda self, *a, _s=substitute, _o=own, **k: _s(self, functools.partial(_o, self), *a, **k))
        for _, module in () if every_instance else found:
            before = module.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) comes back
            module.forward = functools.partial(SUBSTITUTES[type(module).__name__][1], module, module.forward)
            restore.append(functools.partial(_put_back, module, before))
        if found:
            log.info("export: %d layers run in a traceable form (%s)", len(found),
                     ", ".join(sorted({type(m).__name__ for _, m in found})))
        yield [path for path, _ in found]
    finally:
        for undo in reversed(restore):
            undo()


def _put_back(module: nn.Module, forward: Callable | None) -> None:
    if forward is None:
        del module.forward
    else:
        module.forward = forward


__all__ = ["EXPERTS", "SUBSTITUTES", "dbrx_experts_dense", "kolibri_indexer_causal", "llama4_moe_routed",
           "longcat_experts_grouped", "longcat_moe_grouped", "qsa_block_scores", "qsa_indexer_causal",
           "qsa_queries_and_blocks", "qsa_selection", "substitutable", "traceable_layers"]
