"""Stage 2, masking: the differentiable hybrid mask, how it is trained, and how it is made hard.

    hybrid_mask.py   `HybridMask`: tile logits + 2:4 logits -> M (Gumbel-softmax; sample / hard / soft / ones)
    fused.py         the fused training draw: counter-based noise regenerated in backward, W * M in one
                     autograd node saving no noise / softmax / mask (torch ops, eager or torch.compile'd)
    native.py        the same draw as one C loop per direction on the CPU (native_mask.c, built once)
    schedule.py      tau and kappa, linear per optimizer step
    regularizer.py   the density term (global or per block) and the decaying magnitude term
    train.py         `train_masks`: Adam over the logits, clipping, logs, checkpoints, exact resume; `lm_loss`
    optim.py         `MaskOptimConfig`, `LowMemAdam` (bf16 m / v, stochastic rounding), the step in backward,
                     bytes per weight
    harden.py        `harden`: logits -> hard masks -> a verified `TilePlan` (optionally an exact global budget)
    recover.py       `recover`: fine-tune a plan's kept weights with its masks fixed (Adam or a SparseGPT update)

It takes the `MaskedProgram` of `patchc.passes` and hands a `TilePlan` to the IR (`patchc.ir`).
`patchc.train_masks`, `patchc.lm_loss`, `patchc.harden` and `patchc.recover` are the public names.
"""
