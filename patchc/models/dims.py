"""Dynamic dimensions for torch.export that behave the same on every torch patchc supports (2.11-2.13).

A named `torch.export.Dim` is strict: export fails on any guard about it that its symbolic reasoning
cannot prove for the whole range. torch 2.11 cannot prove a guard like min(8*T, 16*T) == 8*T, which the
view check of transformers' `repeat_kv` (an expand + reshape of the kv heads) adds, so grouped-query
attention models failed to export with a dynamic length there and fell back to one graph per length.
`Dim.DYNAMIC` keeps the dimension symbolic and records such guards instead; it still fails when the
dimension would be specialised to one value (what `export_causal_lm`'s fallback catches).

Example:
    >>> ep = torch.export.export(model, (ids,), dynamic_shapes={"input_ids": {0: dynamic_dim(1024), 1: dynamic_dim(512)}})
"""

from __future__ import annotations

import torch


def dynamic_dim(max: int, min: int = 1) -> object:  # noqa: A002 - torch.export's own keyword names
    """A dimension of `min..max` that torch.export must keep symbolic."""
    return torch.export.Dim.DYNAMIC(min=min, max=max)
