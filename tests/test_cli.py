"""`patchc prune` end to end in a reduced form, and its bad-input errors (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patchc.job.cli import main
from patchc.ir import TilePlan
from tests.conftest import SHARED, TINYSTORIES, needs_shared

pytestmark = needs_shared

WIKI = SHARED / "data" / "wikitext2_raw_test.txt"
QUICK = ["--steps", "6", "--batch-size", "4", "--calib-blocks", "4", "--no-progress", "--self-tokens", "516",
         "--eval-tokens", "256"]


def test_prune_writes_every_output_and_consistent_numbers(tmp_path, capsys):
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # the job runs stories260K on one thread; the caller's count comes back after
    try:
        assert main(["prune", "--out", str(out), "--recover", "2", *QUICK]) == 0
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert str(out.resolve()) in printed and "perplexity" in printed
    for name in ("plan.patch", "report.json", "report.md", "sparsity_per_block.png", "sparsity_per_projection.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert list(out.glob("tile_map_*.png"))
    report = json.loads((out / "report.json").read_text())
    plan = TilePlan.load(out / "plan.patch")
    assert report["plan"]["density"] == pytest.approx(plan.density, abs=1e-12)
    assert report["train"]["lr"] == 1e-3 and report["train"]["tile_lr"] == 3e-2  # both groups' rates
    # no --tile: the model's own (stories260K is 64 wide), recorded for --resume and `patchc recover`
    assert {lp.tile for lp in plan.layers.values()} == {(16, 16)}
    assert json.loads((out / "run.json").read_text())["settings"]["tile"] == [16, 16]
    assert abs(plan.density - 0.65) <= 0.5 * 16 * 16 / sum(lp.numel for lp in plan.layers.values()) + 1e-9
    names = [r["name"] for r in report["results"]]
    assert names[0] == "dense" and "magnitude 2:4" in names and "sparsegpt 2:4" in names
    assert "wanda 2:4" in names and "learned 2:4 (nm)" in names and any(n.startswith("PATCH") for n in names)
    patch_row = next(r for r in report["results"] if r["name"].startswith("PATCH"))
    assert patch_row["sparsity"] == pytest.approx(plan.sparsity, abs=1e-6)
    assert all(r["perplexity"] > 1 for r in report["results"])
    # --recover: PATCH and the learned 2:4 baseline are both recovered; the masks never move
    assert {"PATCH joint + recovery", "learned 2:4 (nm) + recovery"} <= set(names)
    recovered = TilePlan.load(out / "plan-recovered.patch")
    recovered.verify()
    assert recovered.meta["recovery"]["splice"] == 0.0 and report["recover"]["splice"] == 0.0  # a causal LM's text
    for name, lp in plan.layers.items():
        assert torch.equal(recovered.layers[name].kinds, lp.kinds) and torch.equal(recovered.layers[name].meta, lp.meta), name
    assert report["files"]["plan_recovered"] == str(out / "plan-recovered.patch")
    md = (out / "report.md").read_text()
    assert "sparsegpt 2:4" in md and "sparsity_per_block.png" in md
    # A finished run is never overwritten, nor is its recovered plan by a later `patchc recover`.
    assert main(["prune", "--out", str(out), *QUICK]) == 2
    assert "already holds a finished run" in capsys.readouterr().err
    assert main(["recover", str(out), "--steps", "1"]) == 2
    assert "earlier recovery wrote plan-recovered.patch; pass --overwrite" in capsys.readouterr().err
    assert TilePlan.load(out / "plan-recovered.patch").layers.keys() == recovered.layers.keys()
    # --overwrite replaces it, and the report says its recovered plan is no longer the one it scored
    assert main(["recover", str(out), "--steps", "1", "--overwrite", "--no-progress"]) == 0
    replaced = json.loads((out / "report.json").read_text())["recovery_replaced"]
    assert replaced["command"].startswith("patchc recover") and replaced["record"] == str(out / "recover.json")
    assert "**recovered plan replaced** on" in (out / "report.md").read_text()


@pytest.mark.parametrize("argv, field, value", [
    (["--tile-lr", "0.001"], "tile_lr", 0.001), (["--tau-nm", "1", "0.1"], "tau_nm", (1.0, 0.1)),
    (["--kappa-tile", "5", "50"], "kappa_tile", (5.0, 50.0)), (["--lr", "0.01"], "lr", 0.01),
    (["--no-exact-budget"], "exact_budget", False), (["--train-extra", "a.txt"], "train_extra", ("a.txt",))])
def test_each_prune_flag_reaches_the_options(argv, field, value):
    """--tile-lr was parsed and then dropped by the hand-written copy into PruneOptions: every run trained
    the tile logits at 0.03 and recorded that in run.json, whatever the flag said."""
    import argparse
    import dataclasses

    from patchc.job.options import PruneOptions
    from patchc.job.prune_args import add_prune_arguments, prune_options

    parser = argparse.ArgumentParser()
    add_prune_arguments(parser)
    assert getattr(prune_options(parser.parse_args(argv)), field) == value
    defaults = prune_options(parser.parse_args([]))
    assert defaults == dataclasses.replace(PruneOptions(), out=defaults.out)  # the flags' defaults are the options'
    with pytest.raises(ValueError, match="--tile-lr"):
        prune_options(parser.parse_args(["--tile-lr", "-1"]))


def test_eval_and_report_commands_read_a_saved_plan(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("tile_map_another_plans.png", "notes.png"):  # an earlier plan's picture, and the user's own
        (out / name).write_bytes(b"png")
    # a folder that is no run: refused unless --overwrite (which writes the run among the user's files)
    assert main(["prune", "--out", str(out), "--no-baselines", "--prior", "magnitude", "--no-plots", *QUICK]) == 2
    assert "is not a patchc run folder and holds notes.png, tile_map_another_plans.png" in capsys.readouterr().err
    assert main(["prune", "--out", str(out), "--no-baselines", "--prior", "magnitude", "--no-plots", "--overwrite",
                 *QUICK]) == 0
    assert [p.name for p in out.glob("*.png")] == ["notes.png"]
    assert "![" not in (out / "report.md").read_text() and "png" not in (out / "report.json").read_text()
    capsys.readouterr()
    assert main(["report", str(out / "plan.patch")]) == 0  # draws what --no-plots skipped
    assert (out / "sparsity_per_block.png").is_file() and list(out.glob("tile_map_*.png"))
    assert "![sparsity per block](sparsity_per_block.png)" in (out / "report.md").read_text()
    assert main(["eval", str(out)]) == 0  # the run folder stands for its plan.patch
    assert "pruned" in capsys.readouterr().out
    short = tmp_path / "short.txt"  # 2 lines no run trained on; each --text is scored up to --eval-tokens
    short.write_text("The cat sat on the mat.\n\nThe dog ran to the park and back.\n")
    assert main(["eval", str(out), "--text", str(short), str(WIKI), "--eval-tokens", "100"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "; short.txt scored whole (" in head and "; wikitext2_raw_test.txt scored on its first 100 tokens" in head
    assert "(split seed 0, " in head and " tokens);" in head


@pytest.mark.parametrize("command", [["eval"], ["report"], ["generate", "--out", "k"], ["tune"]])
def test_plan_commands_name_a_folder_without_a_plan(tmp_path, capsys, command):
    assert main([command[0], str(tmp_path), *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path}: no plan.patch in it" in err, err
    assert not (tmp_path / "k").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model.bin"], "/nonexistent/model.bin"),
        (["--sparsity", "0.7"], "error: --sparsity 0.7 is outside [0, 0.5]"),  # the flag, not PatchConfig's field
        (["--variant", "nm"], "--variant nm makes every tile 2:4, i.e. sparsity 0.5; got --sparsity 0.35. Pass "
                              "--sparsity 0.5 or use --variant joint"),
        (["--kappa-tile", "1", "-1"], "--kappa-tile 1.0 -1.0 must be two finite numbers > 0 (start, end), e.g. "
                                      "--kappa-tile 25.0 350.0"),
        (["--tile", "512", "512"], "is larger than 35 of them: choose a smaller tile"),
        (["--block-len", "100000"], "longer than the 512 positions"),
        (["--eval-context", "4096"], "--eval-context 4096 is longer than the 512 positions"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--seed", str(2**70)], "--seed must be in [0, 2**63)"),
        (["--threads", "1000"], "--threads must be in [0, "),
        (["--device", "cuda:7"], "--device cuda:7"),
        (["--encoding", "klingon"], "--encoding 'klingon'"),
        (["--data", "/nonexistent/text.txt"], "/nonexistent/text.txt"),
        (["--recover-splice", "0.5"], "stories260K is a causal LM"),
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


HEAVY = ("torch", "triton", "transformers", "numpy")


@pytest.mark.parametrize("argv", [["--help"], ["prune", "--help"], ["bench", "--help"], ["prune", "--tile", "x"],
                                  ["prune", "--sparsity", "0.7"], ["eval", "runs/typo"], ["recover", "runs/typo"],
                                  ["export", "runs/typo", "--out", "x"], ["report", "typo.patch"],
                                  ["generate", "typo/", "--out", "k"], ["tune", "typo.patch"],
                                  ["generate", "plan.patch", "--out", "k", "--workers", "0"]])
def test_help_and_flag_errors_answer_without_importing_torch(argv):
    """torch alone takes seconds to import: `patchc --help`, each command's help, argparse's own errors (a
    wrong type), `patchc prune`'s checks of its values and a plan or run folder that is not there answer
    without it, as does `import patchc`."""
    code = (f"import runpy, sys\nsys.argv = ['patchc', *{argv!r}]\ntry:\n"
            "    runpy.run_module('patchc', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            f"print('IMPORTED', [m for m in {HEAVY!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    said = done.stdout + done.stderr
    assert "usage: patchc" in said or f"patchc {argv[0]}: error: " in done.stderr, done.stderr[-300:]
    typo = [a for a in argv if "typo" in a]
    assert not typo or f"{typo[0]}: no such" in done.stderr, done.stderr[-300:]
    assert done.stdout.splitlines()[-1] == "IMPORTED []", done.stdout[-300:]


def test_the_lazy_names_of_the_packages_resolve():
    """Every name `patchc`, `patchc.job`, `patchc.models`, `patchc.export` and `patchc.bench` list resolves,
    a subpackage reads as an attribute, and a missing name is an AttributeError naming the package. No lazy
    name is also a submodule's: importing the submodule would replace the name with the module."""
    import importlib
    import pkgutil

    for package in ("patchc", "patchc.job", "patchc.models", "patchc.export", "patchc.bench"):
        module = importlib.import_module(package)
        assert all(getattr(module, name) is not None for name in module.__all__), package
        assert set(module.__all__) <= set(dir(module))
        submodules = {m.name for m in pkgutil.iter_modules(module.__path__)}
        assert not {name for name, (_, attr) in module._LAZY.items() if attr and name in submodules}, package
    import patchc

    assert patchc.ir.TilePlan is TilePlan and patchc.transform.__module__ == "patchc.passes.transform"
    with pytest.raises(AttributeError, match="module 'patchc.models' has no attribute 'nope'"):
        patchc.models.nope  # noqa: B018


def test_self_generated_text_trains_and_real_text_evaluates(tmp_path):
    out = tmp_path / "free"
    args = ["prune", "--out", str(out), "--data-free", "--no-baselines", "--prior", "magnitude", "--no-plots",
            "--eval-data", str(TINYSTORIES), *QUICK]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    data = report["data"]
    assert data["train_data"] == "self" and data["train"] == ["generated by the dense model"]
    assert data["train_tokens_real"] == 0 and data["train_tokens_generated"] == data["train_tokens"] == 4 * 129
    assert data["eval"] == [str(TINYSTORIES)] and data["eval_extra_tokens"] == {str(TINYSTORIES): 256}
    patch_row = next(r for r in report["results"] if r["name"].startswith("PATCH"))
    assert 1 < patch_row["perplexity"] < 1000 and 1 < patch_row["perplexity_extra"][TINYSTORIES.name] < 1000
    assert "tinystories_sample.txt (unsplit)" in (out / "report.md").read_text()
    assert list((tmp_path / ".cache").glob("selfdata-*.pt"))  # generated text is cached beside the run


def test_bf16_weights_train_fp32_logits(tmp_path):
    """Also the low-byte mode: 4 scores per group of 4 weights instead of 6 pattern logits, bf16 Adam state."""
    out = tmp_path / "bf16"
    args = ["prune", "--out", str(out), "--dtype", "bfloat16", "--tau-nm", "3", "0.1", "--no-baselines",
            "--prior", "magnitude", "--no-plots", "--nm-param", "weight", "--low-memory", *QUICK]
    assert main(args) == 0
    plan = TilePlan.load(out / "plan.patch")
    assert {lp.dtype for lp in plan.layers.values()} == {torch.bfloat16}
    state = torch.load(out / "masks.ckpt", weights_only=True)
    logits = [v for k, v in state["program"].items() if k.endswith("_logits")]
    assert logits and all(v.dtype == torch.float32 for v in logits)
    assert {v.shape[-1] for k, v in state["program"].items() if k.endswith("nm_logits")} == {4}
    moments = [t for s in state["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert moments and {t.dtype for t in moments} == {torch.bfloat16}
    plan.verify()
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["tau_nm"] == [3.0, 0.1]


def test_generate_serves_a_cpu_plan_in_bf16_unless_told():
    from patchc.codegen.reference import random_tile_plan
    from patchc.codegen.generate import serving_dtype

    spec = dict(n=32, k=32, tile=(16, 16), kinds="mixed")
    fp32, fp16 = (random_tile_plan({"w.weight": dict(spec, dtype=d)}) for d in (torch.float32, torch.float16))
    assert serving_dtype(fp32, "auto") == torch.bfloat16 and serving_dtype(fp16, "auto") is None
    assert serving_dtype(fp32, "float32") == torch.float32 and serving_dtype(fp16, "bfloat16") == torch.bfloat16


def test_tune_with_a_time_limit_says_what_it_left(tmp_path, capsys, monkeypatch):
    """`patchc tune --time-limit`: the limit reaches the tuner; layers cut short or left on the default
    configs are named as such, all-dense ones as F.linear; a negative limit is one line."""
    import patchc.runtime as rt
    from patchc.codegen.configs import KernelConfig
    from patchc.codegen.reference import random_tile_plan

    plan = random_tile_plan({"a.weight": dict(n=32, k=32, tile=(16, 16), kinds="mixed"),
                             "b.weight": dict(n=32, k=32, tile=(16, 16), kinds="sparse"),
                             "c.weight": dict(n=32, k=32, tile=(16, 16), kinds="dense")})
    path = tmp_path / "plan.patch"
    plan.save(path)
    seen = {}

    def fake_tune(plan, **kw):
        seen.update(kw)
        partial = rt.LayerTuning("a.weight", (16, 16), KernelConfig("decode", 16, 16, 16, 1, 4, 1, 8, "fixup"),
                                 KernelConfig("prefill", 16, 16, 16, 1, 4, 2, 8, "fixup"), 16,
                                 source="partial")
        return {"a.weight": partial, "b.weight": None, "c.weight": None}

    monkeypatch.setattr(rt, "tune_plan", fake_tune)
    assert main(["tune", str(path), "--time-limit", "30"]) == 0
    out = capsys.readouterr().out
    assert seen["time_limit"] == 30.0 and '"source": "partial"' in out
    assert "b.weight: default configs (time limit)" in out and "c.weight: all dense: F.linear" in out
    assert "(time limit: 1 cut short, 1 on the default configs; run again to go on)" in out
    monkeypatch.undo()
    assert main(["tune", str(path), "--time-limit", "-1"]) == 2
    assert "time_limit must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("flags, shown", [([], {"warning"}), (["-v"], {"warning", "info"}),
                                          (["-vv"], {"warning", "info", "debug"})])
def test_verbose_shows_patchc_log_lines_for_the_command_only(tmp_path, capsys, monkeypatch, flags, shown, after):
    """`-v` prints patchc's INFO lines (the tuner's choices, --offload's prefetch), `-vv` its DEBUG lines too;
    warnings show either way, and the flag counts before the command or after it (`patchc report PLAN -v` was
    "unrecognized arguments"). The handler and the level are the command's: gone once it returns."""
    import logging

    from patchc.job import cli

    log = logging.getLogger("patchc.models.offload")

    def fake_report(args):
        log.debug("debug line")
        log.info("info line")
        log.warning("warning line")
        return 0

    monkeypatch.setattr(cli, "cmd_report", fake_report)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as on a command line: pytest's capture off
    plan = tmp_path / "plan.patch"
    plan.write_bytes(b"")  # `report` checks the path exists before its handler runs
    level = logging.getLogger("patchc").level
    assert main(["report", str(plan), *flags] if after else [*flags, "report", str(plan)]) == 0
    err = capsys.readouterr().err.split()
    assert {w for w in ("debug", "info", "warning") if w in err} == shown, err
    assert err.count("warning") == 1, err  # not also through the last-resort handler
    assert logging.getLogger("patchc").level == level and not logging.getLogger("patchc").handlers


def test_verbose_flags_before_and_after_the_command_add_up(tmp_path, monkeypatch):
    from patchc.job import cli

    seen = []
    monkeypatch.setattr(cli, "cmd_report", lambda args: seen.append(args.verbose) or 0)
    plan = tmp_path / "plan.patch"
    plan.write_bytes(b"")
    cases = {("-v", "report", str(plan), "-v"): 2, ("report", str(plan), "-vv"): 2, ("-v", "report", str(plan)): 1}
    for argv, count in cases.items():
        assert main(list(argv)) == 0 and seen.pop() == count, argv


def test_patchc_warnings_read_as_one_line_from_a_shell(tmp_path, capsys, monkeypatch):
    """Run from a shell (`main()` with sys.argv), a warning of patchc's prints as `patchc <command>: warning:
    ...` (it printed Python's `.../rescore.py:84: UserWarning:` and the source line); another library's keeps
    Python's form. Called with its arguments (a test, a notebook), `main` leaves warnings to the caller."""
    import warnings

    from patchc.job import cli

    import patchc

    ours = str(Path(patchc.__file__).parent / "job" / "rescore.py")
    venv = "/home/u/patchc/.venv/lib/python3.11/site-packages/torch/nn/module.py"  # a clone named patchc

    def fake_report(args):
        warnings.warn_explicit("--offload on cpu: only copies", UserWarning, ours, 84)
        warnings.warn_explicit("a library's own", UserWarning, venv, 7)  # its venv's torch: not patchc's
        return 0

    monkeypatch.setattr(cli, "cmd_report", fake_report)
    plan = tmp_path / "plan.patch"
    plan.write_bytes(b"")
    monkeypatch.setattr(sys, "argv", ["patchc", "report", str(plan)])
    with pytest.warns(UserWarning) as seen:  # what the process's handler would print in Python's form
        assert main() == 0
    assert [str(w.message) for w in seen] == ["a library's own"]  # patchc's went to stderr instead:
    err = capsys.readouterr().err
    assert err == "patchc report: warning: --offload on cpu: only copies\n", err
    with pytest.warns(UserWarning, match="only copies"):  # called with arguments: recorded as usual
        assert main(["report", str(plan)]) == 0
