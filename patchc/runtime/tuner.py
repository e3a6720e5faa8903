"""Inspector / autotuner: per layer, the best kernel configs for decode and for prefill.

Order (the paper's appendix on STOICC integration):

1. Decode first (M = batch size): it runs once per generated token, so it dominates generation time.
   Candidates vary the block shape (BLOCK_N, BLOCK_K), split-K, warps and stages.
2. The block shape of the decode winner fixes the packed layout (the order and cut of the compressed
   buffers), which both regimes must share; prefill (M = batch * prefill length) is then tuned over the
   rest (kernel: the tiled GEMM or the decode kernel; block_m, split-K, warps, stages) with that block.
3. All-2:4 layers are tuned without that coupling: every block's default configs are timed in both
   regimes, the two blocks with the lowest ``prefill_len * t_decode + t_prefill`` are searched in full,
   and the lower of those wins (one packed copy is kept, so one block). At
   large M, torch's ``to_sparse_semi_structured`` (cuSPARSELt / CUTLASS) is also timed and used for
   prefill when it is faster (GPU, fp16/bf16 only).
   Every layer's prefill is also timed unpacked: W * M unpacked on the device (a copy of the weight's
   bytes, `codegen.unpack_kernel`), then cuBLAS; it serves prefill where it is faster than the hybrid
   kernel (stock Triton has no sparse tensor-core instruction, so at prefill sizes cuBLAS may win).
4. All-dense layers are not tuned: they stay ``F.linear`` (cuBLAS).
5. Dispatch threshold: the decode configs serve M <= threshold, the prefill config above. Starting at the
   batch size, M is doubled while the tuned decode config is not slower than the tuned prefill config;
   the threshold is the last M where decode won (>= batch size).
6. Decode buckets: with the block fixed, one decode config per M bucket (M = 1, 2-4, 5-8, 9-16, 17-64 by
   default, `ArchDefaults.decode_buckets`), timed at the bucket's largest M, so every M <= 16 reads the
   weights once and M = 1 does not pay for the batch size's padding.

Candidates come from `candidates.py` (one table per GPU generation, sm_80 / sm_90), pruned before any timing
(`prune_reason`): blocks that do not divide the plan tile or exceed the layer, estimated shared memory above the
device limit, split-K leaving too little K per split; then walked by coordinate descent from the default config
(`search.py`: ~20 timings a round, not all ~400), each axis's configs compiled in parallel threads first. Layers of
one `tuning_class` share one tuning. A config that fails to compile or runs out of resources scores infinity. Timing
is `triton.testing.do_bench` on the GPU; `time_fn` is injectable (tests count its calls). Results: the `TuneCache`.

Example:
    >>> tunings = tune_plan(plan, batch_size=16, prefill_len=128)      # doctest: +SKIP
    >>> tunings["layers.0.mlp.up_proj.weight"].decode                   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from patchc.codegen.configs import ARCH_TABLE, KernelConfig, resolve_config
from patchc.codegen.layout import PackedLayer
from patchc.runtime.cache import TuneCache, drop_stale
from patchc.runtime.candidates import PREFILL_KERNELS
from patchc.runtime.op import KERNEL_CODES, decode_config, encode_buckets, encode_config
from patchc.runtime.timing import LayerTimer, Setup, TimeFn, TuneError, score, setup
from patchc.utils.progress import progress as progress_bar

log = logging.getLogger(__name__)

BACKENDS = ("triton", "semi_structured", "unpacked")
ALL_24_BLOCKS_SEARCHED = 2  # all-2:4 layers: the blocks whose default configs time best, searched in full
SHARE_STEP = 0.125  # 2:4 tile share per tuning class: one step moves a layer's weight bytes by <= 5.5%


@dataclass(frozen=True)
class LayerTuning:
    """Tuned (or default) launch choices of one layer.

    block: the packed block (BLOCK_N, BLOCK_K); decode / prefill: resolved KernelConfigs (decode: the one tuned at
    the batch size, which chose the block; prefill: the GEMM kernel or the decode kernel, whichever timed faster, or
    "unpacked"); buckets: ((largest M, decode config), ...) by M, each tuned at its largest M (empty: `decode`
    serves every M up to the threshold); threshold: decode serves M <= threshold; prefill_backend: "triton",
    "unpacked" (with a prefill config of kernel "unpacked": W * M unpacked, then cuBLAS) or "semi_structured"
    (all-2:4 layers, GPU only); source: "tuned", "cache", "default", "shared" (another layer's tuning,
    `tuning_class`) or "partial" (a search `tune_plan`'s time limit cut short).

    Example:
        >>> t = LayerTuning("fc.weight", (64, 64), KernelConfig("decode", 16, 64, 64, 4, 4, 4, 8, "fixup"),
        ...                 KernelConfig("prefill", 128, 64, 64, 1, 8, 3, 8, "fixup"), threshold=64)
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
    buckets: tuple[tuple[int, KernelConfig], ...] = ()

    def __post_init__(self) -> None:
        where = f"layer {self.fqn!r}"
        configs = [("decode", self.decode), ("prefill", self.prefill)]
        configs += [(f"decode bucket M <= {m}", cfg) for m, cfg in self.buckets]
        for name, cfg in configs:
            encode_config(cfg)  # raises unless fully resolved
            if (cfg.block_n, cfg.block_k) != tuple(self.block):
                raise ValueError(f"{where}: {name} config block ({cfg.block_n}, {cfg.block_k}) != block {self.block}")
        if self.buckets:
            encode_buckets(list(self.buckets))  # increasing bounds
            if any(cfg.kernel != "decode" for _, cfg in self.buckets):
                raise ValueError(f"{where}: decode buckets must hold decode configs")
        if self.prefill.kernel == "prefill" and self.prefill.block_m < 16:
            raise ValueError(f"{where}: prefill config needs block_m >= 16")
        if self.threshold < 0:
            raise ValueError(f"{where}: threshold must be >= 0, got {self.threshold}")
        if self.prefill_backend not in BACKENDS:
            raise ValueError(f"{where}: prefill_backend must be one of {BACKENDS}, got {self.prefill_backend!r}")
        # semi_structured keeps any config: the op's own route where torch's 2:4 kernels cannot serve
        kernels = {"triton": PREFILL_KERNELS, "unpacked": ("unpacked",)}.get(self.prefill_backend, KERNEL_CODES)
        if self.prefill.kernel not in kernels:
            raise ValueError(f"{where}: prefill_backend {self.prefill_backend!r} does not go with a prefill config of "
                             f"kernel {self.prefill.kernel!r} ('triton': one of {PREFILL_KERNELS}, 'unpacked': "
                             "'unpacked')")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for reports and the `patchc tune` command)."""
        d = asdict(self)
        d["decode"], d["prefill"] = asdict(self.decode), asdict(self.prefill)
        d["block"], d["notes"] = list(self.block), list(self.notes)
        d["buckets"] = [[m, asdict(cfg)] for m, cfg in self.buckets]
        return d


def default_tuning(layer: Any, packed: PackedLayer, batch_size: int, prefill_len: int, arch: str) -> LayerTuning:
    """Untuned choices from the architecture table (`patchc.codegen.configs`), for `packed.block`.

    Example:
        >>> t = default_tuning(layer, pack(layer, block=(16, 16)), 16, 128, "sm_80")   # doctest: +SKIP
    """
    dec = resolve_config(KernelConfig(kernel="decode"), packed, batch_size, arch)
    pre = resolve_config(KernelConfig(kernel="prefill"), packed, batch_size * prefill_len, arch)
    buckets = tuple((m, resolve_config(KernelConfig(kernel="decode"), packed, m, arch))
                    for m in ARCH_TABLE[arch].decode_buckets)
    return LayerTuning(layer.name, packed.block, dec, pre, threshold=max(batch_size, ARCH_TABLE[arch].decode_max_m),
                       buckets=buckets)


def _tune_decode(t: LayerTimer) -> tuple[tuple[int, int], KernelConfig, float]:
    """Decode regime: all blocks; for all-2:4 layers the block is chosen jointly with prefill."""
    s = t.s
    m_dec, m_pre = s.batch_size, s.batch_size * s.prefill_len
    if not t.all_sparse:
        cfg, ms = t.best("decode", m_dec)
        if cfg is None:
            raise TuneError(f"layer {t.layer.name!r}: every decode candidate failed or was pruned")
        return (cfg.block_n, cfg.block_k), cfg, ms
    best: tuple[float, tuple[int, int], KernelConfig, float] | None = None
    searched = 0
    for block in _rank_blocks(t, m_dec, m_pre):
        dcfg, dms = t.best("decode", m_dec, block)
        _, pms = t.best("prefill", m_pre, block)
        total = s.prefill_len * dms + pms  # one prefill pass, ~prefill_len decode steps
        if dcfg is not None and math.isfinite(total):
            searched += 1
            if best is None or total < best[0]:
                best = (total, block, dcfg, dms)
        if searched == ALL_24_BLOCKS_SEARCHED:
            break
    if best is None:
        raise TuneError(f"layer {t.layer.name!r}: every all-2:4 candidate failed or was pruned")
    return best[1], best[2], best[3]


def _rank_blocks(t: LayerTimer, m_dec: int, m_pre: int) -> list[tuple[int, int]]:
    """An all-2:4 layer's candidate blocks, best first by `prefill_len * decode + prefill` of each block's
    default configs (compiled together first): searching each block in full cost ~7x."""
    blocks = sorted({(c.block_n, c.block_k) for c in t.cands("decode", m_dec)})
    starts = {b: (t.start("decode", m_dec, b), t.start("prefill", m_pre, b)) for b in blocks}
    t.compile([d for d, _ in starts.values()], m_dec)
    t.compile([p for _, p in starts.values()], m_pre)
    total = {b: t.s.prefill_len * t.time(d, m_dec) + t.time(p, m_pre) for b, (d, p) in starts.items()}
    return sorted(blocks, key=total.__getitem__)  # stable: ties keep the blocks' order


def _threshold(t: LayerTimer, dec: KernelConfig, pre: KernelConfig) -> int:
    """Largest probed M (doubling from the batch size) where the decode config still wins."""
    m, limit = t.s.batch_size, t.s.batch_size * t.s.prefill_len
    thr = m
    while m * 2 < limit:
        m *= 2
        d = t.time(dec, m)
        if not math.isfinite(d) or d > t.time(pre, m):  # decode failed, was not timed (time limit) or lost
            break
        thr = m
    return thr


def _semi_structured_ms(t: LayerTimer, m: int) -> float:
    """ms of F.linear with torch's 2:4 semi-structured weight (inf where unsupported)."""
    s = t.s
    if s.device.type != "cuda" or s.dtype not in (torch.float16, torch.bfloat16) or s.over():
        return math.inf
    try:
        from torch.sparse import to_sparse_semi_structured

        w = to_sparse_semi_structured(t.layer.to_dense().to(device=s.device, dtype=s.dtype))
    except Exception as e:  # shape / dtype / build without cuSPARSELt or CUTLASS
        log.debug("patchc tune: semi-structured unavailable for %s (%s)", t.layer.name, e)
        return math.inf
    x = t.x(m)
    return score(s.time_fn, functools.partial(F.linear, x, w), f"{t.layer.name} semi_structured M={m}")


def _record_cfg(rec: Mapping[str, Any], name: str, block: tuple[int, int], kernel: str | None = None) -> KernelConfig:
    """A cached 7-int config plus the block it was tuned with; one of another `kernel` than its place needs is stale."""
    cfg = dataclasses.replace(decode_config(list(rec[name])), block_n=int(block[0]), block_k=int(block[1]))
    if kernel not in (None, cfg.kernel):
        raise ValueError(f"a {cfg.kernel} config where a {kernel} one belongs")
    return cfg


def tune_layer(layer: Any, s: Setup, cached_only: bool = False) -> LayerTuning | None:
    """Tune (or read from the cache) one layer; None for all-dense layers or, with `cached_only`, a miss."""
    if not layer.n_sparse:
        return None  # all dense: F.linear / cuBLAS
    t = LayerTimer(layer, s)
    m_dec, m_pre = s.batch_size, s.batch_size * s.prefill_len

    def cached_decode(rec: Mapping[str, Any]) -> tuple[tuple[int, int], KernelConfig, float]:
        block = (int(rec["block"][0]), int(rec["block"][1]))
        cfg, ms = _record_cfg(rec, "config", block, "decode"), float(rec["ms"])
        t.packed(block)  # the block must still pack this layer
        return block, cfg, ms

    decode = _cached_or_tuned(t, t.key("decode", m_dec, "*"), cached_decode, lambda: _tune_decode(t),
                              lambda r: {"block": list(r[0]), "config": encode_config(r[1]), "ms": r[2]}, cached_only)
    if decode is None:
        return None
    block, dec, dms = decode
    prefill = _cached_or_tuned(
        t, t.key("prefill", m_pre, block) + f"|dec={encode_config(dec)}",
        lambda rec: (_record_cfg(rec, "config", block), float(rec["ms"]), str(rec["backend"]), int(rec["threshold"])),
        lambda: _tune_prefill(t, block, dec),
        lambda r: {"config": encode_config(r[0]), "ms": r[1], "backend": r[2], "threshold": r[3]}, cached_only)
    if prefill is None:
        return None
    buckets = _tune_buckets(t, block, dec, cached_only)
    if buckets is None:
        return None
    pre, pms, backend, thr = prefill
    source = "cache" if t.timed == 0 else "tuned"
    return LayerTuning(layer.name, block, dec, pre, thr, backend, dms, pms, source=source, buckets=buckets)


def _cached_or_tuned(t: LayerTimer, key: str, parse: Callable[[Mapping[str, Any]], Any], tune: Callable[[], Any],
                     record: Callable[[Any], dict[str, Any]], cached_only: bool) -> Any:
    """`parse(the cached record)`, or on a miss (or a stale record, dropped with a warning) `tune()`, stored as
    `record(result)`; None for a miss when `cached_only`."""
    cache = t.s.cache
    rec = cache.get(key) if cache is not None else None
    if rec is not None:
        try:
            return parse(rec)
        except Exception as e:  # a record of another patchc or a hand-edited file: retune
            drop_stale(cache, key, t.layer.name, e)
    if cached_only:
        return None
    result = tune()
    if cache is not None and not t.s.cut:  # a search the time limit cut short is not a tuning to reuse
        cache.put(key, record(result))
    return result


def _tune_prefill(t: LayerTimer, block: tuple[int, int], dec: KernelConfig) -> tuple[KernelConfig, float, str, int]:
    """Prefill config at M = batch * prefill_len with the decode block, its backend, and the threshold."""
    m_pre = t.s.batch_size * t.s.prefill_len
    pre, pms = t.best("prefill", m_pre, block)
    backend = "triton"
    unpacked = t.start("unpacked", m_pre, block)
    ums = t.time(unpacked, m_pre)
    if ums < pms:
        pre, pms, backend = unpacked, ums, "unpacked"
    if pre is None:
        raise TuneError(f"layer {t.layer.name!r}: every prefill candidate with block {block} failed or was pruned")
    if t.all_sparse:
        sms = _semi_structured_ms(t, m_pre)
        if sms < pms:
            backend, pms = "semi_structured", sms
    return pre, pms, backend, _threshold(t, dec, pre)


def _tune_bucket(t: LayerTimer, m: int, block: tuple[int, int]) -> tuple[KernelConfig, float]:
    cfg, ms = t.best("decode", m, block)
    if cfg is None:
        raise TuneError(f"layer {t.layer.name!r}: every decode candidate for M = {m} failed or was pruned")
    return cfg, ms


def _tune_buckets(t: LayerTimer, block: tuple[int, int], dec: KernelConfig,
                  cached_only: bool) -> tuple[tuple[int, KernelConfig], ...] | None:
    """A decode config per M bucket (`decode_buckets` of the architecture), each timed at the bucket's
    largest M with the block fixed: M = 1 gets block_m 1 (padded to 8 tokens), 5..16 one block_m-16 pass.
    None when `cached_only` and one is missing."""
    s, out = t.s, []
    for m in ARCH_TABLE[s.arch].decode_buckets:
        if m == s.batch_size:
            out.append((m, dec))
            continue
        tuned = _cached_or_tuned(t, t.key("decode", m, block) + "|bucket",
                                 lambda rec: (_record_cfg(rec, "config", block, "decode"), None),
                                 functools.partial(_tune_bucket, t, m, block),
                                 lambda r: {"config": encode_config(r[0]), "ms": r[1]}, cached_only)
        if tuned is None:
            return None
        out.append((m, tuned[0]))
    return tuple(out)


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
    share: bool = True,
    time_limit: float | None = None,
    pack: Callable[[str], Any] | None = None,
) -> dict[str, LayerTuning | None]:
    """Tune every planned layer (decode first, then prefill); {fqn: LayerTuning, or None = stays F.linear}.

    `cache`: a TuneCache, a path, None (the default file) or False (no cache). `time_fn(fn) -> ms`
    replaces `triton.testing.do_bench` (then any device works: tests). Without CUDA and without
    `time_fn` it raises `TuneError`. `cached_only`: read the cache, time nothing (misses map to None).
    `share`: a layer whose `tuning_class` is tuned already gets that tuning (source "shared"): a 7B
    model's 224 layers fall into a few classes, and one tuning compiles and times ~100 configs.
    `time_limit`: seconds after which nothing more is compiled or timed: the layer being tuned keeps the
    best configs found so far (source "partial", not written to the cache), later layers map to None (the
    default configs), as with `cached_only`. `pack(fqn)`: the packed layer to tune where `plan.layers` holds
    only what `tuning_class` reads (an inferred plan's `LayerSlot`s): only the first layer of each class is packed.

    Example:
        >>> tunings = tune_plan(patchc.TilePlan.load("model.patch"), batch_size=16, prefill_len=128)  # doctest: +SKIP
    """
    if time_limit is not None and not (time_limit >= 0):
        raise ValueError(f"tune_plan: time_limit must be >= 0 seconds (or None: no limit), got {time_limit}")
    s = setup(batch_size, prefill_len, dtype, device, cache, time_fn, arch)
    if time_limit is not None:
        s.deadline = time.monotonic() + time_limit
    names = list(plan.layers) if layers is None else layers
    out: dict[str, LayerTuning | None] = {}
    tuned: dict[tuple, tuple[str, LayerTuning | None]] = {}  # tuning class -> (its first layer, its tuning)
    for fqn in progress_bar(names, desc="patchc tune", unit="layer", disable=not progress):
        if fqn not in plan.layers:
            raise KeyError(f"layer {fqn!r} is not in the plan")
        layer = plan.layers[fqn]
        key = tuning_class(layer) if share else (fqn,)
        if key in tuned:
            first, tuning = tuned[key]
            out[fqn] = tuning and dataclasses.replace(tuning, fqn=fqn, source="shared",
                                                      notes=(*tuning.notes, f"tuning of {first}"))
            continue
        out[fqn] = _tune_in_time(layer if pack is None else pack(fqn), s, cached_only)
        tuned[key] = (fqn, out[fqn])
    return out


def _tune_in_time(layer: Any, s: Setup, cached_only: bool) -> LayerTuning | None:
    """`tune_layer`, cut short by the setup's deadline: what was found by then (source "partial"), or None
    (the default configs) when that is nothing or the deadline had passed already (cache hits still count)."""
    cut_before = s.over()
    try:
        tuning = tune_layer(layer, s, cached_only=cached_only or cut_before)
    except TuneError:
        if s.cut:
            return None
        raise
    if tuning is not None and s.cut and not cut_before and tuning.source == "tuned":
        tuning = dataclasses.replace(tuning, source="partial", notes=(*tuning.notes, "time limit reached"))
    return tuning


def tuning_class(layer: Any) -> tuple:
    """Layers of one class share a tuning: same shape and tile, and all dense (F.linear), all 2:4, or mixed
    with the same share of 2:4 tiles to within `SHARE_STEP` (what kernel time follows: weight bytes and,
    through split-K, occupancy).

    Example:
        >>> tuning_class(plan.layers["layers.0.mlp.up_proj.weight"])   # doctest: +SKIP
        ((11008, 4096), (128, 128), 'mixed', 4)
    """
    n_sparse, n = layer.n_sparse, layer.n_dense + layer.n_sparse  # a LayerPlan's counts, or a LayerSlot's
    if n_sparse == 0 or n_sparse == n:
        kind: tuple = ("dense",) if n_sparse == 0 else ("2:4",)
    else:  # never bucket 0: a layer with a few 2:4 tiles must not share an all-dense layer's "stays F.linear"
        kind = ("mixed", max(1, round(n_sparse / n / SHARE_STEP)))
    return (tuple(layer.shape), tuple(layer.tile), *kind)
