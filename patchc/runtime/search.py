"""How the tuner walks the candidate space: coordinate descent from the architecture's default config.

Timing every candidate is out of reach on a real GPU: sm_90's table holds ~750 decode configs for a
LLaMA-2-7B layer at M = 1, and each distinct config is a Triton compile (~1 s) before its timing. Cost is
close to separable in the axes (block shape, block_m, kernel, split-K and how its sums are added, warps,
stages), so the search starts at the config the untuned path would run (`resolve_config`), tries every
value of one axis with the others held (at prefill sizes the kernel is an axis: the decode kernel competes
with the tiled GEMM), moves to the fastest, and goes round the axes again until a round changes nothing
(at most `max_rounds`).
Each round times about the sum of the axis sizes (~20 on sm_90), not their product, and the result is
never slower than the default as measured. Only if the default and all its neighbours fail (compile
errors, out of resources) are the remaining candidates timed one by one.

Example:
    >>> cfg, ms = descend(start, cands, lambda c: timer.time(c, 16))   # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Callable

from patchc.codegen.configs import KernelConfig

# the axes, in the order they are walked: what sets occupancy and bytes per load first
AXES: tuple[tuple[str, ...], ...] = (("block_n", "block_k"), ("block_m",), ("kernel",), ("split_k",), ("reduce",),
                                     ("num_warps",), ("num_stages",))
MAX_ROUNDS = 3


def _axis_value(cfg: KernelConfig, axis: tuple[str, ...]) -> tuple:
    return tuple(getattr(cfg, f) for f in axis)


def _others(cfg: KernelConfig, axis: tuple[str, ...]) -> tuple:
    return tuple(getattr(cfg, f) for f in KernelConfig.__dataclass_fields__ if f not in axis)


def neighbours(cfg: KernelConfig, pool: list[KernelConfig], axis: tuple[str, ...]) -> list[KernelConfig]:
    """The configs of `pool` that differ from `cfg` in `axis` alone (cfg itself excluded)."""
    rest = _others(cfg, axis)
    return [c for c in pool if _others(c, axis) == rest and _axis_value(c, axis) != _axis_value(cfg, axis)]


def descend(start: KernelConfig, cands: list[KernelConfig], time: Callable[[KernelConfig], float],
            max_rounds: int = MAX_ROUNDS, prepare: Callable[[list[KernelConfig]], None] | None = None,
            ) -> tuple[KernelConfig | None, float]:
    """(fastest config found, its ms) walking `cands` from `start`; (None, inf) when every config failed.

    `time(cfg)` returns ms, inf for a config that fails; it should memoise (configs are revisited).
    `prepare(cfgs)`, if given, is called with each axis's configs before they are timed (the tuner
    compiles them in parallel there).
    """
    pool = list(dict.fromkeys([start, *cands]))
    best, best_ms = start, time(start)
    for _ in range(max_rounds):
        moved = False
        for axis in AXES:
            near = neighbours(best, pool, axis)
            if prepare is not None:
                prepare(near)
            for c in near:
                ms = time(c)
                if ms < best_ms:  # strictly faster: ties keep the config already held
                    best, best_ms, moved = c, ms, True
        if not moved:
            break
    if math.isfinite(best_ms):
        return best, best_ms
    if prepare is not None:
        prepare(cands)
    scored = [(time(c), i, c) for i, c in enumerate(cands)]  # the default's region all failed: try the rest
    ms, _, cfg = min(scored, default=(math.inf, 0, None))
    return (cfg, ms) if math.isfinite(ms) else (None, math.inf)
