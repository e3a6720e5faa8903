"""Runtime: the `patchc::tile_linear` custom op, the inspector / autotuner, dispatch and entry points.

    fast = patchc.runtime.compile(model, plan, batch_size=16, prefill_len=128)   # also patchc.compile
    cm = torch.compile(model, backend="patch", options={"plan": plan})           # entry-point backend
    tunings = patchc.runtime.tune_plan(plan, batch_size=16, prefill_len=128)     # `patchc tune`

Modules: `op` (custom op + launcher), `tuner` (candidates per GPU generation, decode-then-prefill
tuning), `cache` (on-disk JSON cache), `dispatch` (TileLinear), `compile` (patchc.compile), `backend`
(the dynamo backend `patch_backend`).
"""

from __future__ import annotations

from patchc.runtime import op  # noqa: F401  (registers torch.ops.patchc.tile_linear)
from patchc.runtime.cache import TuneCache, default_cache_path
from patchc.runtime.compile import compile  # noqa: A004
from patchc.runtime.dispatch import TileLinear
from patchc.runtime.tuner import LayerTuning, TuneError, candidate_space, candidates, tune_plan

__all__ = [
    "compile",
    "TileLinear",
    "tune_plan",
    "LayerTuning",
    "TuneError",
    "TuneCache",
    "default_cache_path",
    "candidate_space",
    "candidates",
    "patch_backend",
]


def __getattr__(name: str):
    if name == "patch_backend":  # imported on use: it pulls in torch._dynamo
        from patchc.runtime.backend import patch_backend

        return patch_backend
    raise AttributeError(f"module 'patchc.runtime' has no attribute {name!r}")
