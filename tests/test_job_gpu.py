"""The job on a GPU: `patchc prune --device cuda` trains, hardens and scores as the same run does on the CPU
(the same seed draws the same noise on both; float rounding apart). Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from patchc.ir import TilePlan
from patchc.job.cli import main
from patchc.masking import fused
from tests.conftest import needs_shared

pytestmark = [needs_shared, pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUICK = ["--steps", "20", "--batch-size", "4", "--calib-blocks", "4", "--no-progress", "--self-tokens", "516",
         "--eval-tokens", "256", "--dtype", "float32"]


def test_prune_on_cuda_scores_like_the_same_run_on_the_cpu(tmp_path):
    reports, plans = {}, {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        assert main(["prune", "--device", device, "--out", str(out), "--recover", "5", *QUICK]) == 0
        reports[device] = {r["name"]: r["perplexity"] for r in json.loads((out / "report.json").read_text())["results"]}
        plans[device] = TilePlan.load(out / "plan.patch")
    assert reports["cpu"].keys() == reports["cuda"].keys()
    for name, ppl in reports["cpu"].items():
        assert reports["cuda"][name] == pytest.approx(ppl, rel=0.05), name
    tiles = sum(lp.kinds.numel() for lp in plans["cpu"].layers.values())
    flipped = sum(int((plans["cpu"].layers[n].kinds != lp.kinds).sum()) for n, lp in plans["cuda"].layers.items())
    assert flipped <= 0.05 * tiles, f"{flipped} of {tiles} tiles chose another kind on CUDA"
    plans["cuda"].verify()


def test_a_seed_draws_the_same_noise_on_cuda_as_on_the_cpu():
    length = fused.bank_length(5000)
    on_gpu = fused.gumbel_bank(7, length, "cuda")
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), fused.gumbel_bank(7, length, "cpu"))


def test_what_mask_training_leaves_off_the_gpu():
    """Calibration's Hessians and the prior's 2:4 masks are kept for the baselines after training: on the host."""
    from patchc.job.corpus import load_data
    from patchc.job.model import load_bundle
    from patchc.job.options import PruneOptions
    from patchc.job.prune import cache_dir
    from patchc.job.stages import calibrate, oneshot_masks

    opts = PruneOptions(device="cuda", calib_blocks=4, train_data="real", eval_data=(), progress=False)
    bundle = load_bundle(opts)
    calib = calibrate(bundle, load_data(bundle, opts, cache_dir=cache_dir(opts)), opts)
    assert all(calib[f]._xtx.device.type == "cpu" and calib[f]._sq.device.type == "cpu" for f in calib)
    masks = oneshot_masks(bundle, "sparsegpt", calib)
    assert masks and all(m.device.type == "cpu" and m.dtype == torch.bool for m in masks.values())
