"""Which `einsum` equations on a weight are a (batched) matmul patchc can mask, and how.

An einsum "x_subs,w_subs->out" reads the weight W as a matmul y = x W^T when W's subscripts are one
contracted letter k (in x, not in the output) and one output letter n (not in x):

    "bsk,nk->bsn"    W stored (N, K), like nn.Linear
    "...k,kn->...n"  W stored (K, N), like GPT-2's Conv1D (masked as its transpose)
    "nk,bsk->bsn"    the weight may be the first operand

A 3-D weight is a stack of experts when its first letter is a batch letter that x and the output share
("ebk,enk->ebn": expert e's rows of x meet expert e's (N, K) matrix). Anything else (a letter summed
away, a diagonal, an ellipsis on the weight) is refused with the reason, and the weight is listed as
skipped.

Example:
    >>> parse_einsum("bsk,nk->bsn", weight=1, w_ndim=2)
    EinsumMatmul(transposed=False, k_axis=2, expert_axis=None)
    >>> parse_einsum("bsk,kn->bs", weight=1, w_ndim=2)
    "output letter(s) 'n' of the weight are summed away"
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

ELLIPSIS = "."  # "..." is replaced by one character so every subscript is one character


@dataclass(frozen=True)
class EinsumMatmul:
    """How an einsum reads its weight: stored (K, N) (`transposed`), and which activation axes hold K
    and the expert index (negative when counted after an ellipsis)."""

    transposed: bool
    k_axis: int
    expert_axis: int | None = None


def split_equation(eq: str) -> tuple[list[str], str]:
    """(operand subscripts, output subscripts); an implicit output is numpy's: the letters used once,
    sorted, after an ellipsis if any operand has one."""
    eq = eq.replace(" ", "").replace("...", ELLIPSIS)
    lhs, arrow, out = eq.partition("->")
    inputs = lhs.split(",")
    if not arrow:
        counts = Counter(c for s in inputs for c in s if c != ELLIPSIS)
        out = ("." if any(ELLIPSIS in s for s in inputs) else "") + "".join(sorted(c for c, n in counts.items() if n == 1))
    return inputs, out


def _axis(subs: str, letter: str) -> int:
    """The axis of `letter` in an operand: counted from the front before an ellipsis, from the back after."""
    i = subs.index(letter)
    cut = subs.find(ELLIPSIS)
    return i if cut < 0 or i < cut else i - len(subs)


def parse_einsum(eq: str, weight: int, w_ndim: int) -> EinsumMatmul | str:
    """How operand `weight` (a `w_ndim`-D parameter) of einsum `eq` is read, or why it is not a matmul."""
    inputs, out = split_equation(eq)
    if len(inputs) != 2 or weight not in (0, 1):
        return f"{len(inputs)} operands (patchc masks two-operand einsums)"
    w_subs, x_subs = inputs[weight], inputs[1 - weight]
    if ELLIPSIS in w_subs:
        return "an ellipsis on the weight"
    if len(w_subs) != w_ndim:
        return f"{len(w_subs)} weight subscripts for a {w_ndim}-D parameter (a broadcast weight)"
    if any(n > 1 for s in (w_subs, x_subs, out) for c, n in Counter(s).items() if c != ELLIPSIS):
        return "a repeated subscript (a diagonal or trace)"
    contracted = [c for c in w_subs if c in x_subs and c not in out]
    outputs = [c for c in w_subs if c not in x_subs and c in out]
    batch = [c for c in w_subs if c in x_subs and c in out]
    summed = [c for c in w_subs if c not in x_subs and c not in out]
    if summed:
        return f"output letter(s) {''.join(summed)!r} of the weight are summed away"
    lost = [c for c in x_subs if c != ELLIPSIS and c not in w_subs and c not in out]
    if lost:
        return f"activation letter(s) {''.join(lost)!r} are summed away before the matmul"
    if len(contracted) != 1 or len(outputs) != 1:
        return f"the weight {w_subs!r} needs one contracted and one output letter, has {contracted} and {outputs}"
    k = contracted[0]
    if w_ndim == 2 and not batch:
        return EinsumMatmul(w_subs.index(k) == 0, _axis(x_subs, k))
    if w_ndim == 3 and len(batch) == 1 and w_subs[0] == batch[0]:
        return EinsumMatmul(w_subs.index(k) == 1, _axis(x_subs, k), _axis(x_subs, batch[0]))
    return f"batch letter(s) {batch} on a {w_ndim}-D weight (only an expert letter first in a 3-D weight)"


__all__ = ["EinsumMatmul", "parse_einsum", "split_equation"]
