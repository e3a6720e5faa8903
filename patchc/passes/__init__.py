"""Stage 1, graph passes: an exported program in, a trainable `MaskedProgram` out.

    find_linears.py  annotate: the matmuls that read a parameter weight; which are masked, which skipped and why
    einsum_forms.py  which einsum equations are a matmul on a weight, and the (N, K) view of that weight
    insert_masks.py  rewrite: splice a HybridMask node before each masked weight (and calibration observers)
    transform.py     the driver, `patchc.transform`: export, freeze weights, annotate, build masks and priors, insert
    program.py       `MaskedProgram`: the rewritten model with its masks, schedules and regulariser

The program goes on to the masking stage (`patchc.masking`: training, then hardening into the IR).
`patchc.transform` and `patchc.MaskedProgram` are the public names.
"""
