"""Trainer, checkpoint / exact resume, hardening rules and the exact budget (CPU, tiny model)."""

from __future__ import annotations

import pytest
import torch

import patchc
from patchc.masking.harden import budget_tiles
from patchc.masking.optim import MaskOptimConfig


def _setup(tiny_mlp, **cfg):
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    config = patchc.PatchConfig(tile=(8, 8), steps=cfg.pop("steps", 20), **cfg)
    return patchc.transform(tiny_mlp, config, example_inputs=(ids,))


def _batches(step: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(step))


def _loss(prog, ids):
    return prog(ids).float().logsumexp(-1).mean()


def test_resume_equals_straight_run_exactly(tiny_mlp, tmp_path):
    straight = _setup(tiny_mlp, steps=100)
    patchc.train_masks(straight, _batches, _loss, steps=100, lr=1e-2, progress=False)

    ckpt = tmp_path / "masks.ckpt"
    first = _setup(tiny_mlp, steps=100)
    patchc.train_masks(first, _batches, _loss, steps=50, lr=1e-2, checkpoint=ckpt, progress=False, schedule_steps=100)
    resumed = _setup(tiny_mlp, steps=100)
    result = patchc.train_masks(resumed, _batches, _loss, steps=100, lr=1e-2, checkpoint=ckpt, resume=True, progress=False)

    assert result.step == 100 and int(resumed.schedule_step) == 100
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoints_space_out_where_saving_is_slow(tiny_mlp, tmp_path, monkeypatch):
    """Every `checkpoint_every` steps while saving is cheap; at most ~5% of the time once it is not. The
    cadence reads a clock this test moves (a step takes 1 s, a save `pause`), so no machine's load decides."""
    import types

    from patchc.masking import cadence as cadence_module
    from patchc.masking.cadence import Cadence
    from patchc.masking.train import CheckpointIO

    clock = [0.0]
    monkeypatch.setattr(cadence_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def slow_loss(prog, ids):
        clock[0] += 1.0
        return _loss(prog, ids)

    class Counted(CheckpointIO):
        def __init__(self, pause: float) -> None:
            self.steps, self.pause = [], pause

        def save(self, path, prog, optimizer, result) -> None:  # writes nothing: a save takes `pause`
            clock[0] += self.pause
            self.steps.append(result.step)

    cheap, slow = Counted(0.01), Counted(30.0)
    for io in (cheap, slow):
        patchc.train_masks(_setup(tiny_mlp, steps=40), _batches, slow_loss, steps=40, checkpoint=tmp_path / "c.ckpt",
                           checkpoint_every=5, checkpoint_io=io, progress=False)
    assert cheap.steps == [5, 10, 15, 20, 25, 30, 35, 40]  # the last one is not saved twice
    assert slow.steps == [5, 40]  # 30 s per save against 1 s steps: the next one 600 steps away

    cadence = Cadence(every=50)
    assert not cadence.due(49) and cadence.due(50)
    cadence.saved(50, save_seconds=0.01, step_seconds=3.0)  # cheap: every 50 steps as asked
    assert cadence.interval == 50 and not cadence.due(99) and cadence.due(100)
    cadence.saved(100, save_seconds=120.0, step_seconds=3.0)  # 120 s of saving per 800 steps of 3 s: 5%
    assert cadence.interval == 800 and not cadence.due(899) and cadence.due(900)
    assert not Cadence(every=0).due(1000)  # 0: only at the end


def test_checkpoint_errors_name_the_file(tiny_mlp, tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    prog = _setup(tiny_mlp)
    with pytest.raises(ValueError, match="bad.ckpt"):
        patchc.train_masks(prog, _batches, _loss, steps=2, checkpoint=bad, resume=True, progress=False)
    import pickle  # a foreign pickle, empty bytes: one short reason, never torch's advice to load it unsafely

    pickle.dump({"a": object}, bad.open("wb"))
    for content, reason in [(None, r"written by torch.save \(Unsupported operand \d+\)"), (b"", "empty, or cut short")]:
        if content is not None:
            bad.write_bytes(content)
        with pytest.raises(ValueError, match=rf"bad.ckpt: not a readable patchc training checkpoint .*{reason}\)$") \
                as err:
            patchc.train_masks(prog, _batches, _loss, steps=2, checkpoint=bad, resume=True, progress=False)
        assert "weights_only" not in str(err.value) and "\n" not in str(err.value)
    good = tmp_path / "good.ckpt"
    patchc.train_masks(prog, _batches, _loss, steps=2, checkpoint=good, progress=False)
    other = _setup(tiny_mlp, sparsity=0.2)
    with pytest.raises(ValueError, match=r"another PatchConfig: sparsity 0\.35 \(now 0\.2\)$") as err:
        patchc.train_masks(other, _batches, _loss, steps=2, checkpoint=good, resume=True, progress=False)
    assert "\n" not in str(err.value)  # one line that names the setting, not two reprs


def test_one_nan_loss_between_log_steps_never_reaches_a_checkpoint_or_a_plan(tiny_mlp, tmp_path, monkeypatch):
    """The loss was checked at log steps only: a NaN at step 3 made every logit NaN, the step-4 checkpoint
    saved them (a resume could not recover), and harden turned the NaN logits into a plausible plan."""
    from patchc.masking.cadence import Cadence

    monkeypatch.setattr(Cadence, "saved", lambda self, step, *timing: setattr(self, "last", step))  # every 2 steps
    prog, ckpt, calls = _setup(tiny_mlp), tmp_path / "masks.ckpt", []

    def loss(p, ids):
        calls.append(1)
        return _loss(p, ids) * (float("nan") if len(calls) == 3 else 1.0)

    with pytest.raises(FloatingPointError, match=r"loss is nan or inf at step 3 \(seen at step 4\); no checkpoint "
                                                 r"is written over the last one"):
        patchc.train_masks(prog, _batches, loss, steps=20, checkpoint=ckpt, checkpoint_every=2, log_every=10,
                           progress=False)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["step"] == 2 and all(v.isfinite().all() for v in saved["program"].values() if v.is_floating_point())
    for exact in (True, False):
        with pytest.raises(FloatingPointError, match=r"harden: layer \S+: its (tile|2:4) logits are not finite"):
            patchc.harden(prog, exact_budget=exact)
    calls.clear()
    # no checkpoint: caught at the log step
    with pytest.raises(FloatingPointError, match=r"at step 3 \(seen at step 10\); lower the"):
        patchc.train_masks(_setup(tiny_mlp), _batches, loss, steps=20, log_every=10, progress=False)


def test_train_masks_fits_the_schedules_to_its_steps_unless_told(tiny_mlp):
    prog = _setup(tiny_mlp, steps=300)
    patchc.train_masks(prog, _batches, _loss, steps=10, progress=False)
    assert prog.schedule()["tau"] == pytest.approx(prog.cfg.tau[1]) and prog.cfg.steps == 10  # fully annealed
    held = _setup(tiny_mlp, steps=300)
    patchc.train_masks(held, _batches, _loss, steps=10, schedule_steps=300, progress=False)
    assert held.schedule()["tau"] > held.cfg.tau[1] + 0.5  # 10 of 300 steps in: still hot


def test_training_moves_density_toward_the_target(tiny_mlp):
    prog = _setup(tiny_mlp, sparsity=0.45, steps=60, lambda_norm=0.0)
    d0 = float(prog.density())
    result = patchc.train_masks(prog, _batches, _loss, lr=5e-2, progress=False)
    assert abs(result.history[-1]["density"] - 0.55) < abs(d0 - 0.55)
    assert {"loss", "task", "density", "tau", "kappa_tile", "kappa_nm"} <= set(result.history[-1])


def test_harden_takes_logit_signs_and_argmax(tiny_mlp):
    prog = _setup(tiny_mlp)
    plan = patchc.harden(prog)
    for fqn, m in prog.layers.items():
        layer = plan.layers[fqn]
        assert torch.equal(layer.kinds == patchc.ir.TILE_DENSE, m.tile_logits.detach() > 0)
        assert torch.equal(layer.mask(), m.hard_mask())
        assert torch.equal(layer.to_dense(), prog.weight(fqn) * m.hard_mask())


def test_exact_budget_is_within_one_tile(tiny_mlp):
    for sparsity in (0.0, 0.1, 0.25, 0.4, 0.5):
        prog = _setup(tiny_mlp, sparsity=sparsity)
        plan = patchc.harden(prog, exact_budget=True)
        total = sum(m.numel for m in prog.layers.values())
        biggest_tile = 8 * 8
        # density = 0.5 + 0.5 * dense / total: one tile moves it by at most 0.5 * 64 / total
        assert abs(plan.density - (1 - sparsity)) <= 0.5 * biggest_tile / total + 1e-9, sparsity


def test_budget_prefers_the_highest_logits(tiny_mlp):
    prog = _setup(tiny_mlp, sparsity=0.25)
    chosen = budget_tiles(prog)
    picked = torch.cat([prog.layers[f].tile_logits.detach()[c] for f, c in chosen.items()])
    rest = torch.cat([prog.layers[f].tile_logits.detach()[~c] for f, c in chosen.items()])
    assert picked.numel() > 0 and rest.numel() > 0
    assert float(picked.min()) >= float(rest.max())


def test_harden_carries_bias_and_skips(tiny_mlp):
    prog = _setup(tiny_mlp)
    plan = patchc.harden(prog)
    assert torch.equal(plan.layers["up.weight"].bias, tiny_mlp.up.bias)
    assert plan.layers["down.weight"].bias is None
    assert "odd.weight" in plan.skipped
    assert "odd.weight" in plan.summary()


@pytest.mark.parametrize("memory", ["default", "low"])
def test_tile_logits_step_at_their_own_lr(tiny_mlp, memory):
    # Adam's first step moves every logit with a gradient by its lr (m / sqrt(v) = sign(g)).
    prog = _setup(tiny_mlp, steps=5)
    masks = list(prog.layers.values())
    tiles0 = [m.tile_logits.detach().clone() for m in masks]
    nm0 = [m.nm_logits.detach().clone() for m in masks]
    patchc.train_masks(prog, _batches, _loss, steps=1, lr=1e-3, tile_lr=1e-1, progress=False,
                       optim=MaskOptimConfig(memory=memory))
    tile_moves = torch.cat([(m.tile_logits.detach() - t0).abs().flatten() for m, t0 in zip(masks, tiles0)])
    nm_moves = torch.cat([(m.nm_logits.detach() - n0).abs().flatten() for m, n0 in zip(masks, nm0)])
    assert tile_moves.max() == pytest.approx(1e-1, rel=1e-3) and nm_moves.max() == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(ValueError, match="tile_lr=-1"):
        patchc.train_masks(prog, _batches, _loss, steps=1, tile_lr=-1.0, progress=False)


def test_resume_with_another_optimizer_layout_names_the_file(tiny_mlp, tmp_path):
    ckpt = tmp_path / "masks.ckpt"
    patchc.train_masks(_setup(tiny_mlp), _batches, _loss, steps=2, checkpoint=ckpt, progress=False)
    state = torch.load(ckpt, weights_only=True)
    groups = state["optimizer"]["param_groups"]  # as before the tile logits had a group of their own
    state["optimizer"]["param_groups"] = [dict(groups[0], params=[i for g in groups for i in g["params"]])]
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"masks\.ckpt: the optimizer state does not fit"):
        patchc.train_masks(_setup(tiny_mlp), _batches, _loss, steps=2, checkpoint=ckpt, resume=True, progress=False)


def test_zero_steps_train_nothing_and_keep_the_schedules(tiny_mlp):
    """steps=0 (allowed: 'steps must be >= 0') failed with 'schedule_steps=0 must be >= 1', an argument never passed."""
    prog = _setup(tiny_mlp, steps=20)
    before = {k: v.clone() for k, v in prog.state_dict().items()}
    result = patchc.train_masks(prog, _batches, _loss, steps=0, progress=False)
    assert result.step == 0 and not result.history and prog.cfg.steps == 20
    assert all(torch.equal(v, before[k]) for k, v in prog.state_dict().items())


def test_lm_loss_needs_blocks_of_two_tokens(tiny_mlp):
    """A block of 1 token has no next token to predict: torch said 'cannot reshape tensor of 0 elements'."""
    prog = _setup(tiny_mlp)
    assert torch.isfinite(patchc.lm_loss(prog, torch.randint(0, 32, (2, 2))))
    with pytest.raises(ValueError, match=r"lm_loss: a block .* at least 2 tokens .* got shape \(2, 1\)"):
        patchc.lm_loss(prog, torch.randint(0, 32, (2, 1)))
