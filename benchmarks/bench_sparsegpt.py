"""CPU cost of SparseGPT 2:4 on a 4096 x 4096 float32 layer (issue: well under a minute on 2 cores).

Run: python -m pytest benchmarks/bench_sparsegpt.py --benchmark-enable -q

The Hessian stands for 128 calibration samples x 2048 tokens. Accumulating it for real costs
128 x 2048 x 4096^2 multiply-adds, so the pruning benchmark builds an equivalent-looking H cheaply
(low rank + diagonal, with uneven channel scales like real activations), and the accumulation is
benchmarked separately on one 2048-token sample (the total is 128 times that).
"""

from __future__ import annotations

import pytest
import torch

from patchc.pruning.calibrate import InputStats
from patchc.pruning.sparsegpt import sparsegpt

N = K = 4096
SAMPLES, TOKENS = 128, 2048


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(K, generator=g) * 2 + 0.1  # outlier-ish channel scales
    x = torch.randn(1024, K, generator=g) * scale  # rank-1024 part
    h = (2.0 / x.shape[0]) * (x.T @ x)
    h.diagonal().add_(0.05 * scale.square())
    w = torch.randn(N, K, generator=g) * 0.02
    return w, h


def test_sparsegpt_24_4096(benchmark, problem):
    w, h = problem
    keep, new = benchmark.pedantic(lambda: sparsegpt(w, h, "2:4"), rounds=3, iterations=1, warmup_rounds=0)
    assert torch.all(keep.reshape(-1, 4).sum(1) == 2)
    assert torch.all(new[~keep] == 0)
    benchmark.extra_info["shape"] = [N, K]


def test_hessian_accumulation_one_sample(benchmark):
    """One 2048-token sample into InputStats (x^T x + channel norms); the 128-sample total is 128x."""
    x = torch.randn(TOKENS, K)
    stats = InputStats(K)
    benchmark.pedantic(lambda: stats.update(x), rounds=3, iterations=1, warmup_rounds=1)
    benchmark.extra_info["samples_for_total"] = SAMPLES
