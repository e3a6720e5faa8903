"""patchc: learnable tile-level hybrid (dense / 2:4) sparsity for PyTorch models (PATCH).

    ep   = torch.export.export(model, (ids,))
    prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35))   # trainable masks
    patchc.train_masks(prog, blocks, patchc.lm_loss, steps=300)                    # or your own loop
    plan = patchc.harden(prog)                                                      # -> TilePlan IR
    plan.save("model.patch"); plan.apply(model)                                     # pruned weights

Subpackages follow the data flow: `passes` (graph rewrites) -> training -> hardening -> `tile_plan`
(IR) -> `codegen` (Triton kernels) -> `runtime` (dispatch).
"""

from __future__ import annotations

import importlib

from patchc.config import DEFAULT_EXCLUDE, PatchConfig
from patchc.harden import harden
from patchc.tile_plan import LayerPlan, PlanError, TilePlan
from patchc.training import TrainResult, lm_loss, train_masks
from patchc.transform import MaskedProgram, transform

__version__ = "0.1.0"

# Imported on first use: they pull in heavier dependencies (Triton, calibration).
_LAZY = {
    "calibrate": ("patchc.pruning.calibrate", "calibrate"),
    "oneshot": ("patchc.pruning", "oneshot"),
    "masks": ("patchc.masks", None),
    "codegen": ("patchc.codegen", None),
    "compile": ("patchc.runtime", "compile"),
    "runtime": ("patchc.runtime", None),
}


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'patchc' has no attribute {name!r}")


__all__ = [
    "PatchConfig",
    "DEFAULT_EXCLUDE",
    "transform",
    "MaskedProgram",
    "train_masks",
    "TrainResult",
    "lm_loss",
    "harden",
    "TilePlan",
    "LayerPlan",
    "PlanError",
    *_LAZY,
]
