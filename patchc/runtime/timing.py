"""How the tuner times a layer: its packed copies per block, inputs per M, and memoised timings.

`setup` checks that timing can run here (a CUDA GPU, or an injected `time_fn`) and fixes what every
layer shares (batch size, prefill length, dtype, device, architecture, cache, compile threads);
`LayerTimer` packs one layer per block lazily, times a config at an M once, and finds a regime's best
config by coordinate descent (`search.descend`), compiling each axis's configs in parallel threads first
on a GPU (`compile_parallel`). A config that fails to compile or runs out of resources scores infinity.
Timing is `triton.testing.do_bench` on the GPU.

Example:
    >>> s = setup(16, 128, torch.float16, "cuda", None, None, None)          # doctest: +SKIP
    >>> LayerTimer(plan.layers["fc.weight"], s).time(cfg, m=16)               # doctest: +SKIP
    0.0123
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from patchc.codegen.configs import KernelConfig, arch_of, choose_block, resolve_config
from patchc.codegen.layout import PackedLayer, kernel_buffers, pack, per_row_counts
from patchc.runtime.cache import TuneCache, cache_key, plan_hash, resolve_cache
from patchc.codegen.launch import warm
from patchc.runtime.candidates import SPACE_VERSION, candidate_space, candidates
from patchc.runtime.op import launch
from patchc.runtime.search import descend

log = logging.getLogger(__name__)

TimeFn = Callable[[Callable[[], Any]], float]
COMPILE_THREADS_ENV = "PATCHC_COMPILE_THREADS"


class TuneError(RuntimeError):
    """Tuning cannot run here (no GPU) or every candidate of a layer failed."""


def packed_buffers(packed: PackedLayer, dtype: torch.dtype, device: Any) -> tuple[tuple[torch.Tensor, ...], tuple[int, int]]:
    """The op's seven buffers in `dtype` on `device`, and the per-row block counts (-1 = they vary).

    Example:
        >>> bufs, per_row = packed_buffers(pack(layer, block=(16, 16)), torch.float32, "cpu")  # doctest: +SKIP
    """
    bufs = tuple(b.to(device=device, dtype=dtype) if b.is_floating_point() else b.to(device)
                 for b in kernel_buffers(packed))
    return bufs, per_row_counts(packed)


def score(time_fn: TimeFn, fn: Callable[[], Any], what: str) -> float:
    """ms of `fn`, or inf when it fails to compile / runs out of resources / errors."""
    try:
        ms = float(time_fn(fn))
    except Exception as e:  # triton CompilationError / OutOfResources, CUDA OOM, ...: not a usable config
        log.debug("patchc tune: %s failed (%s: %s)", what, type(e).__name__, e)
        return math.inf
    return ms if math.isfinite(ms) and ms >= 0 else math.inf


def compile_parallel(warmers: list[Callable[[], Any]], threads: int) -> None:
    """Run `warmers` (each compiles one kernel config, `launch.warm`) under Triton's AsyncCompileMode: the
    compiles go to a pool of `threads` threads (Triton's compiler and ptxas release the GIL: 2.5x on 2
    cores for 4 kernels) and are all done when this returns. A config that fails to compile is left to
    fail again, and score infinity, when it is timed. A Triton without AsyncCompileMode compiles each
    config at its first timing instead."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    failed: list[str] = []
    try:
        with ThreadPoolExecutor(threads) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for w in warmers:
                try:
                    w()
                except Exception as e:  # noqa: BLE001 - timed (and scored inf) later, with the error logged
                    failed.append(f"{type(e).__name__}: {e}")
                    log.debug("patchc tune: warm-up failed (%s)", failed[-1])
        if failed and len(failed) == len(warmers):  # a broken warm-up, not a bad config: say so once per call
            log.warning("patchc tune: no config could be compiled ahead (%s); each compiles at its timing", failed[0])
    except Exception as e:  # noqa: BLE001 - parallel compiling is an optimisation: fall back to compiling in turn
        log.warning("patchc tune: compiling in parallel failed (%s: %s); compiling each config in turn",
                    type(e).__name__, e)


def do_bench(fn: Callable[[], Any]) -> float:
    """Default GPU timing: median ms of `triton.testing.do_bench` (warm-up compiles the kernel)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


@dataclass
class Setup:
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
    compile_threads: int = 0  # >= 2: compile each axis's configs in that many threads before timing them
    deadline: float | None = None  # time.monotonic() after which nothing more is compiled or timed
    cut: bool = False  # set once a timing was skipped for the deadline: what is found since is partial

    def over(self) -> bool:
        """Whether the deadline has passed (then `cut` is set)."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.cut = True
        return self.cut


class LayerTimer:
    """One layer being tuned: packs per block lazily and memoises timings (internal)."""

    def __init__(self, layer: Any, s: Setup) -> None:
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
            if self.s.over():
                return math.inf  # out of time: not timed (and not memoised: nothing was learned)
            _, bufs, per_row = self.packed((cfg.block_n, cfg.block_k))
            # a partial, not a lambda: an injected time_fn can read the config (fn.args[-1]) and M
            fn = functools.partial(launch, self.x(m), bufs, None, self.shape, (cfg.block_n, cfg.block_k), per_row, cfg)
            self._ms[key] = score(self.s.time_fn, fn, f"{self.layer.name} {cfg} M={m}")
            self.timed += 1
        return self._ms[key]

    def best(self, regime: str, m: int, block: tuple[int, int] | None = None) -> tuple[KernelConfig | None, float]:
        """The fastest config of `regime` at M (`block` fixed, or any) that `descend` finds from the config
        the untuned path runs; (None, inf) when every candidate failed or none is left after pruning."""
        cands = self.cands(regime, m, block)
        if not cands:
            return None, math.inf
        if block is None:  # the architecture's default block where it is a candidate
            blocks = [(c.block_n, c.block_k) for c in cands]
            default = choose_block(self.tile, self.s.arch)
            block = default if default in blocks else blocks[0]
        return descend(self.start(regime, m, block), cands, lambda c: self.time(c, m),
                       prepare=lambda cfgs: self.compile(cfgs, m))

    def start(self, regime: str, m: int, block: tuple[int, int]) -> KernelConfig:
        """The config the untuned path runs for `regime` at M with `block`: where a search starts."""
        packed, _, _ = self.packed(block)
        group_m = candidate_space(self.s.arch).group_m  # the candidates' own: the start is one of them
        return resolve_config(KernelConfig(kernel=regime, group_m=group_m), packed, m, self.s.arch)

    def compile(self, cfgs: list[KernelConfig], m: int) -> None:
        """Compile the configs not yet timed at M in parallel threads (`compile_parallel`), so that timing
        them one by one next finds them built; nothing without `Setup.compile_threads`."""
        todo = [c for c in dict.fromkeys(cfgs) if (c, m) not in self._ms]
        if self.s.compile_threads < 2 or len(todo) < 2 or self.s.over():
            return
        x = self.x(m)
        warmers = []
        for c in todo:
            _, bufs, per_row = self.packed((c.block_n, c.block_k))
            warmers.append(functools.partial(warm, x, bufs, None, self.shape, (c.block_n, c.block_k), per_row, c))
        compile_parallel(warmers, self.s.compile_threads)

    def cands(self, regime: str, m: int, block: tuple[int, int] | None = None) -> list[KernelConfig]:
        return candidates(regime, self.shape, self.tile, m, self.s.dtype, self.s.arch, block, self.s.smem_limit)

    def key(self, regime: str, m: int, block: tuple[int, int] | str) -> str:
        extra = f"{self.s.arch}/space{SPACE_VERSION}"
        return cache_key(self.s.device_name, self.shape, plan_hash(self.layer.kinds, self.tile, block),
                         self.s.dtype, regime, m, extra)


def setup(batch_size: int, prefill_len: int, dtype: torch.dtype, device: Any, cache: Any,
           time_fn: TimeFn | None, arch: str | None) -> Setup:
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
    threads = compile_threads() if dev.type == "cuda" else 0  # CPU runs the reference: nothing compiles
    return Setup(batch_size, prefill_len, dtype, dev, arch or arch_of(dev), name, time_fn or do_bench,
                  resolve_cache(cache), smem, threads)


def compile_ahead(mods: list[Any], ms: list[int]) -> None:
    """On a GPU, compile every kernel the modules (`TileLinear`, `TileGroupedLinear`: anything with packed
    `values` and `warmers(ms)`) launch for these M in parallel threads first (`compile_parallel`): a model's
    layers need a few dozen distinct kernels, ~1 s of Triton compile each, that one-by-one first calls
    would compile in turn. Nothing on CPU.

    Example:
        >>> compile_ahead([mod], [1, 16, 2048])   # doctest: +SKIP
    """
    compile_ahead_each([(mod, ms) for mod in mods])


def compile_ahead_each(jobs: list[tuple[Any, list[int]]]) -> None:
    """`compile_ahead` with each module's own M: (module, ms) pairs (fused experts see M x top_k rows)."""
    if not any(mod.values.is_cuda for mod, _ in jobs):
        return
    compile_parallel([w for mod, ms in jobs for w in mod.warmers(ms)], compile_threads())


def compile_threads() -> int:
    """Threads compiling tuner candidates: $PATCHC_COMPILE_THREADS (1: one at a time), else the CPUs this
    process may use, at most 16.

    Example:
        >>> os.environ["PATCHC_COMPILE_THREADS"] = "4"; compile_threads()   # doctest: +SKIP
        4
    """
    env = os.environ.get(COMPILE_THREADS_ENV)
    if env is not None:
        if not env.strip().isdigit() or int(env) < 1:
            raise ValueError(f"{COMPILE_THREADS_ENV} must be a positive integer (1: compile one config at a "
                             f"time), got {env!r}")
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(16, cpus)
