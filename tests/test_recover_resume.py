"""Weight recovery's checkpoint (`patchc/masking/recover_checkpoint.py`): a recovery that dies goes on from
its last save to the weights a straight one ends with, bit for bit, and a checkpoint of another recovery
or a damaged one is never resumed from (a warning names why, and recovery starts over)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import patchc
from patchc.ir import TilePlan
from patchc.job import stages
from patchc.job.cli import main
from patchc.job.recover import run_recover
from patchc.job.runs import RECOVER_CHECKPOINT, RECOVERED_PLAN
from tests.conftest import needs_shared
from tests.test_recover import TILE, distill_batches, hybrid_masks, mse, real_run_folder


@pytest.fixture
def setup(tiny_mlp):
    dense = copy.deepcopy(tiny_mlp)
    plan = TilePlan.from_masks(tiny_mlp, hybrid_masks(tiny_mlp), tile=TILE)
    return plan, dense, distill_batches(dense)


class Dies(RuntimeError):
    pass


def batches_that_die(batches, at: int | None):
    """Batch `step`, raising at step `at` (scoring reads steps 0..3 only, so only training reaches it)."""
    def get(step: int):
        if step == at:
            raise Dies(f"died at step {step}")
        return batches[step % len(batches)]
    return get


def run(plan, dense, batches, tmp_path, at=None, lr=3e-3, **kw):
    model = copy.deepcopy(dense)
    rec = patchc.recover(plan, model, batches_that_die(batches, at), mse, steps=20, lr=lr, progress=False,
                         checkpoint=tmp_path / "recover.ckpt", **{"checkpoint_every": 5, **kw})
    return rec, model


def test_a_recovery_that_dies_goes_on_to_the_straight_runs_weights(setup, tmp_path):
    plan, dense, batches = setup
    straight, straight_model = run(plan, dense, batches, tmp_path / "straight")
    with pytest.raises(Dies):
        run(plan, dense, batches, tmp_path, at=13)
    saved = torch.load(tmp_path / "recover.ckpt", weights_only=True)["step"]
    # the first save at 5; the next after 10 or later, as saving's cost spaces them: at 13 at the latest (the 13
    # steps done before step 13's batch raised; it was 13 where steps ran fast beside the save)
    assert 5 <= saved <= 13
    seen = []
    get = batches_that_die(batches, None)
    model = copy.deepcopy(dense)
    resumed = patchc.recover(plan, model, lambda t: seen.append(t) or get(t), mse, steps=20, lr=3e-3,
                             progress=False, checkpoint=tmp_path / "recover.ckpt", checkpoint_every=5, resume=True)
    assert [t for t in seen if t >= 4] == list(range(saved, 20)), "it trains only the steps after the save"
    for name, p in straight_model.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), f"{name} differs from the straight run's"
    for fqn, layer in straight.layers.items():
        other = resumed.layers[fqn]
        assert torch.equal(layer.values, other.values) and torch.equal(layer.dense, other.dense), fqn
    assert resumed.meta["recovery"]["history"] == straight.meta["recovery"]["history"]
    assert torch.load(tmp_path / "recover.ckpt", weights_only=True)["step"] == 20  # saved at the end too


def test_another_recoverys_or_a_damaged_checkpoint_is_not_resumed(setup, tmp_path):
    plan, dense, batches = setup
    with pytest.raises(Dies):
        run(plan, dense, batches, tmp_path, at=7)
    fresh, fresh_model = run(plan, dense, batches, tmp_path / "fresh", lr=1e-3)
    with pytest.warns(UserWarning, match=r"another recovery: lr 0.003 \(now 0.001\).*from the first step"):
        other, model = run(plan, dense, batches, tmp_path, lr=1e-3, resume=True)
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in fresh_model.named_parameters())

    with pytest.raises(Dies):
        run(plan, dense, batches, tmp_path, at=7, checkpoint_tag={"loss": "kd"})
    with pytest.warns(UserWarning, match=r"another recovery: loss 'kd' \(now 'lm'\)"):
        run(plan, dense, batches, tmp_path, resume=True, checkpoint_tag={"loss": "lm"})

    with pytest.raises(Dies):
        run(plan, dense, batches, tmp_path, at=7)
    masks = hybrid_masks(dense, every=2)
    other_plan = TilePlan.from_masks(copy.deepcopy(dense), masks, tile=TILE)
    with pytest.warns(UserWarning, match="another plan"):
        run(other_plan, dense, batches, tmp_path, resume=True)

    (tmp_path / "recover.ckpt").write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match="not a readable recovery checkpoint"):
        damaged, model = run(plan, dense, batches, tmp_path, lr=1e-3, resume=True)
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in fresh_model.named_parameters())


def test_checkpoint_settings_are_checked(setup, tmp_path):
    plan, dense, batches = setup
    with pytest.raises(ValueError, match="only method='adam' checkpoints"):
        patchc.recover(plan, copy.deepcopy(dense), method="sparsegpt", calib={}, checkpoint=tmp_path / "c")
    with pytest.raises(ValueError, match="checkpoint_every=-1 must be >= 0"):
        run(plan, dense, batches, tmp_path, checkpoint_every=-1)


@needs_shared
def test_patchc_recover_that_dies_resumes_only_with_resume(tmp_path, monkeypatch, capsys):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    real_run_folder(straight), real_run_folder(crashed)
    monkeypatch.setattr(patchc, "recover", functools.partial(patchc.recover, checkpoint_every=5))
    args = dict(steps=12, lr=1e-3, batch_size=2, progress=False)
    run_recover(straight, **args)
    assert not (straight / RECOVER_CHECKPOINT).exists()  # removed once the recovery's files are written
    capsys.readouterr()
    run_recover(straight, **args, resume=True, overwrite=True)  # nothing to go on from: said, and done whole
    assert "no recover.ckpt to go on from; recovering from the first step" in capsys.readouterr().out

    real_batches = stages.recovery_batches
    trained: list[int] = []

    def dies_at(step: int | None):
        def batches(*a, **kw):
            get = real_batches(*a, **kw)
            def at(t: int):
                if t == step:
                    raise Dies(f"died at step {t}")
                trained.append(t)
                return get(t)
            return at
        return batches

    monkeypatch.setattr(stages, "recovery_batches", dies_at(7))
    with pytest.raises(Dies):
        run_recover(crashed, **args)
    assert (crashed / RECOVER_CHECKPOINT).exists() and not (crashed / RECOVERED_PLAN).exists()
    with pytest.raises(FileExistsError, match="unfinished recovery left recover.ckpt; pass --resume"):
        run_recover(crashed, **args)

    monkeypatch.setattr(stages, "recovery_batches", dies_at(None))
    trained.clear()
    assert main(["recover", str(crashed), "--steps", "12", "--lr", "1e-3", "--batch-size", "2", "--no-progress",
                 "--resume"]) == 0
    assert [t for t in trained if t >= 4] == list(range(5, 12)), "only the steps after the last save"
    assert not (crashed / RECOVER_CHECKPOINT).exists()
    want, got = TilePlan.load(straight / RECOVERED_PLAN), TilePlan.load(crashed / RECOVERED_PLAN)
    for fqn, layer in want.layers.items():
        for part, t in layer.tensors().items():
            assert torch.equal(t, got.layers[fqn].tensors()[part]), (fqn, part)

    # an --overwrite recovery over this finished one dies: --resume alone goes on (it was told "--overwrite",
    # which starts again), and a kill while the results are written never pairs a record with another plan
    monkeypatch.setattr(stages, "recovery_batches", dies_at(7))
    with pytest.raises(Dies):
        run_recover(crashed, **args, overwrite=True)
    with pytest.raises(FileExistsError, match=r"pass --overwrite to replace it \(or --resume to go on from the "
                                              r"unfinished one's recover.ckpt\)"):
        run_recover(crashed, **args)
    monkeypatch.setattr(stages, "recovery_batches", dies_at(None))
    monkeypatch.setattr(TilePlan, "save", lambda self, path: (_ for _ in ()).throw(Dies("killed while saving")))
    with pytest.raises(Dies):
        run_recover(crashed, **args, resume=True)
    assert not (crashed / "recover.json").exists()  # the old record went first; the old plan stays unpaired
