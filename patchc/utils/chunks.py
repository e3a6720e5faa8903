"""How many rows of a (rows, V) tensor a loop over wide rows (a vocabulary's logits) takes at once.

glibc maps every allocation past 32 MB afresh and the kernel zeroes it page by page, so a step that builds
(64 x 152K) temporaries pays their size in page faults every time (half of a sampling step, most of a
perplexity batch's cross-entropy). Pieces of at most `CPU_ROW_ELEMENTS` elements are served from glibc's
heap and reused. A GPU's caching allocator reuses its blocks anyway: there it takes all the rows.

Example:
    >>> rows_at_once(torch.empty(64, 151936))   # on a CPU
    6
"""

from __future__ import annotations

import torch

# The most elements a CPU works on at once: an int64 temporary of 8 MiB
CPU_ROW_ELEMENTS = 1 << 20


def rows_at_once(t: torch.Tensor) -> int:
    """Rows of (rows, V) `t` to work on together: all of them off the CPU, else as many as keep a temporary
    to `CPU_ROW_ELEMENTS` (at least one)."""
    return t.shape[0] if t.device.type != "cpu" else max(1, CPU_ROW_ELEMENTS // t.shape[-1])


__all__ = ["CPU_ROW_ELEMENTS", "rows_at_once"]
