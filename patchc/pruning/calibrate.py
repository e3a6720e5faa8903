"""Calibration: run a model on sample batches and record each masked layer's input statistics.

What the one-shot methods need per layer y = x W^T (W of shape (N, K)):

- SparseGPT: the Hessian of the layer-wise reconstruction loss, H = (2 / n) * sum_t x_t x_t^T (K x K),
  averaged over the n calibration tokens (the scale does not change the masks: damping is relative).
- Wanda: the squared L2 norm of each input channel over all tokens, sum_t x_{t,j}^2 (K,).

Layers that read the same input tensor (q/k/v projections, gate/up) share one `InputStats` object,
so their Hessian is accumulated (and stored) once.

Example:
    >>> calib = calibrate(model, list(blocks.split(4)))        # blocks: (n, 128) token ids
    >>> stats = calib["layers.0.self_attn.q_proj.weight"]
    >>> stats.hessian.shape                                  # (K, K)
    torch.Size([64, 64])
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from patchc.config import DEFAULT_EXCLUDE
from patchc.pruning.observe import known_layers, observing_plain, plain_layers


class InputStats:
    """Running statistics of one layer's activation inputs x (..., K).

    Args:
        in_features: K.
        hessian: accumulate x^T x (K*K memory); False keeps only the per-channel norms (Wanda).
        dtype: accumulation dtype of x^T x (float32 default; float64 for very long calibration runs).

    Example:
        >>> s = InputStats(4); s.update(torch.ones(10, 4)); s.hessian[0, 0].item(), s.n_samples
        (2.0, 10)
    """

    def __init__(self, in_features: int, hessian: bool = True, dtype: torch.dtype = torch.float32) -> None:
        self.in_features = int(in_features)
        self.dtype = dtype
        self.n_samples = 0
        self._xtx: torch.Tensor | None = None
        self._want_hessian = hessian
        self._sq: torch.Tensor | None = None

    def update(self, x: torch.Tensor) -> None:
        """Add a batch of inputs x (..., K); every leading position counts as one sample (token)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"InputStats.update: input has {x.shape[-1]} features, expected {self.in_features}")
        x2 = x.detach().reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return
        xf = x2.to(torch.float32)
        sq = xf.square().sum(0, dtype=torch.float64)
        self._sq = sq if self._sq is None else self._sq.add_(sq.to(self._sq.device))
        if self._want_hessian:
            xh = x2.to(self.dtype)
            xtx = xh.T @ xh
            self._xtx = xtx if self._xtx is None else self._xtx.add_(xtx)
        self.n_samples += x2.shape[0]

    @property
    def has_hessian(self) -> bool:
        return self._xtx is not None or (self._want_hessian and not self.n_samples)

    @property
    def hessian(self) -> torch.Tensor:
        """H = (2 / n) * sum x x^T as float32 (K, K), a fresh tensor. A layer that saw no inputs (an expert no
        calibration token picked) knows nothing of them: 2 I, so SparseGPT prunes it as magnitude does."""
        if self._want_hessian and not self.n_samples:
            return torch.eye(self.in_features) * 2.0
        if self._xtx is None:
            raise ValueError(
                "these statistics have no Hessian: calibrate(..., hessian=True) (the default) records it; "
                "SparseGPT needs it"
            )
        return (self._xtx * (2.0 / max(self.n_samples, 1))).to(torch.float32)

    @property
    def sq_norm(self) -> torch.Tensor:
        """sum_t x_{t,j}^2 per input channel j, float32 (K,); ones for a layer that saw no inputs, so Wanda
        prunes it as magnitude does."""
        if self._sq is None:
            return torch.ones(self.in_features)
        return self._sq.to(torch.float32)

    def to(self, device: str | torch.device) -> InputStats:
        """Move the statistics to `device` in place (layers sharing them keep sharing); returns self."""
        self._xtx = None if self._xtx is None else self._xtx.to(device)
        self._sq = None if self._sq is None else self._sq.to(device)
        return self

    @property
    def nbytes(self) -> int:
        n = 0 if self._xtx is None else self._xtx.numel() * self._xtx.element_size()
        return n + (0 if self._sq is None else self._sq.numel() * self._sq.element_size())

    def __repr__(self) -> str:
        return f"InputStats(K={self.in_features}, n_samples={self.n_samples}, hessian={self.has_hessian})"


class Calibration(Mapping):
    """Weight FQN -> InputStats. Layers fed by the same input tensor may share one stats object.

    Example:
        >>> calib["layers.0.self_attn.q_proj.weight"] is calib["layers.0.self_attn.k_proj.weight"]
        True
    """

    def __init__(self, stats: dict[str, InputStats] | None = None) -> None:
        self._stats: dict[str, InputStats] = dict(stats or {})

    def __getitem__(self, fqn: str) -> InputStats:
        try:
            return self._stats[fqn]
        except KeyError:
            raise KeyError(
                f"{fqn}: no calibration statistics for this layer (calibrated: {len(self._stats)} layers, "
                f"e.g. {list(self._stats)[:3]}); pass it in calibrate(..., layers=...)"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._stats)

    def __len__(self) -> int:
        return len(self._stats)

    def __setitem__(self, fqn: str, stats: InputStats) -> None:
        self._stats[fqn] = stats

    def groups(self) -> list[list[str]]:
        """Lists of FQNs sharing one stats object, in first-seen order."""
        by_id: dict[int, list[str]] = {}
        for fqn, s in self._stats.items():
            by_id.setdefault(id(s), []).append(fqn)
        return list(by_id.values())

    @property
    def nbytes(self) -> int:
        return sum(self._stats[g[0]].nbytes for g in self.groups())

    def to(self, device: str | torch.device) -> Calibration:
        """Move every layer's statistics to `device` in place; returns self.

        >>> calib.to("cpu")   # SparseGPT and Wanda move a layer's statistics to its weight's device
        """
        for group in self.groups():
            self._stats[group[0]].to(device)
        return self

    def __repr__(self) -> str:
        return f"Calibration({len(self)} layers, {len(self.groups())} distinct inputs)"


def default_layers(model: Any, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> dict[str, int]:
    """Plan layer name -> in_features of the layers masked by default.

    For an object with `observe_inputs` (a MaskedProgram): its masked layers. For a plain module: the
    layers `patchc.transform` masks, under the same names (`patchc.pruning.observe`): every nn.Linear
    and GPT-2 Conv1D weight whose FQN matches none of the `exclude` globs and that no nn.Embedding also
    reads (a tied LM head), and one "<param>.<e>" per expert of each fused 3-D expert weight.
    """
    if hasattr(model, "observe_inputs") and hasattr(model, "layers"):
        return {fqn: int(model.weight(fqn).shape[-1]) for fqn in model.layers}
    return plain_layers(model, exclude)


def _select_layers(model: Any, layers: Iterable[str] | None) -> dict[str, int]:
    if layers is None:
        return default_layers(model)
    layers = list(layers)
    if hasattr(model, "observe_inputs") and hasattr(model, "layers"):
        known = {fqn: int(model.weight(fqn).shape[-1]) for fqn in model.layers}
    else:
        known = known_layers(model)
    unknown = [f for f in layers if f not in known]
    if unknown:
        raise ValueError(
            f"calibrate: {unknown} are not masked linear weights of this model; known layers: {sorted(known)}"
        )
    return {f: known[f] for f in layers}


def _run(model: Any, batch: Any) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


class _Collector:
    """The callback that routes each observed input to its layer's stats, sharing across layers.

    A layer whose input is the very tensor the previous observed layer read (same storage, offset,
    shape, stride and version) shares that layer's stats; the previous input is held so its memory
    cannot be reused by another tensor in between.
    """

    def __init__(self, stats: dict[str, InputStats], active: set[str], sizes: dict[str, int], hessian: bool):
        self.stats, self.active, self.sizes, self.hessian = stats, active, sizes, hessian
        self._last: tuple[torch.Tensor, tuple, InputStats] | None = None
        self.seen: set[str] = set()

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x._version)

    def __call__(self, fqn: str, x: torch.Tensor) -> None:
        if fqn not in self.active:
            return
        self.seen.add(fqn)
        key = self._key(x)
        # empty inputs (experts no token picked) all look alike: sharing them would merge those experts for good
        if self._last is not None and self._last[1] == key and x.numel():
            shared = self._last[2]
            if fqn not in self.stats and shared.in_features == x.shape[-1]:
                self.stats[fqn] = shared  # first batch: discover the sharing
            if self.stats.get(fqn) is shared:
                return  # this input was already added for the sharing layer
        stats = self.stats.get(fqn)
        if stats is None:
            stats = self.stats[fqn] = InputStats(self.sizes[fqn], hessian=self.hessian)
        stats.update(x)
        self._last = (x, key, stats)

    def end_batch(self) -> None:
        self._last = None


@contextlib.contextmanager
def _observing(model: Any, callback: Callable[[str, torch.Tensor], None], names: set[str]) -> Iterator[None]:
    if hasattr(model, "observe_inputs"):
        # Calibrate the dense model: masks are off while observing, whatever their current state.
        mode = model.mask_mode("ones") if hasattr(model, "mask_mode") else contextlib.nullcontext()
        with model.observe_inputs(callback), mode:
            yield
        return
    with observing_plain(model, names, callback):
        yield


def _discover_groups(model: Any, batch: Any, sizes: dict[str, int]) -> list[list[str]]:
    """Which selected layers share an input tensor (one cheap statistics-free forward)."""
    stats: dict[str, InputStats] = {}
    collector = _Collector(stats, set(sizes), sizes, hessian=False)
    with _observing(model, collector, set(sizes)), torch.no_grad():
        _run(model, batch)
    calib = Calibration(stats)
    groups = calib.groups()
    unseen = [f for f in sizes if f not in stats]
    return groups + [[f] for f in unseen]


def _plan_passes(groups: list[list[str]], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Pack input groups into passes whose float32 Hessians fit in max_bytes (one group may exceed it alone)."""
    passes: list[list[str]] = []
    current: list[str] = []
    used = 0
    for group in groups:
        need = 4 * sizes[group[0]] ** 2
        if current and used + need > max_bytes:
            passes.append(current)
            current, used = [], 0
        current.extend(group)
        used += need
        if need > max_bytes:
            warnings.warn(
                f"calibrate: the Hessian of {group[0]} alone ({need} bytes) exceeds max_hessian_bytes={max_bytes}",
                stacklevel=3,
            )
    if current:
        passes.append(current)
    return passes


def calibrate(
    model: Any,
    batches: Iterable[Any],
    layers: Iterable[str] | None = None,
    hessian: bool = True,
    max_hessian_bytes: int | None = None,
    progress: bool = True,
    store: str | torch.device | None = None,
) -> Calibration:
    """Run `model` on `batches` and record input statistics of the masked layers.

    Args:
        model: a plain nn.Module (its nn.Linear / Conv1D inputs through forward pre-hooks, FQN
            "<module>.weight"; each fused expert's routed tokens, "<param>.<e>": `patchc.pruning.observe`)
            or an object with `observe_inputs(callback)` (a `patchc.MaskedProgram`; masks are off).
        batches: model inputs: a tensor (model(batch)), a tuple (model(*batch)) or a dict (model(**batch)).
        layers: plan layer names to record (default: the layers `patchc.transform` masks, as
            `default_layers`; or the program's masked layers).
        hessian: record the K x K Hessians (SparseGPT); False records only channel norms (Wanda).
        max_hessian_bytes: bound on the float32 Hessians held at once; above it the batches are
            run several times, each pass recording a subset of the layers.
        progress: show a tqdm progress bar.
        store: where each pass's statistics go once it is done (e.g. "cpu": they accumulate on the
            model's GPU, at most `max_hessian_bytes` of them at a time, and leave it); None keeps them there.

    Returns a `Calibration` (FQN -> InputStats).

    Example:
        >>> calib = calibrate(model, batches, max_hessian_bytes=2**30)
        >>> masks = patchc.oneshot(model, "sparsegpt", calib=calib)
    """
    sizes = _select_layers(model, layers)
    if not sizes:
        raise ValueError("calibrate: no layers selected (the model has no maskable nn.Linear, Conv1D or fused experts)")
    if isinstance(batches, torch.Tensor):
        raise TypeError(
            "calibrate takes an iterable of batches, not one tensor: e.g. list(ids.split(8)) for (n, T) ids"
        )
    batches = batches if isinstance(batches, (list, tuple)) else list(batches)
    if not batches:
        raise ValueError("calibrate: no calibration batches given")
    passes = [list(sizes)]
    if hessian and max_hessian_bytes is not None and 4 * sum(k * k for k in sizes.values()) > max_hessian_bytes:
        passes = _plan_passes(_discover_groups(model, batches[0], sizes), sizes, max_hessian_bytes)

    from tqdm.auto import tqdm

    stats: dict[str, InputStats] = {}
    was_training = getattr(model, "training", False)
    model.train(False)
    seen: set[str] = set()
    try:
        for i, active in enumerate(passes):
            collector = _Collector(stats, set(active), sizes, hessian)
            desc = "calibrate" if len(passes) == 1 else f"calibrate pass {i + 1}/{len(passes)}"
            with _observing(model, collector, set(active)), torch.no_grad():
                for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
                    _run(model, batch)
                    collector.end_batch()
            seen |= collector.seen
            for fqn in active if store is not None else ():
                if fqn in stats:
                    stats[fqn].to(store)  # a shared object moves once: later moves are no-ops
    finally:
        model.train(was_training)
    missing = [f for f in sizes if f not in seen]
    if missing:
        warnings.warn(f"calibrate: these layers never ran on the calibration batches: {missing}", stacklevel=2)
    return Calibration({f: stats[f] for f in sizes if f in stats})


__all__ = ["InputStats", "Calibration", "calibrate", "default_layers"]
