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
PROJECTION_ORDER = ("q", "k", "v", "kv", "qkv", "o", "gate", "gate_up", "up", "down", "ssm_in", "ssm_out", "other")

# Last module-name component -> projection type (Llama / Qwen / Mistral, llama2.c, OPT, GPT-NeoX, phi,
# T5, DeepSeek's MLA, and the fused gate + up of Phi-3, GLM-4 and the experts of Mixtral, GPT-OSS, ...).
_LEAF_TYPES = {
    "q_proj": "q", "query": "q", "wq": "q", "q": "q", "q_a_proj": "q", "q_b_proj": "q",
    "k_proj": "k", "key": "k", "wk": "k", "k": "k",
    "v_proj": "v", "value": "v", "wv": "v", "v": "v",
    "kv_a_proj_with_mqa": "kv", "kv_b_proj": "kv",
    "o_proj": "o", "out_proj": "o", "wo": "o", "o": "o",
    "qkv_proj": "qkv", "query_key_value": "qkv", "wqkv": "qkv", "c_attn": "qkv", "qkv": "qkv",
    "gate_proj": "gate", "w1": "gate", "gate": "gate", "wi_0": "gate",
    "gate_up_proj": "gate_up", "input_linear": "gate_up",
    "up_proj": "up", "w3": "up", "fc1": "up", "c_fc": "up", "dense_h_to_4h": "up", "up": "up",
    "wi": "up", "wi_1": "up",
    "down_proj": "down", "w2": "down", "fc2": "down", "dense_4h_to_h": "down", "down": "down",
    "output_linear": "down",
}
_ATTENTION_WORDS = ("attn", "attention")
_FFN_WORDS = ("mlp", "feed_forward", "densereludense", "ffn", "experts")
# State-space mixers (Mamba in Granite 4 / Jamba / Falcon-Mamba / Nemotron-H): their in_proj / out_proj
# are not attention's, though attention's output is also called out_proj elsewhere (CLIP, BART)
_SSM_WORDS = ("mamba", "mixer", "ssm")
_SSM_TYPES = {"in_proj": "ssm_in", "out_proj": "ssm_out"}


def _module_parts(fqn: str) -> list[str]:
    """The module path of a weight: without `.weight` / `.bias`, and without the expert index that
    a plan's slice of a fused 3-D expert weight ends with (`experts.gate_up_proj.3`)."""
    parts = fqn.split(".")
    if parts and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    if len(parts) > 1 and parts[-1].isdigit() and "experts" in parts[:-1]:
        parts = parts[:-1]
    return parts


def expert_index(fqn: str) -> int | None:
    """The expert a weight belongs to: the number after `experts.` (a module per expert) or the
    slice index of a fused 3-D expert weight (`experts.down_proj.5`); None outside the experts.

    Example:
        >>> expert_index("model.layers.0.mlp.experts.3.up_proj.weight"), expert_index("model.layers.0.mlp.experts.down_proj.5")
        (3, 5)
    """
    parts = fqn.split(".")
    if "experts" not in parts:
        return None
    index = next((p for p in parts[parts.index("experts") + 1:] if p.isdigit()), None)
    return None if index is None else int(index)


def projection_type(fqn: str) -> str:
    """The projection a weight belongs to: one of `PROJECTION_ORDER` ("other" when unknown).

    Knows Llama/Qwen (`q_proj` ... `down_proj`), llama2.c (`wq wk wv wo`, `w1`=gate, `w3`=up,
    `w2`=down), BERT/MiniLM (`query key value`, `attention.output.dense`=o, `intermediate.dense`=up,
    `output.dense`=down), GPT-2 (`c_attn`=qkv, `attn.c_proj`=o, `mlp.c_fc`=up, `mlp.c_proj`=down),
    OPT (`fc1`/`fc2`), GPT-NeoX (`query_key_value`, `attention.dense`=o) and Mamba mixers
    (`mamba.in_proj`=ssm_in, `mamba.out_proj`=ssm_out).

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
    within = lambda words: any(w in p for p in parts[:-1] for w in words)  # noqa: E731 - a module above the leaf
    in_attention = within(_ATTENTION_WORDS)
    if leaf in _SSM_TYPES and not in_attention and within(_SSM_WORDS):
        return _SSM_TYPES[leaf]
    if leaf == "c_proj":  # GPT-2 uses one name for the attention output and the MLP down projection
        return "o" if in_attention else "down" if parent == "mlp" else "other"
    if leaf == "wo" and within(_FFN_WORDS):  # T5's FFN output
        return "down"
    if leaf == "dense":  # BERT / GPT-NeoX reuse "dense": the module path decides
        if parent == "intermediate":
            return "up"
        if in_attention:  # BERT attention.output.dense, NeoX attention.dense
            return "o"
        return "down" if parent == "output" else "other"
    return _LEAF_TYPES.get(leaf, "other")


def short_name(fqn: str) -> str:
    """A short file-name-safe label of a weight: `block3_q` (`block3_gate_up_e5` for expert 5) when
    the block and projection are known, else the FQN without `.weight` and with unsafe characters
    replaced.

    Example:
        >>> short_name("model.layers.3.self_attn.q_proj.weight"), short_name("lm_head.weight")
        ('block3_q', 'lm_head')
        >>> short_name("model.layers.1.mlp.experts.gate_up_proj.2")
        'block1_gate_up_e2'
    """
    block, proj, expert = block_index(fqn), projection_type(fqn), expert_index(fqn)
    if block is not None and proj != "other":
        return f"block{block}_{proj}" + ("" if expert is None else f"_e{expert}")
    return re.sub(r"[^A-Za-z0-9_-]+", "_", fqn.removesuffix(".weight")).strip("_") or "layer"


def _weighted_sparsity(layers: Iterable[LayerPlan]) -> float:
    """1 - kept / total over the layers (parameter weighted, like the paper's global budget)."""
    layers = list(layers)
    total = sum(layer.numel for layer in layers)
    return 1.0 - sum(layer.n_kept for layer in layers) / total if total else float("nan")


def plan_stats(plan: TilePlan) -> dict[str, Any]:
    """Parameter-weighted sparsity per block, per projection type and per (block, projection).

    Returns {"global": float, "target": float | None, "per_block": {block: s}, "per_projection":
    {type: s}, "grid": {(block, type): s}, "experts": {(block, expert): s}, "other": s | None} with
    blocks sorted and projection types in `PROJECTION_ORDER`; "experts" covers each MoE expert's
    weights (empty for a dense model); "other" is the sparsity of the planned layers outside any block.

    Example:
        >>> plan_stats(plan)["per_projection"]
        {'q': 0.31, 'k': 0.44, ...}
    """
    by_block: dict[int, list] = {}
    by_proj: dict[str, list] = {}
    by_cell: dict[tuple[int, str], list] = {}
    by_expert: dict[tuple[int, int], list] = {}
    outside = []
    for fqn, layer in plan.layers.items():
        block, proj, expert = block_index(fqn), projection_type(fqn), expert_index(fqn)
        by_proj.setdefault(proj, []).append(layer)
        if block is None:
            outside.append(layer)
        else:
            by_block.setdefault(block, []).append(layer)
            by_cell.setdefault((block, proj), []).append(layer)
            if expert is not None:
                by_expert.setdefault((block, expert), []).append(layer)
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
        "experts": {key: _weighted_sparsity(v) for key, v in by_expert.items()},
        "other": _weighted_sparsity(outside) if outside else None,
    }
