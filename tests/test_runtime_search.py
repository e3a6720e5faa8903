"""The tuner's coordinate descent (`patchc.runtime.search`): few timings, the optimum of a separable cost,
never slower than the default, and a fallback when the default's region fails to compile."""

from __future__ import annotations

import dataclasses
import math

import torch

from patchc.codegen.configs import KernelConfig, resolve_config
from patchc.codegen.layout import pack
from patchc.codegen.reference import random_layer_plan
from patchc.runtime.candidates import candidate_space, candidates
from patchc.runtime.search import descend, neighbours

SHAPE, TILE = (4096, 4096), (128, 128)


def space(m: int, regime: str = "decode") -> list[KernelConfig]:
    return candidates(regime, SHAPE, TILE, m, torch.float16, "sm_90")


def start_of(m: int, regime: str = "decode") -> KernelConfig:
    layer = random_layer_plan(256, 256, tile=TILE, kinds=0.5, seed=0)  # only the block and row counts matter
    packed = pack(layer, block=(128, 64))
    cfg = resolve_config(KernelConfig(kernel=regime, group_m=candidate_space("sm_90").group_m), packed, m, "sm_90")
    return cfg


class Counting:
    """A separable cost with its optimum far from the default; counts distinct configs timed."""

    def __init__(self, fail=lambda c: False) -> None:
        self.seen: dict[KernelConfig, float] = {}
        self.fail = fail

    def __call__(self, c: KernelConfig) -> float:
        if c not in self.seen:
            self.seen[c] = math.inf if self.fail(c) else (
                abs(c.split_k - 4) + 0.5 * ((c.block_n, c.block_k) != (64, 128)) + 0.2 * (c.num_warps != 8)
                + 0.1 * (c.num_stages != 1) + 0.05 * (c.block_m != 16))
        return self.seen[c]


def test_descent_finds_the_separable_optimum_with_a_fraction_of_the_timings():
    cands = space(1)
    assert len(cands) > 300  # what exhaustive tuning compiled and timed per layer and M
    cost = Counting()
    cfg, ms = descend(start_of(1), cands, cost)
    assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.block_m) == (64, 128, 4, 8, 1, 16)
    assert ms == 0.0 and cfg in cands
    assert len(cost.seen) <= 40, len(cost.seen)


def test_descent_is_never_slower_than_the_start():
    cands, start = space(16), start_of(16)
    flat = Counting()
    flat.seen = {c: 1.0 for c in cands}  # every candidate as fast as the start: nothing to gain, stay
    flat.seen[start] = 1.0
    assert descend(start, cands, flat) == (start, 1.0)


def test_a_failing_default_region_falls_back_to_the_rest():
    cands, start = space(16), start_of(16)
    # everything at the start's block fails: descent cannot move along any other axis from there
    cost = Counting(fail=lambda c: (c.block_n, c.block_k) != (32, 64) or c.split_k != 1)
    cfg, ms = descend(start, cands, cost)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (32, 64, 1) and math.isfinite(ms)
    assert descend(start, cands, Counting(fail=lambda c: True)) == (None, math.inf)


def test_neighbours_differ_in_one_axis_only():
    cands, start = space(16), start_of(16)
    for axis in (("split_k",), ("block_n", "block_k")):
        near = neighbours(start, cands, axis)
        assert near and all(c != start for c in near)
        for c in near:
            same = [f for f in KernelConfig.__dataclass_fields__ if f not in axis]
            assert all(getattr(c, f) == getattr(start, f) for f in same)


def test_the_tuner_compiles_each_axis_before_timing_it(monkeypatch):
    """With compile threads (a CUDA device), every config is handed to the parallel compile before it is
    timed, and a config already timed is not compiled again."""
    import patchc.runtime.timing as timing
    from patchc.codegen.reference import random_tile_plan
    from patchc.runtime.tuner import tune_plan

    compiled: list[tuple[KernelConfig, int]] = []  # (config, M): warm(x, ..., cfg)
    monkeypatch.setattr(timing, "compile_parallel",
                        lambda warmers, threads: compiled.extend((w.args[-1], w.args[0].shape[0]) for w in warmers))
    real_setup = timing.setup
    monkeypatch.setattr("patchc.runtime.tuner.setup", lambda *a: dataclasses.replace(real_setup(*a), compile_threads=4))
    timed: list[tuple[KernelConfig, int]] = []

    def time_fn(fn):
        cfg, m = fn.args[-1], fn.args[0].shape[0]
        first_of_search = (cfg.kernel, m) not in {(c.kernel, mm) for c, mm in timed}  # each search's start
        assert (cfg, m) in compiled or first_of_search, f"{cfg} at M={m} timed before it was compiled"
        timed.append((cfg, m))
        return 1.0 + abs(cfg.split_k - 2)

    plan = random_tile_plan({"a.weight": dict(n=256, k=2048, tile=(64, 64), kinds="mixed")})
    tune_plan(plan, 16, 32, torch.float16, "cpu", False, False, time_fn=time_fn, arch="sm_90")
    assert len(timed) > 10 and len(compiled) == len(set(compiled))


def test_compile_parallel_runs_every_warmer_and_survives_failures():
    from patchc.runtime.timing import compile_parallel

    ran = []

    def broken():
        raise RuntimeError("out of resources")

    compile_parallel([lambda: ran.append(1), broken, lambda: ran.append(2)], threads=2)
    assert sorted(ran) == [1, 2]


def test_compile_parallel_warns_when_no_warm_up_works(caplog):
    from patchc.runtime.timing import compile_parallel

    def broken():
        raise TypeError("warmup() got an unexpected keyword argument")

    with caplog.at_level("WARNING", logger="patchc.runtime.timing"):
        compile_parallel([broken, broken], threads=2)
    assert "no config could be compiled ahead (TypeError: warmup()" in caplog.text


def test_compile_threads_from_the_environment(monkeypatch):
    import pytest

    from patchc.runtime.timing import COMPILE_THREADS_ENV, compile_threads

    monkeypatch.setenv(COMPILE_THREADS_ENV, "3")
    assert compile_threads() == 3
    monkeypatch.setenv(COMPILE_THREADS_ENV, "zero")
    with pytest.raises(ValueError, match="PATCHC_COMPILE_THREADS must be a positive integer"):
        compile_threads()
    monkeypatch.delenv(COMPILE_THREADS_ENV)
    assert 1 <= compile_threads() <= 16
