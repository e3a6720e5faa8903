"""patchc: learnable tile-level hybrid (dense / 2:4) sparsity for PyTorch models (PATCH).

    ep   = torch.export.export(model, (ids,), {"use_cache": False})                # an HF LM: no KV cache out
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
from patchc.utils.lazy import lazy_exports, names_of

__version__ = "0.1.0"

_moved.install()  # old module paths (patchc.tile_plan, ...) keep working, with a DeprecationWarning

# Imported on first use, so that `import patchc` (and `patchc --help`) does not import torch and Triton.
_LAZY = {
    **names_of("patchc.passes.transform", "transform"),
    **names_of("patchc.passes.program", "MaskedProgram"),
    **names_of("patchc.masking.train", "train_masks", "TrainResult", "lm_loss"),
    **names_of("patchc.masking.harden", "harden"),
    **names_of("patchc.masking.recover", "recover"),
    **names_of("patchc.ir", "TilePlan", "LayerPlan", "PlanError"),
    **names_of("patchc.pruning.calibrate", "calibrate"),
    **names_of("patchc.pruning", "oneshot"),
    "masks": ("patchc.pruning.mask_files", None),
    "codegen": ("patchc.codegen", None),
    **names_of("patchc.runtime", "compile"),
    "backend": ("patchc.runtime.bound_backend", "PatchBackend"),
    "runtime": ("patchc.runtime", None),
    **names_of("patchc.export", "from_pretrained"),
    **names_of("patchc.runtime.lora", "register_lora"),
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["PatchConfig", "DEFAULT_EXCLUDE", *_LAZY]
