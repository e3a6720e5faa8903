"""`PerLengthExport`: a model that torch.export can only trace at a fixed sequence length.

Chunked linear-attention and state-space layers (Gated DeltaNet in Qwen3.5 / Qwen3-Next, Mamba-2 in
Falcon-H1, Nemotron-H, Bamba, Granite 4) loop in Python over ceil(T / chunk) chunks, so an export
fixes T. `patchc.models.hf_export.export_causal_lm` returns this instead of an ExportedProgram;
`patchc.transform` turns it into a program with one graph per length (`patchc.passes.seq_graphs`).

Example:
    >>> pe = export_causal_lm(qwen35)
    >>> pe.first.module()(torch.zeros(3, pe.length, dtype=torch.long), use_cache=False)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PerLengthExport:
    """The export of a model that runs at sequence length `length` (batch dynamic; its length may be symbolic,
    guarded to a range holding `length`), and `export(T)` for any other length. `reason` says why the length
    could not be symbolic for every length."""

    first: torch.export.ExportedProgram
    export: Callable[[int], torch.export.ExportedProgram]
    length: int
    reason: str = ""


__all__ = ["PerLengthExport"]
