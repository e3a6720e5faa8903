"""torchrun with 2 processes (gloo, CPU) learns the same masks as one process with the same global batch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patchc.tile_plan import TilePlan
from tests.conftest import needs_shared

pytestmark = [needs_shared, pytest.mark.slow]

ARGS = ["prune", "--steps", "8", "--batch-size", "4", "--no-baselines", "--prior", "magnitude", "--no-progress", "--threads", "1"]


def _run(launcher: list[str], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, "-m", "patchc", *ARGS, "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_two_processes_equal_one(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found beside the Python interpreter")
    _run([sys.executable], tmp_path / "one")
    _run([torchrun, "--standalone", "--nproc_per_node=2"], tmp_path / "two")
    one = torch.load(tmp_path / "one" / "masks.ckpt", weights_only=True)["program"]
    two = torch.load(tmp_path / "two" / "masks.ckpt", weights_only=True)["program"]
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-5, msg=key)
    plan_one, plan_two = TilePlan.load(tmp_path / "one" / "plan.patch"), TilePlan.load(tmp_path / "two" / "plan.patch")
    assert plan_one.density == plan_two.density
    for fqn in plan_one.layers:
        assert torch.equal(plan_one.layers[fqn].mask(), plan_two.layers[fqn].mask()), fqn
    # Rank 0 alone wrote the run's files.
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
