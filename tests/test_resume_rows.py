"""A run that dies late keeps what it finished: its plan at once, every row as it is scored, learned 2:4's
checkpoint; `--resume` scores no row again whose inputs are unchanged (`patchc.job.resume`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from patchc.ir import TilePlan
from patchc.job import prune, runs
from patchc.job.cli import main
from patchc.job.options import PruneOptions
from patchc.job.resume import RECOVERED, TRAINED, KeptRows
from patchc.job.results import row
from tests.conftest import needs_shared

ARGS = ["--steps", "4", "--batch-size", "4", "--calib-blocks", "2", "--no-progress", "--no-plots", "--prior",
        "magnitude", "--self-tokens", "258", "--eval-tokens", "256"]
ONESHOT = ["magnitude 2:4", "wanda 2:4", "sparsegpt 2:4"]


def _scores(folder) -> dict[str, float]:
    """{"<row> <text>": perplexity} for the held-out text and every --eval-data file of a finished run."""
    scores = {}
    for r in json.loads((folder / "report.json").read_text())["results"]:
        scores[f"{r['name']} held out"] = r["perplexity"]
        scores |= {f"{r['name']} {f}": v for f, v in r["perplexity_extra"].items()}
    return scores


@needs_shared
def test_a_run_that_dies_at_a_baseline_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["prune", "--out", str(straight), *ARGS, "--recover", "2"]) == 0
    real = prune.oneshot_baseline

    def dies_at_wanda(bundle, method, *args):
        if method == "wanda":
            raise RuntimeError("out of memory (injected)")
        return real(bundle, method, *args)

    monkeypatch.setattr(prune, "oneshot_baseline", dies_at_wanda)
    assert main(["prune", "--out", str(crashed), *ARGS]) == 2
    assert "out of memory (injected)" in capsys.readouterr().err
    assert not (crashed / "report.json").exists()
    kept = json.loads((crashed / runs.ROWS).read_text())["rows"]
    assert [e["row"]["name"] for e in kept] == ["dense", "PATCH joint", "magnitude 2:4"]
    plan = TilePlan.load(crashed / runs.PLAN)  # on disk before the baselines, not only once the report is
    assert plan.density == pytest.approx(TilePlan.load(straight / runs.PLAN).density)

    # Resume with recovery added: only what is missing is trained, recovered and scored.
    monkeypatch.setattr(prune, "oneshot_baseline", real)
    calls = Counter()
    for name in ("evaluate", "score_copy", "train", "recover_plan", "calibrate", "oneshot_masks"):
        def counted(*args, _real=getattr(prune, name), _name=name, **kwargs):
            calls[_name] += 1
            if _name == "train":
                calls[f"train {args[1].variant}"] += 1
            if _name == "recover_plan":
                calls[f"recover to {kwargs['checkpoint'].name}, resume={kwargs['resume']}"] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(prune, name, counted)
    assert main(["prune", "--out", str(crashed), *ARGS, "--recover", "2", "--resume"]) == 0
    report = json.loads((crashed / "report.json").read_text())
    assert report["resumed_rows"] == ["dense", "PATCH joint", "magnitude 2:4"]
    assert calls["evaluate"] == 0  # the dense row
    assert calls["recover_plan"] == 2  # PATCH's and learned 2:4's, neither kept before
    assert calls[f"recover to {runs.RECOVER_CHECKPOINT}, resume=True"] == 1  # each checkpointed on its own
    assert calls[f"recover to {runs.NM_RECOVER_CHECKPOINT}, resume=True"] == 1
    assert not (crashed / runs.RECOVER_CHECKPOINT).exists() and not (crashed / runs.NM_RECOVER_CHECKPOINT).exists()
    assert calls["score_copy"] == 2 + 2 + 1  # the two recoveries, wanda and sparsegpt, learned 2:4
    assert calls["train joint"] == 0 and calls["train nm"] == 1  # PATCH's kept plan is read back, not hardened
    assert report["train"]["final"]["step"] == 4 and report["train"]["final"] == json.loads(
        (straight / "report.json").read_text())["train"]["final"]  # what its training did, from the plan's meta
    assert _scores(crashed) == pytest.approx(_scores(straight), rel=1e-6)
    assert report["files"]["plan_recovered"] == str(crashed / runs.RECOVERED_PLAN)

    # Once more, nothing to do: every row is read back and learned 2:4 is not trained again.
    calls.clear()
    nm_checkpoint = (crashed / runs.NM_CHECKPOINT).stat().st_mtime_ns
    plan_file = (crashed / runs.PLAN).stat().st_mtime_ns
    assert main(["prune", "--out", str(crashed), *ARGS, "--recover", "2", "--resume"]) == 0
    assert calls["score_copy"] == calls["recover_plan"] == calls["train nm"] == 0
    assert calls["calibrate"] == calls["oneshot_masks"] == calls["train joint"] == 0  # nothing trains: no prior
    assert "export" not in json.loads((crashed / "report.json").read_text())["timings"]  # nor an export
    resumed = TilePlan.load(crashed / runs.PLAN)
    for fqn, layer in TilePlan.load(straight / runs.PLAN).layers.items():  # the same plan without its prior
        for part, t in layer.tensors().items():
            assert torch.equal(t, resumed.layers[fqn].tensors()[part]), (fqn, part)
    assert (crashed / runs.NM_CHECKPOINT).stat().st_mtime_ns == nm_checkpoint
    assert (crashed / runs.PLAN).stat().st_mtime_ns == plan_file  # read back, not written again
    assert _scores(crashed) == pytest.approx(_scores(straight), rel=1e-6)
    assert len(json.loads((crashed / "report.json").read_text())["resumed_rows"]) == 8

    # Scored anew (other --eval-tokens) without --recover: PATCH is hardened again, the same plan, so what was
    # recovered from it stays
    (crashed / runs.RECOVER_RECORD).write_text("{}")  # as `patchc recover` leaves it
    recovered = (crashed / runs.RECOVERED_PLAN).stat().st_mtime_ns
    calls.clear()
    assert main(["prune", "--out", str(crashed), *ARGS, "--eval-tokens", "128", "--no-baselines", "--resume"]) == 0
    assert calls["train joint"] == 1  # hardened again from its checkpoint
    assert (crashed / runs.RECOVERED_PLAN).stat().st_mtime_ns == recovered and (crashed / runs.RECOVER_RECORD).exists()

    # More steps, no recovery: a new plan, and what was recovered from the old one goes (`patchc eval` of it
    # would score a plan of other tiles, unwarned)
    assert main(["prune", "--out", str(crashed), *ARGS, "--steps", "6", "--no-baselines", "--resume"]) == 0
    assert (crashed / runs.PLAN).stat().st_mtime_ns != plan_file
    assert not (crashed / runs.RECOVERED_PLAN).exists() and not (crashed / runs.RECOVER_RECORD).exists()


def _opts(folder, **changes) -> PruneOptions:
    return PruneOptions(out=str(folder), eval_data=(), **changes)


def test_a_row_is_reused_only_under_the_inputs_it_was_scored_with(tmp_path):
    dense = row("dense", "dense", "-", 0.0, {"perplexity": 5.0})
    patch = row("PATCH joint", "patch", "hybrid", 0.35, {"perplexity": 7.0})
    recovered = row("PATCH joint + recovery", "patch+recover", "hybrid", 0.35, {"perplexity": 6.0})
    kept = KeptRows(tmp_path, _opts(tmp_path, steps=10, recover=5))
    kept.put(dense), kept.put(patch, *TRAINED), kept.put(recovered, *RECOVERED)

    again = KeptRows(tmp_path, _opts(tmp_path, steps=10, recover=5, device="cpu", threads=2, progress=False))
    assert again.get("dense") == dense and again.get("PATCH joint", *TRAINED) == patch
    assert again.has("PATCH joint + recovery", options=RECOVERED)
    more_steps = KeptRows(tmp_path, _opts(tmp_path, steps=20, recover=5))
    assert more_steps.get("dense") == dense  # scored before any training: kept
    assert more_steps.get("PATCH joint", *TRAINED) is None
    assert more_steps.get("PATCH joint + recovery", *RECOVERED) is None
    assert KeptRows(tmp_path, _opts(tmp_path, steps=10, recover=9)).get("PATCH joint + recovery", *RECOVERED) is None
    for changed in (dict(eval_context=128), dict(eval_tokens=99), dict(sparsity=0.45), dict(seed=1)):
        assert KeptRows(tmp_path, _opts(tmp_path, steps=10, **changed)).get("dense") is None, changed
    upgraded = KeptRows(tmp_path, _opts(tmp_path, steps=10))
    upgraded.base["versions"]["torch"] = "2.14.0"  # as after `pip install -U torch`
    assert upgraded.get("dense") is None

    scored = []
    fresh = KeptRows(tmp_path, _opts(tmp_path, steps=20, recover=5))
    assert fresh.row("dense", lambda: scored.append(1)) == dense and not scored and fresh.reused == ["dense"]
    new = row("PATCH joint", "patch", "hybrid", 0.35, {"perplexity": 6.5})
    assert fresh.row("PATCH joint", lambda: new, *TRAINED) == new and fresh.reused == ["dense"]
    assert KeptRows(tmp_path, _opts(tmp_path, steps=20)).get("PATCH joint", *TRAINED) == new  # written at once
    fresh.drop("dense")
    fresh.put(new, *TRAINED)
    assert KeptRows(tmp_path, _opts(tmp_path, steps=20)).get("dense") is None
    with pytest.raises(AssertionError, match="was scored as"):
        fresh.row("wanda 2:4", lambda: dense)


def test_a_damaged_rows_file_is_scored_again_not_trusted(tmp_path, caplog):
    (tmp_path / runs.ROWS).write_text('{"format": "patchc.rows", "version": 1, "rows": [{"row": {}}]}')
    assert KeptRows(tmp_path, _opts(tmp_path)).entries == {}
    (tmp_path / runs.ROWS).write_text("{not json")
    assert KeptRows(tmp_path, _opts(tmp_path)).entries == {}
    assert "its rows are scored again" in caplog.text


def test_a_fresh_start_removes_what_a_resume_would_reuse(tmp_path):
    opts = _opts(tmp_path)
    sharded = tmp_path / runs.CHECKPOINT  # a --fsdp run's checkpoint is a folder
    (sharded / "shard").mkdir(parents=True)
    (tmp_path / f"{runs.CHECKPOINT}.prev").mkdir()
    for name in (runs.NM_CHECKPOINT, runs.ROWS):
        (tmp_path / name).write_text("x")
    with pytest.raises(runs.RunError, match="holds a training checkpoint"):
        runs.check_settings(tmp_path, opts, resume=False)
    runs.check_settings(tmp_path, opts, resume=False, overwrite=True)  # used to fail on the folder (unlink)
    assert sorted(p.name for p in tmp_path.iterdir()) == [runs.SETTINGS]
    (tmp_path / runs.ROWS).write_text("x")
    runs.release(tmp_path, failed=True)  # failed before any checkpoint: no trace
    assert not tmp_path.exists()


def test_an_overwrite_killed_at_its_start_leaves_an_unfinished_run_not_two_mixed(tmp_path, capsys, monkeypatch):
    """The old plan, recovered plan, recover.json and report stayed until the new run wrote its own: killed in
    between, `recover` met a text mismatch and a rerun said the folder "already holds a finished run"."""
    monkeypatch.setattr("patchc.job.prune.load_bundle", lambda *_: pytest.fail("the model loaded"))
    folder = tmp_path / "run"
    folder.mkdir()
    results = (runs.PLAN, runs.RECOVERED_PLAN, runs.RECOVER_RECORD, *runs.REPORT)
    for name in (*results, runs.CHECKPOINT, runs.ROWS):
        (folder / name).write_text("{}")  # a finished run's files
    runs.check_settings(folder, _opts(folder, lr=0.01), resume=False, overwrite=True)  # then killed
    assert sorted(p.name for p in folder.iterdir()) == [runs.SETTINGS]
    assert main(["prune", "--out", str(folder), "--resume", "--no-progress"]) == 2  # nothing to continue...
    assert "has no checkpoint (masks.ckpt) to continue; drop --resume" in capsys.readouterr().err
    runs.check_out(_opts(folder))  # ... and a rerun starts without --overwrite


def test_the_report_goes_once_a_resumed_run_writes_its_plan(tmp_path):
    for name in (*runs.REPORT, runs.PLAN):
        (tmp_path / name).write_text("x")
    runs.unfinish(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [runs.PLAN]


# -- under torchrun: every rank agrees whether learned 2:4 trains ------------------------------------------------


def _baselines_worker(rank: int, out: str) -> None:
    """`still_to_do` and `baselines` on 2 gloo ranks, in a folder without kept rows ("fresh") and in one whose
    learned 2:4 row is kept ("kept"): rank 0 alone reads them."""
    import types

    import torch.distributed as dist

    from tests.test_fsdp import WORLD

    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=WORLD)
    trained = []
    plan = types.SimpleNamespace(sparsity=0.5, apply=lambda model: model)
    seconds = types.SimpleNamespace(seconds=1.0)

    def train(bundle, cfg, *args, **kwargs):  # a collective, as the real one is: a rank alone would hang here
        trained.append(cfg.variant)
        dist.barrier()
        return plan, seconds

    prune.train = train
    prune.score_copy = lambda *args, **kwargs: {"perplexity": 9.0}
    try:
        for case in ("fresh", "kept"):
            folder = Path(out) / case
            opts = _opts(folder, baselines=True, tile=(16, 16))
            kept = KeptRows(folder, opts) if rank == 0 else None
            results, trained[:] = [], []
            todo = prune.still_to_do(folder, opts, kept)  # rank 0 reads the kept rows and tells rank 1
            prune.baselines(None, opts.patch_config(), {}, opts, None, None, None, results, {}, kept, lambda: None,
                            out=folder, train_nm=todo.nm)
            torch.save({"trained": list(trained), "rows": [r["name"] for r in results]}, folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_every_rank_trains_learned_24_or_none_does(tmp_path):
    import torch.multiprocessing as mp

    from tests.test_fsdp import WORLD, _join_ranks

    (tmp_path / "fresh").mkdir()
    kept = KeptRows(tmp_path / "kept", _opts(tmp_path / "kept", baselines=True, tile=(16, 16)))
    for name in ONESHOT:
        kept.put(row(name, name.split()[0], "2:4", 0.5, {"perplexity": 50.0}))
    kept.put(row(prune.NM_ROW, "patch-nm", "2:4", 0.5, {"perplexity": 9.0}), *TRAINED)
    _join_ranks(mp.start_processes(_baselines_worker, args=(str(tmp_path),), nprocs=WORLD, join=False,
                                   start_method="spawn"), timeout=120)
    for case, trains in (("fresh", ["nm"]), ("kept", [])):
        got = [torch.load(tmp_path / case / f"rank{r}.pt") for r in range(WORLD)]
        assert [g["trained"] for g in got] == [trains] * WORLD, case
        assert got[0]["rows"] == [*ONESHOT, prune.NM_ROW] and got[1]["rows"] == [], case


def test_patchc_recover_makes_a_resume_recover_again(tmp_path):
    from patchc.job.recover import note_replaced

    kept = KeptRows(tmp_path, _opts(tmp_path, recover=5))
    for name in ("dense", "PATCH joint", "PATCH joint + recovery", prune.NM_ROW, f"{prune.NM_ROW} + recovery"):
        kept.put(row(name, "m", "hybrid", 0.35, {"perplexity": 6.0}), *RECOVERED)
    note_replaced(tmp_path, {"command": "patchc recover r", "date": "2026-11-29"})  # it replaced plan-recovered
    again = KeptRows(tmp_path, _opts(tmp_path, recover=5))
    assert sorted(again.entries) == sorted(["dense", "PATCH joint", prune.NM_ROW, f"{prune.NM_ROW} + recovery"])
    (tmp_path / runs.ROWS).write_text("{broken")
    note_replaced(tmp_path, {"command": "c", "date": "d"})
    assert not (tmp_path / runs.ROWS).exists()


def test_a_kept_plan_is_read_back_only_when_it_trained_for_these_steps(tmp_path, tiny_mlp, capsys):
    from tests.test_recover import TILE, hybrid_masks

    plan = TilePlan.from_masks(tiny_mlp, hybrid_masks(tiny_mlp), tile=TILE)
    resume = _opts(tmp_path, steps=4, resume=True)
    assert prune.kept_plan(tmp_path, resume) is None  # no plan.patch
    plan.save(tmp_path / runs.PLAN)
    assert prune.kept_plan(tmp_path, resume) is None  # made by an older patchc: no record of its training
    plan.meta["train"] = {"step": 4, "seconds": 1.5, "final": {"step": 4, "loss": 2.0}}
    plan.save(tmp_path / runs.PLAN)
    read, trained = prune.kept_plan(tmp_path, resume)
    assert (trained.step, trained.seconds, trained.history) == (4, 1.5, [{"step": 4, "loss": 2.0}])
    assert all(torch.equal(t, read.layers[f].tensors()[k]) for f, layer in plan.layers.items()
               for k, t in layer.tensors().items())
    assert prune.kept_plan(tmp_path, _opts(tmp_path, steps=6, resume=True)) is None  # extended: trained again
    assert prune.kept_plan(tmp_path, _opts(tmp_path, steps=4)) is None  # a fresh start reuses nothing
    (tmp_path / runs.PLAN).write_bytes(b"damaged")
    assert prune.kept_plan(tmp_path, resume) is None
    assert "not read back" in capsys.readouterr().out
