"""Learned hybrid masks on the real stories260K model and real TinyStories text, with the main job's
own stages at fast settings (CPU, ~2 min). Fuller settings: benchmarks/quality_table.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from patchc.job.options import PruneOptions
from patchc.job.model import choose_threads, with_tile
from patchc.job.corpus import load_data
from patchc.job.stages import calibrate, evaluate, oneshot_baseline, train
from tests.conftest import needs_shared

pytestmark = [needs_shared, pytest.mark.slow]


@pytest.fixture(scope="module")
def job():
    from patchc.models import load_model

    threads = torch.get_num_threads()
    # The job's defaults (joint, 16x16, 35%, SparseGPT prior, real + generated text, LM + KD) at a third of the mask
    # steps (the suite's time), without the second evaluation text, which this test does not score.
    opts = PruneOptions(steps=100, eval_data=(), progress=False)
    bundle = load_model(opts.model)
    choose_threads(opts, bundle.model)
    opts = with_tile(opts, bundle)
    data = load_data(bundle, opts)
    calib = calibrate(bundle, data, opts)
    yield opts, bundle, data, calib
    torch.set_num_threads(threads)


def _learned(job, **changes):
    opts, bundle, data, calib = job
    opts = dataclasses.replace(opts, **changes)
    plan, _ = train(bundle, opts.patch_config(), data, opts, calib, None, False)
    return plan, evaluate(bundle, plan.apply(bundle.reload()), data, opts)["perplexity"]


def _oneshot(job, method):
    opts, bundle, data, calib = job
    return evaluate(bundle, oneshot_baseline(bundle, method, calib), data, opts)["perplexity"]


def test_patch_35_beats_one_shot_24(job):
    # Global against layer-wise budgets is not asserted: they were within seed noise (seed 0, tile lr 1e-3:
    # 8.60 global, 8.58 layer-wise), so one run cannot order them.
    opts, bundle, data, _ = job
    plan, ppl_global = _learned(job, exact_budget=False)  # the paper's sign rule
    ppl_dense = evaluate(bundle, bundle.model, data, opts)["perplexity"]
    ppl_sparsegpt, ppl_magnitude = _oneshot(job, "sparsegpt"), _oneshot(job, "magnitude")
    print(f"dense {ppl_dense:.2f}  PATCH 35% global {ppl_global:.2f} (density {plan.density:.4f})  "
          f"SparseGPT 2:4 {ppl_sparsegpt:.2f}  magnitude 2:4 {ppl_magnitude:.2f}")
    assert abs(plan.density - 0.65) <= 0.02
    # held out: 1.65x dense here (1.62x at 150 steps), 1.51x at the job's 300 (3 seeds)
    assert ppl_dense < ppl_global < 2.0 * ppl_dense
    assert ppl_global < 0.5 * ppl_sparsegpt < ppl_magnitude
