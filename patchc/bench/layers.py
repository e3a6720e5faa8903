"""Building blocks shared by the bench parts: random layer plans, inputs, timers and the device's roofline.

Example:
    >>> layer = make_layer(LayerCase((128, 160), 0.35, (32, 32), "fp16", (1,)), seed=0)
    >>> layer.shape, round(1 - layer.density, 2)
    ((128, 160), 0.35)
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch

from patchc.bench.options import LayerCase
from patchc.utils.progress import progress

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# HBM bandwidth (bytes/s) of the parts we meet, by a substring of torch.cuda.get_device_name
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
)


def peak_bandwidth(device_name: str) -> float | None:
    """Bytes/s of the device's memory from a table of known parts; None when unknown (CPU, other GPUs).

    Example:
        >>> peak_bandwidth("NVIDIA H100 80GB HBM3")
        3350000000000.0
    """
    for key, bw in PEAK_BANDWIDTH:
        if key in device_name:
            return bw
    return None


def tile_kinds(n: int, k: int, tile: tuple[int, int], kinds: str | float, gen: torch.Generator) -> torch.Tensor:
    """(Tn, Tk) tile kinds: all 0 ("dense"), all 1 ("2:4"), or exactly round(2s * tiles) 2:4 tiles placed at
    random for an overall sparsity s (a 2:4 tile holds half its weights)."""
    tn, tk = math.ceil(n / tile[0]), math.ceil(k / tile[1])
    if kinds == "dense":
        return torch.zeros(tn, tk, dtype=torch.uint8)
    if kinds == "2:4":
        return torch.ones(tn, tk, dtype=torch.uint8)
    if not isinstance(kinds, float) or not 0.0 < kinds <= 0.5:
        raise ValueError(f"plan kinds must be 'dense', '2:4' or a sparsity in (0, 0.5], got {kinds!r}")
    out = torch.zeros(tn * tk, dtype=torch.uint8)
    out[torch.randperm(tn * tk, generator=gen)[: round(2 * kinds * tn * tk)]] = 1
    return out.view(tn, tk)


def make_layer(case: LayerCase, seed: int, name: str = "bench.weight", bias: bool = False) -> Any:
    """A LayerPlan of the case with random weights (std 1) and random 2:4 patterns."""
    from patchc.codegen.reference import random_layer_plan

    n, k = case.shape
    gen = torch.Generator().manual_seed(seed)
    kinds = tile_kinds(n, k, case.tile, case.kinds, gen)
    return random_layer_plan(n, k, tile=case.tile, kinds=kinds, dtype=DTYPES[case.dtype], bias=bias, seed=seed,
                             name=name)


def make_input(m: int, k: int, dtype: torch.dtype, device: Any, seed: int) -> torch.Tensor:
    """(m, k) activations scaled by 1/sqrt(K), so outputs of std-1 weights are O(1) for every K."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) / k**0.5).to(device=device, dtype=dtype)


def weight_bytes(layer: Any, elem_bytes: int) -> tuple[int, int]:
    """(hybrid, dense) bytes of weights one pass reads: a 2:4 tile costs half its values + 1/8 metadata."""
    n, k = layer.shape
    kinds = layer.kinds.to(torch.int64)
    b1, b2 = layer.tile
    sparse_elems = min(int(kinds.sum()) * b1 * b2, n * k)
    dense_elems = n * k - sparse_elems
    return int(dense_elems * elem_bytes + sparse_elems * (elem_bytes / 2 + 0.125)), n * k * elem_bytes


def gpu_timer(cuda_graph: bool = True) -> Callable[[Callable[[], Any]], float]:
    """ms of fn: `triton.testing.do_bench_cudagraph` (no launch overhead: decode kernels take microseconds)
    or `do_bench`; the function runs once first, so compilation and tuning never happen under capture."""
    import triton.testing

    def timer(fn: Callable[[], Any]) -> float:
        fn()
        torch.cuda.synchronize()
        if cuda_graph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=20))
        return float(triton.testing.do_bench(fn, warmup=10, rep=40))

    return timer


def cold_copies(nbytes: int, device: str) -> int:
    """Copies of a layer whose `nbytes` of weights, called in turn, hold twice the device's L2 (1 off CUDA):
    a CUDA graph replaying one small layer would find its weights in L2 and time L2, not HBM.

    Example:
        >>> cold_copies(18 << 20, "cpu")
        1
    """
    if torch.device(device).type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(torch.device(device)), "L2_cache_size", 0) or 50 << 20
    return max(1, math.ceil(2 * l2 / max(1, nbytes)))


def in_turn(fns: list[Callable[[], Any]]) -> Callable[[], None]:
    """One call that calls each of `fns` once, in order (timing copies of a layer: `cold_copies`)."""

    def run() -> None:
        for fn in fns:
            fn()

    return run


def cpu_timer(reps: int = 3, warmup: int = 1) -> Callable[[Callable[[], Any]], float]:
    """ms of fn on CPU: the median of `reps` calls after `warmup` (dry runs: the numbers mean nothing)."""

    def timer(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return timer


def summarise(rows: list[dict[str, Any]]) -> str:
    """One case's rows in a few words: speedups by M or tokens (speed, experts) or checks failed (check)."""
    if rows and "speedup" in rows[0]:
        return ", ".join(f"{'M' if 'M' in r else 'tokens'}={r.get('M', r.get('tokens'))} {r['speedup']:.2f}x"
                         for r in rows)
    return f"{len(rows)} checks, {sum(not r['ok'] for r in rows)} failed"


class Deadline:
    """A part's share of the time budget: `left()` seconds, `over()` once spent.

    Example:
        >>> Deadline(60).over()
        False
    """

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0


def run_cases(cases: list[LayerCase], run_one: Callable[[LayerCase], list[dict[str, Any]]], deadline: Deadline,
              desc: str, show: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows of every case run before the deadline, labels of the cases left without time)."""
    rows: list[dict[str, Any]] = []
    skipped = []
    for case in progress(cases, desc=desc, unit="layer", disable=not show):
        if deadline.over():
            skipped.append(case.label)
            continue
        t0 = time.monotonic()
        mine = run_one(case)
        rows += mine
        if not show:  # no bar: a line per case, so a log of a run cut short still says what it found
            print(f"{desc}: {case.label}: {summarise(mine)} ({time.monotonic() - t0:.1f} s)", flush=True)
    return rows, skipped
