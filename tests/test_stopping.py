"""SIGTERM and Ctrl-C during training stop after the step under way, with its checkpoint written, and the run
goes on from there exactly (`patchc/utils/stopping.py`); outside a training loop they stop at once."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import patchc
from patchc.job import runs
from patchc.utils.stopping import exit_on_signals, stop_requested, stoppable
from tests.conftest import needs_shared
from tests.test_recover import TILE, distill_batches, hybrid_masks, mse
from tests.test_runs import QUICK
from tests.test_training import _batches, _loss, _setup


def _signal_at(step: int, signum: int, batches):
    """batches, sending `signum` to this process when batch `step` is fetched (mid-step, as a signal comes)."""
    def get(t: int):
        if t == step:
            os.kill(os.getpid(), signum)
        return batches(t) if callable(batches) else batches[t % len(batches)]
    return get


def test_a_signal_stops_a_loop_between_steps_and_ends_anything_else_at_once():
    with exit_on_signals():
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)  # no loop under way: at once
        assert stopped.value.code == 128 + signal.SIGTERM
        with stoppable() as handled:
            assert handled
            os.kill(os.getpid(), signal.SIGINT)
            assert stop_requested() == signal.SIGINT  # noted for the loop, nothing raised
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)  # a second one: at once
    assert stop_requested() is None and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with exit_on_signals(), pytest.raises(SystemExit):
        with stoppable():
            os.kill(os.getpid(), signal.SIGTERM)  # a loop that ends without acting on it: stopped as it leaves
        pytest.fail("the request was lost")
    with stoppable() as handled:
        assert not handled  # a library caller without the handlers: loops run as ever


@pytest.mark.parametrize("signum, raised", [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)])
def test_mask_training_stops_after_the_step_with_a_checkpoint_and_resumes_exactly(tiny_mlp, tmp_path, signum, raised,
                                                                                 capsys):
    straight = _setup(tiny_mlp, steps=30)
    patchc.train_masks(straight, _batches, _loss, steps=30, lr=1e-2, progress=False)
    ckpt = tmp_path / "masks.ckpt"
    with exit_on_signals(), pytest.raises(raised):
        patchc.train_masks(_setup(tiny_mlp, steps=30), _signal_at(12, signum, _batches), _loss, steps=30, lr=1e-2,
                           checkpoint=ckpt, checkpoint_every=50, progress=False)
    assert "stopping after this step" in capsys.readouterr().err
    assert torch.load(ckpt, weights_only=True)["step"] == 13  # step 12 (0-based) finished, none after it
    resumed = _setup(tiny_mlp, steps=30)
    patchc.train_masks(resumed, _batches, _loss, steps=30, lr=1e-2, checkpoint=ckpt, resume=True, progress=False)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_recovery_stops_after_the_step_with_a_checkpoint_and_resumes_exactly(tiny_mlp, tmp_path):
    from patchc.ir import TilePlan

    dense = copy.deepcopy(tiny_mlp)
    plan = TilePlan.from_masks(tiny_mlp, hybrid_masks(tiny_mlp), tile=TILE)
    batches = distill_batches(dense)
    straight = copy.deepcopy(dense)
    patchc.recover(plan, straight, batches, mse, steps=20, lr=3e-3, progress=False)
    ckpt, model = tmp_path / "recover.ckpt", copy.deepcopy(dense)
    with exit_on_signals(), pytest.raises(SystemExit):
        patchc.recover(plan, model, _signal_at(9, signal.SIGTERM, batches), mse, steps=20, lr=3e-3, progress=False,
                       checkpoint=ckpt)
    assert torch.load(ckpt, weights_only=True)["step"] == 10
    model = copy.deepcopy(dense)
    patchc.recover(plan, model, batches, mse, steps=20, lr=3e-3, progress=False, checkpoint=ckpt, resume=True)
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in straight.named_parameters())


@needs_shared
def test_sigterm_during_a_prunes_training_saves_its_step_and_releases_the_run(tmp_path):
    """The job: the first checkpoint (step 50) exists, SIGTERM comes: the run exits 143 with a checkpoint of a
    later step than the last one due, and no claim left (a claim left behind would stop `--resume` on another
    machine, which cannot check the process that holds it)."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-m", "patchc", "prune", "--out", str(out), *QUICK[:-1], "--steps",
                             "3000", "--eval-data"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / runs.CHECKPOINT).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"no checkpoint was written: {proc.communicate()[1][-2000:]}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert "stopping after this step" in proc.stderr.read()
    assert torch.load(out / runs.CHECKPOINT, weights_only=True)["step"] > 50  # not the one saved at step 50
    assert not (out / runs.CLAIM).exists()


@pytest.mark.parametrize("rank, notices", [("0", 1), ("1", 0)])
def test_under_torchrun_only_rank_0_prints_the_stop_notice(monkeypatch, capsys, rank, notices):
    monkeypatch.setenv("RANK", rank)  # torchrun forwards one SIGTERM to every rank
    with exit_on_signals(), pytest.raises(SystemExit):
        with stoppable():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop_requested() == signal.SIGTERM  # every rank still stops after the step
    assert capsys.readouterr().err.count("stopping after this step") == notices
