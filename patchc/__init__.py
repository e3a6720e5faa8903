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

from patchc import _moved
from patchc.config import DEFAULT_EXCLUDE, PatchConfig
from patchc.utils.lazy import lazy_exports

__version__ = "0.1.0"

_moved.install()  # old module paths (patchc.tile_plan, ...) keep working, with a DeprecationWarning

# Imported on first use, so that `import patchc` (and `patchc --help`) does not import torch and Triton.
_LAZY = {
    "transform": ("patchc.passes.transform", "transform"),
    "MaskedProgram": ("patchc.passes.program", "MaskedProgram"),
    "train_masks": ("patchc.masking.train", "train_masks"),
    "TrainResult": ("patchc.masking.train", "TrainResult"),
    "lm_loss": ("patchc.masking.train", "lm_loss"),
    "harden": ("patchc.masking.harden", "harden"),
    "recover": ("patchc.masking.recover", "recover"),
    "TilePlan": ("patchc.ir", "TilePlan"),
    "LayerPlan": ("patchc.ir", "LayerPlan"),
    "PlanError": ("patchc.ir", "PlanError"),
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
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["PatchConfig", "DEFAULT_EXCLUDE", *_LAZY]
