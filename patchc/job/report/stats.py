"""Statistics of a plan for the report: projection types from weight names, sparsity per block and projection.

Example:
    >>> projection_type("model.layers.3.mlp.gate_proj.weight"), short_name("model.layers.3.self_attn.q_proj.weight")
    ('gate', 'block3_q')
    >>> plan_stats(plan)["per_projection"]
    {'q': 0.31, 'k': 0.44, ...}
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from patchc.utils.names import block_index

if TYPE_CHECKING:
    from patchc.ir import LayerPlan, TilePlan

# Display order of projection types (attention, then MLP, like the paper's figures).
PROJECTION_ORDER = ("q", "k", "v", "qkv", "o", "gate", "up", "down", "other")

# Last module-name component -> projection type (Llama / Qwen / Mistral, llama2.c, OPT, GPT-NeoX, phi).
_LEAF_TYPES = {
    "q_proj": "q", "query": "q", "wq": "q", "q": "q",
    "k_proj": "k", "key": "k", "wk": "k", "k": "k",
    "v_proj": "v", "value": "v", "wv": "v", "v": "v",
    "o_proj": "o", "out_proj": "o", "wo": "o", "o": "o",
    "qkv_proj": "qkv", "query_key_value": "qkv", "wqkv": "qkv", "c_attn": "qkv", "qkv": "qkv",
    "gate_proj": "gate", "w1": "gate", "gate": "gate",
    "up_proj": "up", "w3": "up", "fc1": "up", "c_fc": "up", "dense_h_to_4h": "up", "up": "up",
    "down_proj": "down", "w2": "down", "fc2": "down", "dense_4h_to_h": "down", "down": "down",
}
_ATTENTION_WORDS = ("attn", "attention")


def _module_parts(fqn: str) -> list[str]:
    """FQN without a trailing .weight / .bias, split at dots."""
    parts = fqn.split(".")
    if parts and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return parts


def projection_type(fqn: str) -> str:
    """The projection a weight belongs to: q, k, v, qkv, o, gate, up, down, or "other".

    Knows Llama/Qwen (`q_proj` ... `down_proj`), llama2.c (`wq wk wv wo`, `w1`=gate, `w3`=up,
    `w2`=down), BERT/MiniLM (`query key value`, `attention.output.dense`=o, `intermediate.dense`=up,
    `output.dense`=down), GPT-2 (`c_attn`=qkv, `attn.c_proj`=o, `mlp.c_fc`=up, `mlp.c_proj`=down),
    OPT (`fc1`/`fc2`) and GPT-NeoX (`query_key_value`, `attention.dense`=o).

    Example:
        >>> projection_type("model.layers.3.mlp.gate_proj.weight"), projection_type("layers.0.attention.wo.weight")
        ('gate', 'o')
        >>> projection_type("model.encoder.layer.2.intermediate.dense.weight"), projection_type("lm_head.weight")
        ('up', 'other')
    """
    parts = [p.lower() for p in _module_parts(fqn)]
    if not parts:
        return "other"
    leaf = parts[-1]
    parent = parts[-2] if len(parts) > 1 else ""
    in_attention = any(w in p for p in parts[:-1] for w in _ATTENTION_WORDS)
    if leaf == "c_proj":  # GPT-2 uses one name for the attention output and the MLP down projection
        return "o" if in_attention else "down" if parent == "mlp" else "other"
    if leaf == "dense":  # BERT / GPT-NeoX reuse "dense": the module path decides
        if parent == "intermediate":
            return "up"
        if in_attention:  # BERT attention.output.dense, NeoX attention.dense
            return "o"
        return "down" if parent == "output" else "other"
    return _LEAF_TYPES.get(leaf, "other")


def short_name(fqn: str) -> str:
    """A short file-name-safe label of a weight: `block3_q` when the block and projection are
    known, else the FQN without `.weight` and with unsafe characters replaced.

    Example:
        >>> short_name("model.layers.3.self_attn.q_proj.weight"), short_name("lm_head.weight")
        ('block3_q', 'lm_head')
    """
    block, proj = block_index(fqn), projection_type(fqn)
    if block is not None and proj != "other":
        return f"block{block}_{proj}"
    return re.sub(r"[^A-Za-z0-9_-]+", "_", ".".join(_module_parts(fqn))).strip("_") or "layer"


def _weighted_sparsity(layers: Iterable[LayerPlan]) -> float:
    """1 - kept / total over the layers (parameter weighted, like the paper's global budget)."""
    layers = list(layers)
    total = sum(layer.numel for layer in layers)
    return 1.0 - sum(layer.n_kept for layer in layers) / total if total else float("nan")


def plan_stats(plan: TilePlan) -> dict[str, Any]:
    """Parameter-weighted sparsity per block, per projection type and per (block, projection).

    Returns {"global": float, "target": float | None, "per_block": {block: s}, "per_projection":
    {type: s}, "grid": {(block, type): s}, "other": s | None} with blocks sorted and projection types
    in `PROJECTION_ORDER`; "other" is the sparsity of the planned layers outside any block.

    Example:
        >>> plan_stats(plan)["per_projection"]
        {'q': 0.31, 'k': 0.44, ...}
    """
    by_block: dict[int, list] = {}
    by_proj: dict[str, list] = {}
    by_cell: dict[tuple[int, str], list] = {}
    outside = []
    for fqn, layer in plan.layers.items():
        block, proj = block_index(fqn), projection_type(fqn)
        by_proj.setdefault(proj, []).append(layer)
        if block is None:
            outside.append(layer)
        else:
            by_block.setdefault(block, []).append(layer)
            by_cell.setdefault((block, proj), []).append(layer)
    target = None
    cfg = plan.meta.get("config") if isinstance(plan.meta, dict) else None
    if isinstance(cfg, dict) and isinstance(cfg.get("sparsity"), (int, float)):
        target = float(cfg["sparsity"])
    return {
        "global": plan.sparsity if plan.layers else float("nan"),
        "target": target,
        "per_block": {b: _weighted_sparsity(by_block[b]) for b in sorted(by_block)},
        "per_projection": {p: _weighted_sparsity(by_proj[p]) for p in PROJECTION_ORDER if p in by_proj},
        "grid": {key: _weighted_sparsity(v) for key, v in by_cell.items()},
        "other": _weighted_sparsity(outside) if outside else None,
    }
