"""patchc: learnable tile-level hybrid (dense / 2:4) sparsity for PyTorch models (PATCH).

    ep   = torch.export.export(model, (ids,))
    prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35))   # trainable masks
    patchc.train_masks(prog, blocks, patchc.lm_loss, steps=300)                    # or your own loop
    plan = patchc.harden(prog)                                                      # -> TilePlan IR
    plan.save("model.patch"); plan.apply(model)                                     # pruned weights

The folders follow the data flow (README, "Code map"):

    models/ -> passes/ (export graph -> MaskedProgram) -> masking/ (train, harden) -> ir/ (TilePlan)
        -> codegen/ (Triton kernels) -> runtime/ (tune, dispatch); pruning/ gives priors and baselines,
    job/ drives it all (`patchc prune | eval | report | generate | tune`), utils/ serves every stage.
"""

from __future__ import annotations

import importlib

from patchc import _moved
from patchc.config import DEFAULT_EXCLUDE, PatchConfig
from patchc.ir import LayerPlan, PlanError, TilePlan
from patchc.masking.harden import harden
from patchc.masking.recover import recover
from patchc.masking.train import TrainResult, lm_loss, train_masks
from patchc.passes.program import MaskedProgram
from patchc.passes.transform import transform

__version__ = "0.1.0"

_moved.install()  # old module paths (patchc.tile_plan, ...) keep working, with a DeprecationWarning

# Imported on first use: they pull in heavier dependencies (Triton, calibration).
_LAZY = {
    "calibrate": ("patchc.pruning.calibrate", "calibrate"),
    "oneshot": ("patchc.pruning", "oneshot"),
    "masks": ("patchc.pruning.mask_files", None),
    "codegen": ("patchc.codegen", None),
    "compile": ("patchc.runtime", "compile"),
    "backend": ("patchc.runtime.bound_backend", "PatchBackend"),
    "runtime": ("patchc.runtime", None),
    "from_pretrained": ("patchc.export", "from_pretrained"),
    "register_lora": ("patchc.runtime.lora", "register_lora"),
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
    "recover",
    "TilePlan",
    "LayerPlan",
    "PlanError",
    *_LAZY,
]
