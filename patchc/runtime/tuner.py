"""Inspector / autotuner: per layer, the best kernel configs for decode and for prefill.

Order (the paper's appendix on STOICC integration):

1. Decode first (M = batch size): it runs once per generated token, so it dominates generation time.
   Candidates vary the block shape (BLOCK_N, BLOCK_K), split-K, warps and stages.
2. The block shape of the decode winner fixes the packed layout (the order and cut of the compressed
   buffers), which both regimes must share; prefill (M = batch * prefill length) is then tuned over the
   remaining parameters (block_m, split-K, warps, stages) with that block.
3. All-2:4 layers are tuned without that coupling: every block is timed in both regimes and the block
   minimising ``prefill_len * t_decode + t_prefill`` wins (one packed copy is kept, so one block). At
   large M, torch's ``to_sparse_semi_structured`` (cuSPARSELt / CUTLASS) is also timed and used for
   prefill when it is faster (GPU, fp16/bf16 only).
4. All-dense layers are not tuned: they stay ``F.linear`` (cuBLAS).
5. Dispatch threshold: the decode config serves M <= threshold, the prefill config above. Starting at the
   batch size, M is doubled while the tuned decode config is not slower than the tuned prefill config;
   the threshold is the last M where decode won (>= batch size).

Candidates come from `candidates.py` (one table per GPU generation, sm_80 / sm_90), pruned
before any timing (`prune_reason`): blocks that do not divide the plan tile or exceed the layer,
estimated shared memory above the device limit, split-K leaving too little K per split. A config that
fails to compile or runs out of resources scores infinity. Timing is `triton.testing.do_bench` on the
GPU; `time_fn` is injectable (tests count its calls). Results go to the on-disk `TuneCache`.

Example:
    >>> tunings = tune_plan(plan, batch_size=16, prefill_len=128)      # doctest: +SKIP
    >>> tunings["layers.0.mlp.up_proj.weight"].decode                   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from patchc.codegen.configs import ARCH_TABLE, KernelConfig, arch_of, resolve_config
from patchc.codegen.layout import PackedLayer, kernel_buffers, pack, per_row_counts
from patchc.runtime.cache import TuneCache, cache_key, drop_stale, plan_hash, resolve_cache
from patchc.runtime.candidates import SPACE_VERSION, candidates
from patchc.runtime.op import decode_config, encode_config, launch

log = logging.getLogger(__name__)

TimeFn = Callable[[Callable[[], Any]], float]
BACKENDS = ("triton", "semi_structured")


class TuneError(RuntimeError):
    """Tuning cannot run here (no GPU) or every candidate of a layer failed."""


@dataclass(frozen=True)
class LayerTuning:
    """Tuned (or default) launch choices of one layer.

    block: the packed block (BLOCK_N, BLOCK_K); decode / prefill: resolved KernelConfigs; threshold: the
    decode config serves M <= threshold; prefill_backend: "triton" or "semi_structured" (all-2:4 layers,
    GPU only); source: "tuned", "cache" or "default".

    Example:
        >>> t = LayerTuning("fc.weight", (64, 64), KernelConfig("decode", 16, 64, 64, 4, 4, 4, 8),
        ...                 KernelConfig("prefill", 128, 64, 64, 1, 8, 3, 8), threshold=64)
        >>> t.threshold
        64
    """

    fqn: str
    block: tuple[int, int]
    decode: KernelConfig
    prefill: KernelConfig
    threshold: int
    prefill_backend: str = "triton"
    decode_ms: float | None = None
    prefill_ms: float | None = None
    source: str = "default"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        where = f"layer {self.fqn!r}"
        for name in ("decode", "prefill"):
            cfg = getattr(self, name)
            encode_config(cfg)  # raises unless fully resolved
            if (cfg.block_n, cfg.block_k) != tuple(self.block):
                raise ValueError(f"{where}: {name} config block ({cfg.block_n}, {cfg.block_k}) != block {self.block}")
        if self.prefill.kernel == "prefill" and self.prefill.block_m < 16:
            raise ValueError(f"{where}: prefill config needs block_m >= 16")
        if self.threshold < 0:
            raise ValueError(f"{where}: threshold must be >= 0, got {self.threshold}")
        if self.prefill_backend not in BACKENDS:
            raise ValueError(f"{where}: prefill_backend must be one of {BACKENDS}, got {self.prefill_backend!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for reports and the `patchc tune` command)."""
        d = asdict(self)
        d["decode"], d["prefill"] = asdict(self.decode), asdict(self.prefill)
        d["block"], d["notes"] = list(self.block), list(self.notes)
        return d


def default_tuning(layer: Any, packed: PackedLayer, batch_size: int, prefill_len: int, arch: str) -> LayerTuning:
    """Untuned choices from the architecture table (`patchc.codegen.configs`), for `packed.block`.

    Example:
        >>> t = default_tuning(layer, pack(layer, block=(16, 16)), 16, 128, "sm_80")   # doctest: +SKIP
    """
    dec = resolve_config(KernelConfig(kernel="decode"), packed, batch_size, arch)
    pre = resolve_config(KernelConfig(kernel="prefill"), packed, batch_size * prefill_len, arch)
    return LayerTuning(layer.name, packed.block, dec, pre, threshold=max(batch_size, ARCH_TABLE[arch].decode_max_m))


def packed_buffers(packed: PackedLayer, dtype: torch.dtype, device: Any) -> tuple[tuple[torch.Tensor, ...], tuple[int, int]]:
    """The op's seven buffers in `dtype` on `device`, and the per-row block counts (-1 = they vary).

    Example:
        >>> bufs, per_row = packed_buffers(pack(layer, block=(16, 16)), torch.float32, "cpu")  # doctest: +SKIP
    """
    bufs = tuple(b.to(device=device, dtype=dtype) if b.is_floating_point() else b.to(device)
                 for b in kernel_buffers(packed))
    return bufs, per_row_counts(packed)


def _score(time_fn: TimeFn, fn: Callable[[], Any], what: str) -> float:
    """ms of `fn`, or inf when it fails to compile / runs out of resources / errors."""
    try:
        ms = float(time_fn(fn))
    except Exception as e:  # triton CompilationError / OutOfResources, CUDA OOM, ...: not a usable config
        log.debug("patchc tune: %s failed (%s: %s)", what, type(e).__name__, e)
        return math.inf
    return ms if math.isfinite(ms) and ms >= 0 else math.inf


def do_bench(fn: Callable[[], Any]) -> float:
    """Default GPU timing: median ms of `triton.testing.do_bench` (warm-up compiles the kernel)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40))


@dataclass
class _Setup:
    """What tuning one layer needs besides the layer (internal)."""

    batch_size: int
    prefill_len: int
    dtype: torch.dtype
    device: torch.device
    arch: str
    device_name: str
    time_fn: TimeFn
    cache: TuneCache | None
    smem_limit: int | None


class _Layer:
    """One layer being tuned: packs per block lazily and memoises timings (internal)."""

    def __init__(self, layer: Any, s: _Setup) -> None:
        self.layer, self.s = layer, s
        self.shape = tuple(layer.shape)
        self.tile = tuple(layer.tile)
        self.all_sparse = int((layer.kinds == 0).sum()) == 0
        self._packed: dict[tuple[int, int], tuple[PackedLayer, tuple, tuple[int, int]]] = {}
        self._x: dict[int, torch.Tensor] = {}
        self._ms: dict[tuple, float] = {}
        self.timed = 0

    def packed(self, block: tuple[int, int]) -> tuple[PackedLayer, tuple, tuple[int, int]]:
        if block not in self._packed:
            p = pack(self.layer, block=block)
            bufs, per_row = packed_buffers(p, self.s.dtype, self.s.device)
            self._packed[block] = (p, bufs, per_row)
        return self._packed[block]

    def x(self, m: int) -> torch.Tensor:
        if m not in self._x:
            g = torch.Generator().manual_seed(m)
            self._x[m] = torch.randn(m, self.shape[1], generator=g).to(device=self.s.device, dtype=self.s.dtype)
        return self._x[m]

    def time(self, cfg: KernelConfig, m: int) -> float:
        key = (cfg, m)
        if key not in self._ms:
            _, bufs, per_row = self.packed((cfg.block_n, cfg.block_k))
            # a partial, not a lambda: an injected time_fn can read the config (fn.args[-1]) and M
            fn = functools.partial(launch, self.x(m), bufs, None, self.shape, (cfg.block_n, cfg.block_k), per_row, cfg)
            self._ms[key] = _score(self.s.time_fn, fn, f"{self.layer.name} {cfg} M={m}")
            self.timed += 1
        return self._ms[key]

    def best(self, cands: list[KernelConfig], m: int) -> tuple[KernelConfig | None, float]:
        scored = [(self.time(c, m), i, c) for i, c in enumerate(cands)]
        ms, _, cfg = min(scored, default=(math.inf, 0, None))
        return (cfg, ms) if math.isfinite(ms) else (None, math.inf)

    def cands(self, regime: str, m: int, block: tuple[int, int] | None = None) -> list[KernelConfig]:
        return candidates(regime, self.shape, self.tile, m, self.s.dtype, self.s.arch, block, self.s.smem_limit)

    def key(self, regime: str, m: int, block: tuple[int, int] | str) -> str:
        extra = f"{self.s.arch}/space{SPACE_VERSION}"
        return cache_key(self.s.device_name, self.shape, plan_hash(self.layer.kinds, self.tile, block),
                         self.s.dtype, regime, m, extra)


def _tune_decode(t: _Layer) -> tuple[tuple[int, int], KernelConfig, float]:
    """Decode regime: all blocks; for all-2:4 layers the block is chosen jointly with prefill."""
    s = t.s
    m_dec, m_pre = s.batch_size, s.batch_size * s.prefill_len
    if not t.all_sparse:
        cfg, ms = t.best(t.cands("decode", m_dec), m_dec)
        if cfg is None:
            raise TuneError(f"layer {t.layer.name!r}: every decode candidate failed or was pruned")
        return (cfg.block_n, cfg.block_k), cfg, ms
    best: tuple[float, tuple[int, int], KernelConfig, float] | None = None
    blocks = {(c.block_n, c.block_k) for c in t.cands("decode", m_dec)}
    for block in sorted(blocks):
        dcfg, dms = t.best(t.cands("decode", m_dec, block), m_dec)
        _, pms = t.best(t.cands("prefill", m_pre, block), m_pre)
        total = s.prefill_len * dms + pms  # one prefill pass, ~prefill_len decode steps
        if dcfg is not None and math.isfinite(total) and (best is None or total < best[0]):
            best = (total, block, dcfg, dms)
    if best is None:
        raise TuneError(f"layer {t.layer.name!r}: every all-2:4 candidate failed or was pruned")
    return best[1], best[2], best[3]


def _threshold(t: _Layer, dec: KernelConfig, pre: KernelConfig) -> int:
    """Largest probed M (doubling from the batch size) where the decode config still wins."""
    m, limit = t.s.batch_size, t.s.batch_size * t.s.prefill_len
    thr = m
    while m * 2 < limit:
        m *= 2
        if t.time(dec, m) > t.time(pre, m):
            break
        thr = m
    return thr


def _semi_structured_ms(t: _Layer, m: int) -> float:
    """ms of F.linear with torch's 2:4 semi-structured weight (inf where unsupported)."""
    s = t.s
    if s.device.type != "cuda" or s.dtype not in (torch.float16, torch.bfloat16):
        return math.inf
    try:
        from torch.sparse import to_sparse_semi_structured

        w = to_sparse_semi_structured(t.layer.to_dense().to(device=s.device, dtype=s.dtype))
    except Exception as e:  # shape / dtype / build without cuSPARSELt or CUTLASS
        log.debug("patchc tune: semi-structured unavailable for %s (%s)", t.layer.name, e)
        return math.inf
    x = t.x(m)
    return _score(s.time_fn, functools.partial(F.linear, x, w), f"{t.layer.name} semi_structured M={m}")


def _record_cfg(rec: Mapping[str, Any], name: str, block: tuple[int, int]) -> KernelConfig:
    """A cached 6-int config plus the block it was tuned with (the ints do not carry the block)."""
    return dataclasses.replace(decode_config(list(rec[name])), block_n=int(block[0]), block_k=int(block[1]))


def tune_layer(layer: Any, s: _Setup, cached_only: bool = False) -> LayerTuning | None:
    """Tune (or read from the cache) one layer; None for all-dense layers or, with `cached_only`, a miss."""
    if int((layer.kinds == 1).sum()) == 0:
        return None  # all dense: F.linear / cuBLAS
    t = _Layer(layer, s)
    m_dec, m_pre = s.batch_size, s.batch_size * s.prefill_len
    cache = s.cache
    k_dec = t.key("decode", m_dec, "*")
    rec = cache.get(k_dec) if cache is not None else None
    from_cache = rec is not None
    if rec is not None:
        try:
            block = (int(rec["block"][0]), int(rec["block"][1]))
            dec, dms = _record_cfg(rec, "config", block), float(rec["ms"])
            t.packed(block)  # the block must still pack this layer
        except Exception as e:
            drop_stale(cache, k_dec, layer.name, e)
            rec, from_cache = None, False
    if rec is None:
        if cached_only:
            return None
        block, dec, dms = _tune_decode(t)
        if cache is not None:
            cache.put(k_dec, {"block": list(block), "config": encode_config(dec), "ms": dms})
    k_pre = t.key("prefill", m_pre, block) + f"|dec={encode_config(dec)}"
    rec = cache.get(k_pre) if cache is not None else None
    if rec is not None:
        try:
            pre, pms = _record_cfg(rec, "config", block), float(rec["ms"])
            backend, thr = str(rec["backend"]), int(rec["threshold"])
            return LayerTuning(layer.name, block, dec, pre, thr, backend, dms, pms,
                               source="cache" if from_cache else "tuned")
        except Exception as e:
            drop_stale(cache, k_pre, layer.name, e)
    if cached_only:
        return None
    pre, pms = t.best(t.cands("prefill", m_pre, block), m_pre)
    if pre is None:
        raise TuneError(f"layer {layer.name!r}: every prefill candidate with block {block} failed or was pruned")
    backend = "triton"
    if t.all_sparse:
        sms = _semi_structured_ms(t, m_pre)
        if sms < pms:
            backend, pms = "semi_structured", sms
    thr = _threshold(t, dec, pre)
    if cache is not None:
        cache.put(k_pre, {"config": encode_config(pre), "ms": pms, "backend": backend, "threshold": thr})
    return LayerTuning(layer.name, block, dec, pre, thr, backend, dms, pms, source="tuned")


def _setup(batch_size: int, prefill_len: int, dtype: torch.dtype, device: Any, cache: Any,
           time_fn: TimeFn | None, arch: str | None) -> _Setup:
    if batch_size < 1 or prefill_len < 1:
        raise ValueError(f"batch_size and prefill_len must be >= 1, got {batch_size}, {prefill_len}")
    dev = torch.device(device)
    if time_fn is None and (dev.type != "cuda" or not torch.cuda.is_available()):
        raise TuneError(
            f"tuning needs a CUDA GPU (device={dev}, torch.cuda.is_available()={torch.cuda.is_available()}); "
            "on this machine use the default configs (tune=False) or tune on a GPU machine and reuse its cache"
        )
    smem = None
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name = props.name
        smem = getattr(props, "shared_memory_per_block_optin", None)
    else:
        name = str(dev)
    return _Setup(batch_size, prefill_len, dtype, dev, arch or arch_of(dev), name, time_fn or do_bench,
                  resolve_cache(cache), smem)


def tune_plan(
    plan: Any,
    batch_size: int = 16,
    prefill_len: int = 128,
    dtype: torch.dtype = torch.float16,
    device: Any = "cuda",
    cache: TuneCache | str | None = None,
    progress: bool = True,
    *,
    time_fn: TimeFn | None = None,
    arch: str | None = None,
    cached_only: bool = False,
    layers: list[str] | None = None,
) -> dict[str, LayerTuning | None]:
    """Tune every planned layer (decode first, then prefill); {fqn: LayerTuning, or None = stays F.linear}.

    `cache`: a TuneCache, a path, None (the default file) or False (no cache). `time_fn(fn) -> ms`
    replaces `triton.testing.do_bench` (then any device works: tests). Without CUDA and without
    `time_fn` it raises `TuneError`. `cached_only`: read the cache, time nothing (misses map to None).

    Example:
        >>> tunings = tune_plan(patchc.TilePlan.load("model.patch"), batch_size=16, prefill_len=128)  # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    s = _setup(batch_size, prefill_len, dtype, device, cache, time_fn, arch)
    names = list(plan.layers) if layers is None else layers
    out: dict[str, LayerTuning | None] = {}
    for fqn in tqdm(names, desc="patchc tune", unit="layer", disable=not progress):
        if fqn not in plan.layers:
            raise KeyError(f"layer {fqn!r} is not in the plan")
        out[fqn] = tune_layer(plan.layers[fqn], s, cached_only=cached_only)
    return out

