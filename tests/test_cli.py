"""`patchc prune` end to end in a reduced form, and its bad-input errors (CPU)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from patchc.job.cli import main
from patchc.ir import TilePlan
from tests.conftest import STORIES, TINYSTORIES, needs_shared

pytestmark = needs_shared

QUICK = ["--steps", "6", "--batch-size", "4", "--calib-blocks", "4", "--no-progress"]


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_prune_writes_every_output_and_consistent_numbers(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["prune", "--out", str(out), *QUICK]) == 0
    printed = capsys.readouterr().out
    assert str(out.resolve()) in printed and "perplexity" in printed
    for name in ("plan.patch", "report.json", "report.md", "sparsity_per_block.png", "sparsity_per_projection.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert list(out.glob("tile_map_*.png"))
    report = json.loads((out / "report.json").read_text())
    plan = TilePlan.load(out / "plan.patch")
    assert report["plan"]["density"] == pytest.approx(plan.density, abs=1e-12)
    assert abs(plan.density - 0.65) <= 0.5 * 16 * 16 / sum(lp.numel for lp in plan.layers.values()) + 1e-9
    names = [r["name"] for r in report["results"]]
    assert names[0] == "dense" and "magnitude 2:4" in names and "sparsegpt 2:4" in names
    assert "wanda 2:4" in names and "learned 2:4 (nm)" in names and any(n.startswith("PATCH") for n in names)
    patch_row = next(r for r in report["results"] if r["name"].startswith("PATCH"))
    assert patch_row["sparsity"] == pytest.approx(plan.sparsity, abs=1e-6)
    assert all(r["perplexity"] > 1 for r in report["results"])
    md = (out / "report.md").read_text()
    assert "sparsegpt 2:4" in md and "sparsity_per_block.png" in md
    # A finished run is never overwritten.
    assert main(["prune", "--out", str(out), *QUICK]) == 2
    assert "already holds a finished run" in capsys.readouterr().err


def test_eval_and_report_commands_read_a_saved_plan(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["prune", "--out", str(out), "--no-baselines", "--prior", "magnitude", *QUICK]) == 0
    (out / "sparsity_per_block.png").unlink()
    capsys.readouterr()
    assert main(["report", str(out / "plan.patch")]) == 0
    assert (out / "sparsity_per_block.png").is_file()
    assert main(["eval", str(out / "plan.patch")]) == 0
    assert "pruned" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model.bin"], "/nonexistent/model.bin"),
        (["--sparsity", "0.7"], "outside [0, 0.5]"),
        (["--tile", "64", "64"], "does not fit"),
        (["--block-len", "100000"], "longer than the 512 positions"),
        (["--eval-context", "4096"], "--eval-context 4096 is longer than the 512 positions"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--seed", str(2**70)], "--seed must be in [0, 2**63)"),
        (["--threads", "1000"], "--threads must be in [0, "),
        (["--device", "cuda:7"], "--device cuda:7"),
        (["--encoding", "klingon"], "--encoding 'klingon'"),
        (["--data", "/nonexistent/text.txt"], "/nonexistent/text.txt"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert main(["prune", "--out", str(out), *QUICK, "--no-baselines", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()  # no empty output folder left behind


def test_python_dash_m_is_the_same_command():
    done = subprocess.run([sys.executable, "-m", "patchc", "prune", "--help"], capture_output=True, text=True, check=True)
    assert "--sparsity" in done.stdout and "--resume" in done.stdout


def test_data_free_mode_trains_on_sampled_text_and_evaluates_on_real_text(tmp_path):
    out = tmp_path / "free"
    assert main(["prune", "--out", str(out), "--data-free", "--no-baselines", "--prior", "magnitude", *QUICK]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["data_free"] is True
    assert report["data"]["train"] == ["sampled from the dense model"]
    assert report["data"]["eval"] == [str(TINYSTORIES)]
    patch_row = next(r for r in report["results"] if r["name"].startswith("PATCH"))
    assert 1 < patch_row["perplexity"] < 1000


def test_sampled_training_text_is_seeded(tmp_path):
    from patchc.job.options import PruneOptions
    from patchc.job.prune import sample_training_text
    from patchc.models import load_model

    bundle = load_model(str(STORIES / "stories260K.bin"))
    opts = PruneOptions(block_len=16, batch_size=2, seed=5)
    a, b = sample_training_text(bundle, opts, n_blocks=4), sample_training_text(bundle, opts, n_blocks=4)
    assert a.shape == (4, 17) and torch.equal(a, b) and bool((a[:, 0] == 1).all())
    assert not torch.equal(a, sample_training_text(bundle, dataclasses.replace(opts, seed=6), n_blocks=4))


def test_bf16_weights_train_fp32_logits(tmp_path):
    out = tmp_path / "bf16"
    args = ["prune", "--out", str(out), "--dtype", "bfloat16", "--tau-nm", "3", "0.1", "--no-baselines",
            "--prior", "magnitude", *QUICK]
    assert main(args) == 0
    plan = TilePlan.load(out / "plan.patch")
    assert {lp.dtype for lp in plan.layers.values()} == {torch.bfloat16}
    state = torch.load(out / "masks.ckpt", weights_only=True)
    logits = [v for k, v in state["program"].items() if k.endswith("_logits")]
    assert logits and all(v.dtype == torch.float32 for v in logits)
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["tau_nm"] == [3.0, 0.1]
