"""SparseGPT (Frantar & Alistarh, 2023): optimal-brain-surgeon pruning with lazy block updates.

For a layer y = x W^T with input Hessian H = (2/n) X^T X, columns are pruned left to right. With U the
upper Cholesky factor of the damped inverse Hessian (U^T U = H^-1), row c of U holds, up to the scale
1/d_c with d_c = U[c, c], the inverse Hessian of the columns not yet processed. Removing weight w of
column c costs w^2 / d_c^2 and is compensated by subtracting (w / d_c) * U[c, c:] from the rest of
its row. The update is applied inside a block of `blocksize` columns eagerly and to the columns
after the block in one matrix product ("lazy batch update").

Mask selection, per row:
- "2:4": at the first column of each group of 4, the 2 weights with the lowest w^2 / d^2 (on the
  weights as updated so far) are pruned.
- "unstructured": at the start of each block, each row prunes its lowest w^2 / d^2 within the
  block (adaptive mask selection); the count per block is cumulative-rounded, so every row prunes
  exactly floor(sparsity * K + 1/2) weights.
- a given `mask`: no selection, only the OBS update (used to update weights under a hybrid mask).

Example:
    >>> keep, w_new = sparsegpt(w, calib["fc.weight"].hessian, pattern="2:4")
    >>> keep.reshape(-1, 4).sum(1).unique()
    tensor([2])
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch

from patchc.pruning.patterns import check_groups, check_sparsity, prune_count

SPARSEGPT_PATTERNS = ("2:4", "unstructured")


def damped_hessian(hessian: torch.Tensor, percdamp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(H + damp * I in float64 with dead inputs' diagonal set to 1, dead (K,) bool).

    A dead input (a channel that is always 0, diag H = 0) gets diagonal 1 so H stays invertible; its
    weights are irrelevant to the output and are treated as 0. damp = percdamp * mean(diag H).
    """
    h = hessian.detach().to(torch.float64).clone()
    diag = h.diagonal()
    dead = diag == 0
    diag[dead] = 1.0
    diag += percdamp * diag.mean()
    return h, dead


def inverse_cholesky(h: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Upper U with U^T U = h^-1, float64.

    With J the reversal permutation and J h J = L L^T, h = R R^T for the upper R = J L J, so
    h^-1 = (R^-1)^T R^-1 and U = R^-1 = J L^-1 J: one Cholesky and one triangular inverse. If h is
    not numerically positive definite the diagonal is damped further (x10, with a warning).
    """
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    extra = 0.0
    for _ in range(6):
        chol, info = torch.linalg.cholesky_ex(torch.flip(h + extra * eye, (0, 1)))
        if int(info) == 0:
            if extra:
                warnings.warn(f"{name}: Hessian not positive definite; added {extra:.3g} to its diagonal", stacklevel=3)
            inv = torch.linalg.solve_triangular(chol, eye, upper=False)
            return torch.flip(inv, (0, 1))
        extra = max(extra * 10, 1e-2 * float(h.diagonal().abs().mean()) or 1e-6)
    raise ValueError(f"{name}: the damped Hessian is not positive definite even after extra damping {extra:.3g}")


def check_hessian(hessian: torch.Tensor, k: int, name: str = "weight") -> None:
    """A (K, K) Hessian for a weight of K input features, or a ValueError naming the layer."""
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"{name}: Hessian shape {tuple(hessian.shape)} does not match in_features K={k}")


def hessian_factor(hessian: torch.Tensor, percdamp: float = 0.01,
                   name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(U float64 with U^T U = (damped H)^-1, dead (K,) bool): what `sparsegpt` prunes with."""
    h, dead = damped_hessian(hessian, percdamp)
    return inverse_cholesky(h, name), dead


# The last factor while `shared_factors` is open: (stats, n_samples, percdamp, device) -> factor
_SHARED: dict[str, Any] = {"open": 0, "key": None, "factor": None}


@contextlib.contextmanager
def shared_factors() -> Iterator[None]:
    """Inside the block, weights pruned one after another with the same calibration statistics (q, k and v read
    one input, as do gate and up; a prior prunes each weight twice, 2:4 then unstructured) share one Hessian
    factor: one Cholesky and one triangular inverse, not up to six. Only the last factor is held (K x K
    float64 on the weights' device), and it is dropped on leaving.

    Example:
        >>> with shared_factors():
        ...     masks = [prune_weight(w, "sparsegpt", "2:4", calib[fqn]) for fqn, w in weights]  # doctest: +SKIP
    """
    _SHARED["open"] += 1
    try:
        yield
    finally:
        _SHARED["open"] -= 1
        if not _SHARED["open"]:
            _SHARED["key"] = _SHARED["factor"] = None


def factor_of(stats: Any, hessian: torch.Tensor, device: torch.device, percdamp: float = 0.01,
              name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """`hessian_factor` of `stats`'s Hessian on `device`, from `shared_factors`'s last factor when it is the same
    statistics object, unchanged since (a Hessian passed as a bare tensor is factored every time)."""
    if not _SHARED["open"] or isinstance(stats, torch.Tensor):
        return hessian_factor(hessian.to(device), percdamp, name)
    key = (stats, getattr(stats, "n_samples", None), float(percdamp), str(device))
    last = _SHARED["key"]
    if last is None or last[0] is not stats or last[1:] != key[1:]:
        _SHARED["key"], _SHARED["factor"] = None, None  # free the old factor before building the next
        _SHARED["factor"] = hessian_factor(hessian.to(device), percdamp, name)
        _SHARED["key"] = key
    return _SHARED["factor"]


def sparsegpt(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    pattern: str = "2:4",
    sparsity: float = 0.5,
    blocksize: int = 128,
    percdamp: float = 0.01,
    mask: torch.Tensor | None = None,
    name: str = "weight",
    factor: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune `weight` (N, K) with SparseGPT; returns (keep mask bool (N, K), OBS-updated weight).

    Args:
        weight: (N, K). Float64 weights are processed in float64, others in float32.
        hessian: (K, K), e.g. `InputStats.hessian`.
        pattern: "2:4" or "unstructured" (per-row `sparsity`); ignored when `mask` is given.
        blocksize: columns per lazy-update block (a multiple of 4 for "2:4").
        percdamp: damping, as a fraction of the mean Hessian diagonal.
        mask: a fixed keep mask; then only the weights are updated.
        name: the weight FQN, for messages.
        factor: `hessian_factor(hessian, percdamp)` on the weight's device, where the caller has it already.

    The updated weight has the input's dtype, with pruned entries exactly 0.
    """
    if weight.dim() != 2:
        raise ValueError(f"{name}: SparseGPT needs a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    check_hessian(hessian, k, name)
    if mask is None:
        if pattern not in SPARSEGPT_PATTERNS:
            raise ValueError(f"{name}: SparseGPT pattern {pattern!r}: choose one of {SPARSEGPT_PATTERNS}")
        if pattern == "2:4":
            check_groups((n, k), name)
            if blocksize % 4:
                raise ValueError(f"{name}: blocksize={blocksize} must be a multiple of 4 for 2:4")
        else:
            check_sparsity(sparsity, name)
    elif tuple(mask.shape) != (n, k):
        raise ValueError(f"{name}: mask shape {tuple(mask.shape)} != weight shape {(n, k)}")
    if blocksize < 1:
        raise ValueError(f"{name}: blocksize={blocksize} must be >= 1")

    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    u, dead = factor if factor is not None else hessian_factor(hessian.to(weight.device), percdamp, name)
    u = u.to(dtype)
    # Work on W^T (K, N): column c of W is the contiguous row wt[c], so every rank-1 and lazy
    # update writes contiguous memory.
    wt = weight.detach().to(dtype).T.contiguous()
    wt[dead] = 0
    keep_t = (
        torch.ones(k, n, dtype=torch.bool, device=wt.device) if mask is None else mask.to(wt.device, torch.bool).T.contiguous()
    )
    select_24 = mask is None and pattern == "2:4"
    select_unstructured = mask is None and pattern == "unstructured"
    err = torch.empty(min(blocksize, k), n, dtype=dtype, device=wt.device)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        if select_unstructured:
            d2 = u.diagonal()[i1:i2].square()
            _select_unstructured(wt[i1:i2], d2, keep_t[i1:i2], prune_count(i2, sparsity) - prune_count(i1, sparsity))
        _prune_block(wt, keep_t, u, err, i1, i2, select_24)
        if i2 < k:
            # Lazy batch update: the block's compensation for every later column in one GEMM.
            wt[i2:].addmm_(u[i1:i2, i2:].T, err[: i2 - i1], alpha=-1.0)
    return keep_t.T.contiguous(), wt.T.contiguous().to(weight.dtype)


# Columns updated one by one inside a sub-block; the block's later sub-blocks get one GEMM. A
# multiple of 4 so 2:4 groups never straddle sub-blocks.
_SUB = 16


def _prune_block(wt, keep_t, u, err, i1: int, i2: int, select_24: bool) -> None:
    """OBS over columns i1..i2-1 of W (rows of wt); err[c - i1] receives (w_c - q_c) / d_c."""
    for j1 in range(i1, i2, _SUB):
        j2 = min(j1 + _SUB, i2)
        for c in range(j1, j2):
            if select_24 and (c - i1) % 4 == 0:
                _select_24(wt[c : c + 4], u.diagonal()[c : c + 4].square(), keep_t[c : c + 4])
            row = wt[c]
            e = err[c - i1]
            torch.mul(row, ~keep_t[c], out=e)
            e.div_(u[c, c])
            # w_c becomes q_c up to rounding (set exactly below); later columns absorb the error.
            # (addmm_ with a rank-1 product: torch's addr_ is many times slower on CPU.)
            wt[c:j2].addmm_(u[c, c:j2, None], e[None, :], alpha=-1.0)
            row.mul_(keep_t[c])
        if j2 < i2:
            wt[j2:i2].addmm_(u[j1:j2, j2:i2].T, err[j1 - i1 : j2 - i1], alpha=-1.0)


def _select_24(w4: torch.Tensor, d2: torch.Tensor, keep4: torch.Tensor) -> None:
    """Keep the 2 highest w^2 / d^2 of each group; w4 (4, N) holds one group per column.

    Ranks by the 6 pairwise comparisons (several times faster than a sort along a dim of 4 on CPU):
    ahead[i] counts the group members ranked before i; ties rank the lower position first, as in
    `patterns.mask_24`.
    """
    s = w4.square() / d2[:, None]
    ahead = torch.zeros(4, s.shape[1], dtype=torch.uint8, device=s.device)
    for i in range(4):
        for j in range(i + 1, 4):
            j_first = s[j] > s[i]
            ahead[i] += j_first
            ahead[j] += ~j_first
    torch.lt(ahead, 2, out=keep4)


def _select_unstructured(w1: torch.Tensor, d2: torch.Tensor, keep1: torch.Tensor, n_prune: int) -> None:
    """Prune the n_prune lowest w^2 / d^2 of each column of w1 (B, N) (a row of W within the block)."""
    if n_prune <= 0:
        return
    saliency = w1.square() / d2[:, None]
    low = torch.argsort(saliency, dim=0, descending=True, stable=True)[saliency.shape[0] - n_prune :]
    keep1.scatter_(0, low, False)


__all__ = ["sparsegpt", "damped_hessian", "inverse_cholesky", "SPARSEGPT_PATTERNS"]
