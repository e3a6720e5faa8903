"""Reading structure from weight names: which transformer block a weight belongs to.

Example:
    >>> block_index("model.layers.3.mlp.up_proj.weight"), block_index("lm_head.weight")
    (3, None)
"""

from __future__ import annotations

import re

# The block containers of Llama / Qwen (layers), BERT (layer), GPT-2 (h), T5 (block) and others (blocks).
_BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?=\.|$)")


def block_index(fqn: str) -> int | None:
    """Index of the transformer block a weight lives in: the first `layers.N`, `layer.N`, `h.N`,
    `blocks.N` or `block.N` in its FQN; None outside the blocks (embeddings, heads).

    Example:
        >>> block_index("model.encoder.layer.2.attention.self.query.weight")
        2
    """
    m = _BLOCK_RE.search(fqn)
    return int(m.group(1)) if m else None


def block_path(fqn: str) -> str | None:
    """The module path of the transformer block a weight lives in (`block_index`'s), or None outside the blocks.

    Example:
        >>> block_path("model.layers.3.mlp.up_proj.weight"), block_path("lm_head.weight")
        ('model.layers.3', None)
    """
    m = _BLOCK_RE.search(fqn)
    return fqn[: m.end()] if m else None
