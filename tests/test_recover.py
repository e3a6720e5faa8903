"""Weight recovery (`patchc.recover`, `patchc.job.recover.run_recover`): the loss falls, no mask breaks,
provenance still points at the dense source, and the run-folder job writes its two files."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import patchc
from patchc.ir import TILE_DENSE, TILE_SPARSE24, TilePlan
from patchc.ir.tiles import expand_tiles, to_tiles
from patchc.job.options import PruneOptions
from patchc.masking.recover import RecoverConfig, rebuild
from patchc.pruning.patterns import mask_24, merge_tiles
from tests.conftest import TINYSTORIES, needs_shared

TILE = (8, 8)


def hybrid_masks(model, every: int = 3) -> dict[str, torch.Tensor]:
    """Every `every`-th tile dense, the rest 2:4 by magnitude: a plan with both kinds in each layer."""
    masks = {}
    for fqn in ("up.weight", "down.weight"):
        w = model.get_parameter(fqn).detach()
        grid = to_tiles(w, TILE).shape[:2]
        dense = (torch.arange(grid[0] * grid[1]) % every == 0).view(grid)
        masks[fqn] = merge_tiles(dense, mask_24(w.abs(), fqn), TILE)
    return masks


def distill_batches(model, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 32, (8, 6), generator=gen) for _ in range(n)]
    with torch.no_grad():
        return [(x, model(x)) for x in ids]


def mse(model, batch):
    ids, target = batch
    return F.mse_loss(model(ids), target)


@pytest.fixture
def setup(tiny_mlp):
    dense = copy.deepcopy(tiny_mlp)
    plan = TilePlan.from_masks(tiny_mlp, hybrid_masks(tiny_mlp), tile=TILE)
    return plan, tiny_mlp, dense, distill_batches(dense)


def check_structure(rec: TilePlan, plan: TilePlan) -> None:
    """Same tiles, same 2:4 metadata, and every 2:4 group keeps exactly 2 of 4 in the mask."""
    assert list(rec.layers) == list(plan.layers) and rec.skipped == plan.skipped
    for fqn, layer in rec.layers.items():
        old = plan.layers[fqn]
        assert torch.equal(layer.kinds, old.kinds) and torch.equal(layer.meta, old.meta)
        mask = layer.mask()
        assert torch.equal(mask, old.mask())
        b1, b2 = layer.tile
        groups = to_tiles(mask, layer.tile, value=True).reshape(*layer.grid, b1, b2 // 4, 4)
        inside = to_tiles(torch.ones(layer.shape, dtype=torch.bool), layer.tile).reshape(groups.shape).any(-1)
        sparse = layer.kinds == TILE_SPARSE24
        assert bool((groups[sparse].sum(-1)[inside[sparse]] == 2).all()), f"{fqn}: a 2:4 group keeps other than 2"
        assert bool(groups[layer.kinds == TILE_DENSE].all()), f"{fqn}: a dense tile lost a weight"
        assert sparse.any() and (~sparse).any()
    rec.verify()


def test_adam_recovery_lowers_loss_and_keeps_every_mask(setup, tmp_path):
    plan, model, dense, batches = setup
    rec = patchc.recover(plan, model, batches, mse, steps=40, lr=3e-3, progress=False)
    info = rec.meta["recovery"]
    assert info["loss_after"] < 0.8 * info["loss_before"], info
    assert (info["scope"], info["steps"], info["lr"], info["method"]) == ("all", 40, 3e-3, "adam")
    check_structure(rec, plan)
    changed = [not torch.equal(rec.layers[f].to_dense(), plan.layers[f].to_dense()) for f in plan.layers]
    assert all(changed)
    for fqn, layer in rec.layers.items():  # the model itself holds the recovered W * M, zeros where pruned
        w = model.get_parameter(fqn).detach()
        assert torch.equal(w, layer.to_dense()) and bool((w[~layer.mask()] == 0).all())
    assert rec.meta["fingerprints"] == plan.meta["fingerprints"]  # still the dense source's
    rec.save(tmp_path / "rec.patch")
    again = TilePlan.load(tmp_path / "rec.patch")
    applied = again.apply(copy.deepcopy(dense))  # the original dense model accepts it
    for fqn, layer in again.layers.items():
        got = applied.get_parameter(fqn).detach()
        assert torch.equal(got, rec.layers[fqn].to_dense())
        assert bool((got[~layer.mask()] == 0).all())
    assert torch.equal(applied.up.bias, dense.up.bias)  # only weights train


def test_adam_recovery_runs_without_dropout_and_restores_the_mode(setup):
    """The student matches a dropout-free teacher: with dropout on it would be another, noisier function."""
    plan, model, dense, batches = setup
    model.up.register_forward_hook(lambda mod, _inp, out: F.dropout(out, 0.5, mod.training))
    modes = []

    def loss(m, batch):
        modes.append(m.training)
        return mse(m, batch)

    model.train()
    rec = patchc.recover(plan, model, batches, loss, steps=20, lr=3e-3, progress=False)
    assert modes and not any(modes)
    assert model.training  # handed back in the mode it came in
    # with dropout on, the scores before and after would be noisy; in eval mode they are the plain losses
    assert rec.meta["recovery"]["loss_after"] < rec.meta["recovery"]["loss_before"]


def test_values_scope_freezes_dense_tiles_bit_for_bit(setup):
    plan, model, _, batches = setup
    rec = patchc.recover(plan, model, batches, mse, steps=20, lr=3e-3, scope="values", progress=False)
    check_structure(rec, plan)
    assert rec.meta["recovery"]["loss_after"] < rec.meta["recovery"]["loss_before"]
    for fqn, layer in rec.layers.items():
        old = plan.layers[fqn]
        assert torch.equal(layer.dense, old.dense)
        assert not torch.equal(layer.values, old.values)
        dense_area = expand_tiles((layer.kinds == TILE_DENSE), layer.tile, layer.shape)
        w = model.get_parameter(fqn).detach()
        assert torch.equal(w[dense_area], old.to_dense()[dense_area])  # the model's dense tiles did not move


def test_refuses_other_weights_and_bad_settings(setup):
    plan, model, _, batches = setup
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.up.weight.add_(1.0)
    with pytest.raises(patchc.PlanError, match="made for other weights"):
        patchc.recover(plan, other, batches, mse, steps=2, progress=False)
    with pytest.raises(ValueError, match="scope='bogus'"):
        patchc.recover(plan, model, batches, mse, steps=2, scope="bogus")
    with pytest.raises(ValueError, match="steps=0"):
        RecoverConfig(steps=0)
    with pytest.raises(ValueError, match="needs calib"):
        patchc.recover(plan, model, method="sparsegpt")
    cfg = RecoverConfig(steps=10, schedule="linear", warmup=2)
    assert [round(cfg.schedule_factor(t), 3) for t in (0, 1, 2, 6, 9)] == [0.333, 0.667, 1.0, 0.5, 0.125]
    assert RecoverConfig(steps=4).schedule_factor(4) == pytest.approx(0.0)


def test_a_nan_loss_between_log_steps_names_its_step(setup):
    """Recovery logs every 10 steps: a NaN at step 3 is named as step 3 there, and never checkpointed."""
    plan, model, _, batches = setup
    calls = []

    def loss(m, batch):
        calls.extend([1] if torch.is_grad_enabled() else [])  # training steps only, not the scoring before
        return mse(m, batch) * (float("nan") if len(calls) == 3 and torch.is_grad_enabled() else 1.0)

    with pytest.raises(FloatingPointError, match=r"weight recovery: loss is nan or inf at step 3 \(seen at step 10\)"):
        patchc.recover(plan, model, batches, loss, steps=20, lr=3e-3, progress=False)


def test_sparsegpt_update_keeps_masks_and_lowers_loss(setup):
    plan, model, dense, batches = setup
    calib = patchc.calibrate(dense, [b[0] for b in batches], progress=False)
    rec = patchc.recover(plan, model, batches, mse, method="sparsegpt", calib=calib, progress=False)
    check_structure(rec, plan)
    info = rec.meta["recovery"]
    assert info["loss_after"] < info["loss_before"] and "lr" not in info


def test_rebuild_keeps_dense_buffer_for_values_scope(setup):
    plan = setup[0]
    layer = plan.layers["up.weight"]
    noisy = layer.to_dense() + 1.0
    same = rebuild(layer, noisy, scope="values")
    assert torch.equal(same.dense, layer.dense) and torch.equal(same.meta, layer.meta)
    moved = rebuild(layer, noisy, scope="all")
    assert torch.equal(moved.to_dense(), noisy * layer.mask())


def real_run_folder(out):
    """A finished-run folder as `patchc prune` leaves it (run.json, plan.patch with model and split recorded),
    built with the job's own helpers but a magnitude hybrid mask instead of training: torch.export alone
    would cost this test ~10 s of its budget."""
    from patchc.job import prune as job
    from patchc.job.runs import check_settings
    from patchc.models import load_model
    from patchc.pruning.calibrate import default_layers

    opts = job.PruneOptions(out=str(out), baselines=False, progress=False, data=(str(TINYSTORIES),),
                            train_data="real", eval_data=())  # no generated text, no second text: fast
    bundle = load_model(opts.model)
    data = job.load_data(bundle, opts)
    masks = {}
    for fqn in default_layers(bundle.model):
        w = bundle.model.get_parameter(fqn).detach()
        grid = to_tiles(w, (16, 16)).shape[:2]
        dense = (torch.arange(grid[0] * grid[1]) % 3 == 0).view(grid)
        masks[fqn] = merge_tiles(dense, mask_24(w.abs(), fqn), (16, 16))
    plan = TilePlan.from_masks(bundle.model, masks, tile=(16, 16))
    plan.meta |= {"model": opts.model, "data": job.data_record(data, opts)}
    out.mkdir()
    check_settings(out, opts, resume=False)
    plan.save(out / "plan.patch")
    return bundle


@needs_shared
def test_run_recover_on_a_real_run_folder(tmp_path, monkeypatch):
    from patchc.job.recover import run_recover

    out = tmp_path / "run"
    bundle = real_run_folder(out)
    before = (out / "plan.patch").read_bytes()
    result = run_recover(out, steps=4, lr=1e-3, batch_size=2, progress=False)
    assert (out / "plan.patch").read_bytes() == before  # never touched
    rec = TilePlan.load(out / "plan-recovered.patch")
    check_structure(rec, TilePlan.load(out / "plan.patch"))
    saved = json.loads((out / "recover.json").read_text())
    assert saved["results"] == result["results"]
    assert [r["name"] for r in saved["results"]] == ["dense", "hardened", "recovered"]
    ppl = [r["perplexity"] for r in saved["results"]]
    assert 1 < ppl[0] < ppl[1] and ppl[2] != ppl[1], ppl
    assert saved["recovery"]["steps"] == 4 and saved["train_tokens"] > 0 and saved["eval_tokens"] > 0
    assert saved["device"].startswith("cpu (") and saved["versions"]["torch"] == torch.__version__  # what it ran on
    assert saved["recovery"]["loss"] == "kd" and saved["recovery"]["lr"] == 1e-3  # the default, and the lr given
    applied = rec.apply(bundle.reload())  # the original dense model is the recovered plan's source too
    for fqn, layer in rec.layers.items():
        assert torch.equal(applied.get_parameter(fqn).detach(), layer.to_dense())
    # a second recovery keeps the first one's files unless told to replace them, and says so before any work
    kept = (out / "plan-recovered.patch").read_bytes(), (out / "recover.json").read_bytes()
    refused = "earlier recovery wrote plan-recovered.patch and recover.json; pass --overwrite"
    with pytest.raises(FileExistsError, match=refused) as err:
        run_recover(out, steps=2, recipe={"eval_fraction": 0.5})  # refused before the recipe is even read
    assert "\n" not in str(err.value)
    assert ((out / "plan-recovered.patch").read_bytes(), (out / "recover.json").read_bytes()) == kept
    with pytest.raises(ValueError, match="not the held-out split"):
        run_recover(out, steps=2, recipe={"eval_fraction": 0.5}, overwrite=True)
    with monkeypatch.context() as torchrun:  # SparseGPT's update is no training loop to shard: refused up front
        torchrun.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match="--method sparsegpt .* run it without torchrun"):
            run_recover(out, method="sparsegpt", overwrite=True)
    # --loss lm: the recipe's loss is the one recovery trains with, and the run's --recover-lr its lr
    lm = run_recover(out, steps=4, batch_size=2, progress=False, recipe={"recover_loss": "lm"}, overwrite=True)
    assert lm["recovery"]["loss"] == "lm" and lm["recovery"]["lr"] == PruneOptions().recovery_lr("causal")
    assert lm["results"][2]["perplexity"] != result["results"][2]["perplexity"]
    # --train-extra: recovery may train on more text than the run did, and is still scored on its held-out split
    more = tmp_path / "more.txt"
    more.write_text(" ".join(["A bird sang on the old red roof all day long."] * 30))
    extra = run_recover(out, steps=2, batch_size=2, progress=False, recipe={"train_extra": (str(more),)},
                        overwrite=True)
    assert extra["train_tokens"] > lm["train_tokens"] and extra["eval_tokens"] == lm["eval_tokens"]
    assert extra["recovery"]["recipe"] == {"train_extra": (str(more),)}
    settings = json.loads((out / "run.json").read_text())
    settings["settings"]["eval_fraction"] = 0.3  # another split than the plan was trained on
    (out / "run.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="differs from the plan's in .*eval_fraction"):
        run_recover(out, steps=2, progress=False, overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no plan.patch") as err:
        run_recover(empty, steps=2)
    assert "\n" not in str(err.value)


@needs_shared
def test_run_recover_refuses_before_any_text_when_training_cannot_fit(tmp_path, monkeypatch):
    from patchc.job import memory, prune
    from patchc.job.recover import run_recover

    out = tmp_path / "run"
    real_run_folder(out)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
    monkeypatch.setattr(prune, "load_data", lambda *a, **k: pytest.fail("loaded text for a recovery that cannot fit"))
    with pytest.raises(ValueError, match="weight recovery needs at least .* --method sparsegpt"):
        run_recover(out, steps=2, progress=False)
    assert not (out / "plan-recovered.patch").exists()


def test_the_recover_summary_names_what_was_scored():
    from patchc.job.recover import format_recover

    base = {"model": "m", "results": [{"name": "dense", "cosine": 1.0, "perplexity": 5.0}], "recovered_plan": "p",
            "run": "r"}
    assert "(123 sentences)" in format_recover({**base, "metric": "cosine", "eval_tokens": 123})
    assert "(4096 tokens)" in format_recover({**base, "metric": "perplexity", "eval_tokens": 4096})
    extra = [{"name": n, "perplexity": p, "perplexity_extra": {"wiki.txt": w}}
             for n, p, w in (("dense", 5.0, 100.0), ("hardened", 7.5, 150.0), ("recovered", 6.5, 140.25))]
    text = format_recover({**base, "results": extra, "metric": "perplexity", "eval_tokens": 10})
    assert "wiki.txt: dense 100.000  hardened 150.000  recovered 140.250" in text


def test_a_replaced_recovery_is_noted_in_the_report_and_a_bad_report_only_warns(tmp_path):
    from patchc.job.recover import note_replaced

    result = {"command": "patchc recover r --overwrite", "date": "2026-11-25T16:00:00+00:00"}
    plain = {"model": "m", "files": {"plan": "p"}}
    (tmp_path / "report.json").write_text(json.dumps(plain))
    note_replaced(tmp_path, result)  # no recovered plan listed: nothing was replaced, nothing written
    assert json.loads((tmp_path / "report.json").read_text()) == plain and not (tmp_path / "report.md").exists()
    (tmp_path / "report.json").write_text(json.dumps({**plain, "files": {"plan_recovered": "x"}}))
    note_replaced(tmp_path, result)
    note = json.loads((tmp_path / "report.json").read_text())["recovery_replaced"]
    assert note == {**result, "record": str(tmp_path / "recover.json")}
    assert "by `patchc recover r --overwrite`: its scores are in recover.json" in (tmp_path / "report.md").read_text()
    (tmp_path / "report.json").write_text("{broken")
    with pytest.warns(UserWarning, match="not updated to say its recovered plan was replaced"):
        note_replaced(tmp_path, result)
    assert (tmp_path / "report.json").read_text() == "{broken"


def test_recovery_scores_at_the_window_and_length_the_run_was_scored_with(tmp_path):
    """The window and the tokens per --eval-data file come from the run's report.json (a run scored on 512
    tokens of WikiText-2 was recovered and scored on 16,384: its dense row changed from 93.3 to 109.2)."""
    from patchc.job.recover import run_evaluation

    default = {"eval_context": PruneOptions.eval_context, "eval_tokens": PruneOptions.eval_tokens}
    assert run_evaluation(tmp_path) == default  # no report.json

    def report(evaluation: dict, extra: dict | None = None) -> dict:
        (tmp_path / "report.json").write_text(json.dumps({"evaluation": evaluation,
                                                          "data": {"eval_extra_tokens": extra or {}}}))
        return run_evaluation(tmp_path)

    assert report({"protocol": "..."}) == default  # a report from before the window was recorded
    assert report({"context": 32, "eval_tokens": 512}, {"a.txt": 300}) == {"eval_context": 32, "eval_tokens": 512}
    # before the cap was recorded: the largest file scored reached it, or every file was scored whole
    assert report({"context": 32}, {"a.txt": 300, "b.txt": 512}) == {"eval_context": 32, "eval_tokens": 512}
    (tmp_path / "report.json").write_text("{not json")
    assert run_evaluation(tmp_path) == default
    (tmp_path / "report.json").write_text("[1, 2]")
    assert run_evaluation(tmp_path) == default
