"""Speed part of `patchc bench`: the runtime's layer against cuBLAS dense (and cuSPARSELt) in the same run.

Per layer case and M: `TileLinear` (tuned on the GPU when `tune`, else the architecture defaults) is
timed against `F.linear` on the dense weight, and for all-2:4 layers against
`torch.sparse.to_sparse_semi_structured` (cuSPARSELt / CUTLASS). On a GPU the timer is
`triton.testing.do_bench_cudagraph`, so microsecond decode kernels are not drowned in launch overhead.
A graph replaying one layer would find a small layer's weights in L2 (an H100's 50 MB holds a 4096 x 4096
fp16 layer) and time L2, not HBM; so each timing calls copies of the layer in turn, enough to hold twice
the L2 (`cold_copies`), and divides by their number, for patchc, cuBLAS and cuSPARSELt alike. A decode row
whose kernel splits K is timed again with the splits added up the other way (`other_reduce_ms`: in the
kernel or by a second launch, `KernelConfig.reduce`), so one run says which is faster even untuned.

With `tune`, every case is timed first with the architecture's default configs (at most
`UNTUNED_SHARE` of the part's time: a few compiles per case), then tuned, until the deadline: a run cut
short (tuning one shape compiles and times ~100 configs) still has a number for every case, and the tuned
rows show what tuning adds. The tuned pass reuses the first pass's dense and cuSPARSELt timings.

What the numbers mean: at decode (M <= 16) a layer is bound by its weight bytes, so the best possible
speedup is dense bytes / hybrid bytes (`ceiling`: 1.31x at 35% sparsity, 1.49x at 45%, 1.78x all-2:4 for
fp16); `of_ceiling` is the share of it reached. `GBps` counts weight + x + y bytes over the time and
`of_peak` compares it with the device's HBM bandwidth.

Example:
    >>> rows = time_case(LayerCase((96, 160), "2:4", (32, 32), "fp16", (1,)), "cpu", cpu_timer(), False, 0)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from patchc.bench.layers import (DTYPES, Deadline, cold_copies, in_turn, make_input, make_layer, run_cases,
                                 weight_bytes)
from patchc.bench.options import LayerCase

DECODE_MAX_M = 16  # M at or below this is weight-bandwidth bound: the ceiling applies
UNTUNED_SHARE = 0.4  # of the part's time, at most, for the pass with default configs when tuning follows


def runtime_layer(layer: Any, dtype: torch.dtype, device: str, tune: bool, time_limit: float | None = None) -> Any:
    """The layer as users run it: a TileLinear, tuned for batch 16 / prefill 128 when `tune` (for at most
    `time_limit` seconds: then its `tuning.source` is "partial", or the default configs serve it)."""
    from patchc.runtime import TileLinear, tune_plan
    from patchc.ir import TilePlan

    tuning = None
    if tune:
        plan = TilePlan(layers={layer.name: layer}, skipped={}, meta={})
        tuning = tune_plan(plan, 16, 128, dtype, device, progress=False, time_limit=time_limit)[layer.name]
    return TileLinear.from_plan(layer, tuning, dtype=dtype, device=device, batch_size=16, prefill_len=128)


def flip_reduce(mod: Any) -> Any:
    """`mod` (its buffers shared) with its decode configs adding split-K's partial sums the other way."""
    from dataclasses import replace

    def flip(cfg: Any) -> Any:
        return replace(cfg, reduce="launch" if cfg.reduce == "fixup" else "fixup") if cfg.split_k > 1 else cfg

    t = mod.tuning
    return mod.retuned(replace(t, decode=flip(t.decode), buckets=tuple((m, flip(c)) for m, c in t.buckets)))


def semi_structured(w: torch.Tensor) -> torch.Tensor | None:
    """torch's 2:4 weight (cuSPARSELt / CUTLASS) where it exists: CUDA, fp16 / bf16; else None."""
    if not w.is_cuda or w.dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from torch.sparse import to_sparse_semi_structured

        return to_sparse_semi_structured(w)
    except Exception:  # unsupported shape / build without cuSPARSELt: that baseline is just absent
        return None


def time_case(case: LayerCase, device: str, timer: Callable[[Callable[[], Any]], float], tune: bool,
              seed: int, peak: float | None = None, baselines: dict[tuple[str, int], dict[str, Any]] | None = None,
              deadline: Deadline | None = None) -> list[dict[str, Any]]:
    """Rows of one speed case: one per M, all timings from this run. `baselines` memoises the dense and
    cuSPARSELt timings by (case, M): a second pass over the same cases times only patchc. Tuning stops at
    `deadline` (rows say "partial")."""
    from patchc.runtime import TileLinear
    from patchc.runtime.timing import compile_ahead

    dtype = DTYPES[case.dtype]
    layer = make_layer(case, seed)
    w = layer.to_dense().to(device=device, dtype=dtype)
    mod = runtime_layer(layer, dtype, device, tune, None if deadline is None else max(0.0, deadline.left()))
    source = mod.tuning.source if tune else "default"
    compile_ahead([mod], list(case.ms))  # every M's kernels in parallel threads (GPU only)
    elem = torch.empty((), dtype=dtype).element_size()
    hybrid_b, dense_b = weight_bytes(layer, elem)
    copies = cold_copies(hybrid_b, device)
    # rebuilt from the plan with the same tuning (torch's 2:4 weight, where it serves prefill, does not deepcopy)
    mods = [mod] + [TileLinear.from_plan(layer, mod.tuning, dtype=dtype, device=device) for _ in range(copies - 1)]
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    semis = [semi_structured(wi) for wi in ws] if case.kinds == "2:4" and not _timed(baselines, case) else None
    n, k = case.shape
    rows = []
    for m in case.ms:
        x = make_input(m, k, dtype, device, seed + m)
        io = (m * k + m * n) * elem
        row: dict[str, Any] = {"case": case.label, "shape": [n, k], "kinds": case.kinds, "M": m,
                               "dtype": case.dtype, "tuned": tune, "tuning": source, "route": mod.route(m),
                               "copies": copies}
        if row["route"] in ("decode", "prefill"):  # what our kernel ran with: split-K and how it adds up, ...
            cfg = mod.config(m)
            row["config"] = {f: getattr(cfg, f) for f in ("kernel", "block_m", "split_k", "reduce", "num_warps",
                                                          "num_stages")}
        base = baselines.get((case.label, m)) if baselines is not None else None
        if base is None:
            dense = in_turn([lambda wi=wi: F.linear(x, wi) for wi in ws])
            semi = in_turn([lambda si=si: F.linear(x, si) for si in semis]) if semis and None not in semis else None
            semi_ms = _time_or_none(timer, semi) if semi is not None else None
            base = {"dense_ms": timer(dense) / copies, "semi_ms": None if semi_ms is None else semi_ms / copies}
            if baselines is not None:
                baselines[(case.label, m)] = base
        row.update(base)
        row["tile_ms"] = timer(in_turn([lambda mi=mi: mi(x) for mi in mods])) / copies
        if row["route"] == "decode" and row["config"]["split_k"] > 1:
            other = [flip_reduce(mi) for mi in mods]
            row["other_reduce"] = other[0].config(m).reduce
            row["other_reduce_ms"] = timer(in_turn([lambda mi=mi: mi(x) for mi in other])) / copies
        row["speedup"] = row["dense_ms"] / row["tile_ms"]
        row["tile_GBps"] = (hybrid_b + io) / row["tile_ms"] / 1e6
        row["dense_GBps"] = (dense_b + io) / row["dense_ms"] / 1e6
        if m <= DECODE_MAX_M:
            row["ceiling"] = (dense_b + io) / (hybrid_b + io)
            row["of_ceiling"] = row["speedup"] / row["ceiling"]
        if peak:
            row["of_peak"] = row["tile_GBps"] * 1e9 / peak
        if row["semi_ms"]:
            row["vs_semi"] = row["semi_ms"] / row["tile_ms"]
        rows.append(row)
    return rows


def _time_or_none(timer: Callable[[Callable[[], Any]], float], fn: Callable[[], Any]) -> float | None:
    try:
        return timer(fn)
    except Exception:  # cuSPARSELt refuses some M / shapes: no number rather than a broken run
        return None


def _timed(baselines: dict[tuple[str, int], dict[str, Any]] | None, case: LayerCase) -> bool:
    """Whether every M of `case` has its baselines timed already (then cuSPARSELt's weight is not built)."""
    return baselines is not None and all((case.label, m) in baselines for m in case.ms)


def run_speed(cases: list[LayerCase], device: str, timer: Callable[[Callable[[], Any]], float], tune: bool,
              seed: int, deadline: Deadline, peak: float | None, show: bool = True) -> dict[str, Any]:
    """Every case until the deadline, with the default configs and then, with `tune`, tuned (module
    docstring); {"rows" (each with "tuned"), "skipped": labels without time, "(tuned)" for the second pass}."""
    baselines: dict[tuple[str, int], dict[str, Any]] = {}
    first = Deadline(UNTUNED_SHARE * deadline.left()) if tune else deadline
    rows, skipped = run_cases(cases, lambda case: time_case(case, device, timer, False, seed, peak, baselines), first,
                              "bench speed", show)
    if tune:
        tuned, not_tuned = run_cases(cases, lambda case: time_case(case, device, timer, True, seed, peak, baselines,
                                                                   deadline), deadline, "bench speed (tuned)", show)
        rows += tuned
        skipped += [f"{label} (tuned)" for label in not_tuned]
    return {"rows": rows, "skipped": skipped}
