"""Runs are never lost: claimed folders, resume that checks its settings, eval on the plan's own split,
exact resume after SIGKILL at a random step (issue 17's findings, CPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from patchc.ir import TilePlan
from patchc.job import runs
from patchc.job.cli import main
from patchc.job.options import PruneOptions
from tests.conftest import STORIES, TINYSTORIES, needs_shared

QUICK = ["--steps", "6", "--batch-size", "4", "--calib-blocks", "4", "--no-progress", "--no-plots", "--no-baselines",
         "--prior", "magnitude", "--self-tokens", "258", "--eval-data"]


# -- claims ---------------------------------------------------------------------------------------------


def test_two_runs_never_share_a_default_folder(tmp_path):
    a = runs.claim_run_dir(None, tmp_path, "stories260K", resume=False)
    b = runs.claim_run_dir(None, tmp_path, "stories260K", resume=False)  # a still holds its claim
    assert a != b and {a.name, b.name} == {"stories260K", "stories260K-2"}
    with pytest.raises(runs.RunError, match=r"another patchc run \(pid \d+"):
        runs.claim_run_dir(a, tmp_path, "x", resume=False)
    runs.release(a)
    assert runs.claim_run_dir(a, tmp_path, "x", resume=False) == a


def test_a_stale_claim_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "run"
    folder.mkdir()
    import socket

    (folder / runs.CLAIM).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    assert runs.claim_run_dir(folder, tmp_path, "x", resume=False) == folder
    assert json.loads((folder / runs.CLAIM).read_text())["pid"] == os.getpid()


def test_a_claim_is_taken_over_only_where_its_pid_can_be_checked(tmp_path):
    """A claim names its owner's PID namespace: a dead pid of this namespace is stale, while the same pid number
    in a container sharing the host's name (its own namespace) may be a live run there: left to the user."""
    import socket

    from patchc.utils.owners import host_name, pid_namespace

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    for ns, taken in ((pid_namespace(), True), (pid_namespace() + 1, False)):
        folder = tmp_path / f"run{ns}"
        folder.mkdir()
        (folder / runs.CLAIM).write_text(json.dumps({"pid": dead, "host": socket.gethostname(),
                                                     "owner": f"{dead}-{ns}@{host_name()}"}))
        if taken:
            assert runs.claim_run_dir(folder, tmp_path, "x", resume=False) == folder
            assert json.loads((folder / runs.CLAIM).read_text())["pid"] == os.getpid()
        else:
            with pytest.raises(runs.RunError, match=rf"pid {dead} on .* is using it; if that machine no longer runs "
                                                    r"it, delete .*\.patchc-run and run again"):
                runs.claim_run_dir(folder, tmp_path, "x", resume=False)


def test_a_users_own_folder_is_never_written_unasked(tmp_path):
    """A non-empty --out that is no run had its report.md (plan.patch, tile maps) overwritten silently."""
    users = tmp_path / "stories260K"
    _users(users)
    with pytest.raises(runs.RunError, match="is not a patchc run folder and holds notes.txt, report.md"):
        runs.claim_run_dir(users, tmp_path, "x", resume=False)
    assert sorted(p.name for p in users.iterdir()) == ["notes.txt", "report.md"]  # not claimed
    assert runs.claim_run_dir(None, tmp_path, "stories260K", resume=False).name == "stories260K-2"  # numbering
    assert runs.claim_run_dir(users, tmp_path, "x", resume=False, overwrite=True) == users  # asked for
    (tmp_path / "empty").mkdir()
    assert runs.claim_run_dir(tmp_path / "empty", tmp_path, "x", resume=False) == tmp_path / "empty"


def test_a_claim_from_another_machine_says_how_to_free_it(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / runs.CLAIM).write_text(json.dumps({"pid": 1, "host": "spot-vm-7", "started": "2026-11-29T10:00:00"}))
    with pytest.raises(runs.RunError, match=r"pid 1 on spot-vm-7, started 2026-11-29T10:00:00\) is using it; if that "
                                            r"machine no longer runs it, delete .*\.patchc-run and run again"):
        runs.claim_run_dir(folder, tmp_path, "x", resume=True)


def _finished(folder):
    folder.mkdir()
    (folder / "report.json").write_text("{}")


def _users(folder):
    folder.mkdir()
    for name in ("report.md", "notes.txt"):
        (folder / name).write_text("the user's own")


def _crashed(folder, **changes):
    folder.mkdir()
    runs.check_settings(folder, dataclasses.replace(PruneOptions(out=str(folder)), **changes), resume=False)
    (folder / runs.CHECKPOINT).write_bytes(b"")


@pytest.mark.parametrize("make, args, message", [
    (lambda d: (d.parent / "file").write_text("x"), ["--out", "{file}/run"], "is a file, not a folder"),
    (_finished, ["--out", "{d}"], "already holds a finished run"),
    (_crashed, ["--out", "{d}"], "holds a training checkpoint"),
    (lambda d: None, ["--resume"], "--resume needs --out"),
    (lambda d: None, ["--out", "{d}", "--resume"], "has no checkpoint"),
    (lambda d: _crashed(d, lr=0.01), ["--out", "{d}", "--resume"], "--lr 0.01 (now 0.001)"),
    (_users, ["--out", "{d}"], "run is not a patchc run folder and holds notes.txt, report.md; choose a new or empty "
                               "--out, or pass --overwrite"),
], ids=["out-under-a-file", "finished", "checkpoint", "resume-without-out", "resume-nothing", "resume-changed",
        "users-folder"])
def test_a_wrong_out_fails_before_the_model_loads(tmp_path, capsys, monkeypatch, make, args, message):
    """Loading a model and generating its text take minutes on a real model: --out is checked first."""
    def load(*_):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr("patchc.job.prune.load_bundle", load)
    folder = tmp_path / "run"
    make(folder)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    args = [a.format(d=folder, file=tmp_path / "file") for a in args]
    assert main(["prune", *args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("flag", ["--data", "--eval-data", "--train-extra"])
@pytest.mark.parametrize("kind", ["missing", "folder", "device"])
def test_a_text_file_that_is_not_one_fails_before_the_model_loads(tmp_path, capsys, monkeypatch, flag, kind):
    def load(*_):
        raise AssertionError("the model was loaded before the text files were checked")

    monkeypatch.setattr("patchc.job.prune.load_bundle", load)
    path, why = {"missing": (tmp_path / "notes.txt", "no such file"),
                 "folder": (tmp_path, f"is a folder; name its files (e.g. {tmp_path / '*.txt'})"),
                 "device": ("/dev/null", "is not a regular file")}[kind]
    assert main(["prune", flag, str(path), "--no-progress", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{flag} {path}: {why}")
    assert not (tmp_path / "run").exists()


def test_eval_names_its_text_files_by_its_own_flags(tmp_path, capsys, monkeypatch):
    """`patchc eval` checks its files as `prune` does, before the model loads, naming --text for the files
    it scores whole and the plan's training files beside a --data it cannot find."""
    def load(*_, **__):
        raise AssertionError("the model was loaded before the text files were checked")

    monkeypatch.setattr("patchc.job.model.load_bundle", load)
    plan = tmp_path / "plan.patch"
    TilePlan(meta={"data": {"files": [str(tmp_path / "gone.txt")]}}).save(plan)
    assert main(["eval", str(plan), "--data", str(tmp_path)]) == 2
    trained_on = f"(the plan was trained on {tmp_path / 'gone.txt'})"
    assert capsys.readouterr().err.strip().endswith(
        f"--data {tmp_path}: is a folder; name its files (e.g. {tmp_path / '*.txt'}) {trained_on}")
    assert main(["eval", str(plan)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--data {tmp_path / 'gone.txt'}: no such file {trained_on}")
    (tmp_path / "real.txt").write_text("one story\n\nanother story\n")
    assert main(["eval", str(plan), "--data", str(tmp_path / "real.txt"), "--text", str(tmp_path / "wiki.txt")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--text {tmp_path / 'wiki.txt'}: no such file")


@needs_shared
def test_concurrent_prunes_pick_distinct_folders(tmp_path):
    """Two `patchc prune` processes started together (default --out) end in two folders, both finished."""
    # real text only and no --eval-data files: nothing to generate, one text to score
    cmd = [sys.executable, "-m", "patchc", "prune", "--steps", "2", "--batch-size", "2", "--no-baselines", "--no-plots",
           "--prior", "magnitude", "--no-progress", "--threads", "1", "--train-data", "real", "--eval-data"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-500:] for o in outs]
    finished = sorted(p.parent.name for p in (tmp_path / "runs").glob("*/report.json"))
    assert finished == ["stories260K", "stories260K-2"]
    assert not list((tmp_path / "runs").glob(f"*/{runs.CLAIM}"))  # claims released


# -- resume ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    if not STORIES.exists():
        pytest.skip("needs ../shared")
    out = tmp_path_factory.mktemp("runs") / "run"
    assert main(["prune", "--out", str(out), *QUICK]) == 0
    return out


@needs_shared
@pytest.mark.parametrize("change, named", [
    (["--lr", "0.01"], "--lr 0.001 (now 0.01)"),
    (["--batch-size", "2"], "--batch-size 4 (now 2)"),
    (["--block-len", "64"], "--block-len 128 (now 64)"),
    (["--sparsity", "0.45"], "--sparsity 0.35 (now 0.45)"),
    (["--data", "COPY"], "--data"),
    (["--train-extra", "MORE"], "--train-extra none (now /"),
    (["--tile", "32", "32"], "--tile 16 16 (now 32 32)"),
    (["--no-bos"], "without --no-bos (now with)"),  # a switch reads as given or not (was `--bos true (now false)`)
])
def test_resume_names_each_changed_setting(finished_run, tmp_path, capsys, change, named):
    if change[-1] == "COPY":  # the same text under another name is other data as far as a resume knows
        change = ["--data", str(tmp_path / "copy.txt")]
        (tmp_path / "copy.txt").write_bytes(TINYSTORIES.read_bytes())
    if change[-1] == "MORE":
        change = ["--train-extra", str(tmp_path / "more.txt")]
        (tmp_path / "more.txt").write_text(" ".join(["A bird sang on the old red roof all day long."] * 30))
    args = ["prune", "--out", str(finished_run), *QUICK, "--resume"]
    assert main([*args, *change]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "was started with other settings" in err and named in err, err


@needs_shared
def test_resume_may_extend_but_not_shorten_and_never_restarts_silently(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["prune", "--out", str(out), *QUICK]) == 0
    (out / "report.json").unlink()  # as if it had crashed after training
    assert main(["prune", "--out", str(out), *QUICK]) == 2
    assert "holds a training checkpoint" in capsys.readouterr().err
    assert main(["prune", "--out", str(out), *QUICK, "--resume", "--steps", "4"]) == 2
    assert "a run can be extended, not shortened" in capsys.readouterr().err
    assert main(["prune", "--out", str(out), *QUICK[2:], "--steps", "9", "--resume"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["steps"] == 9 and report["train"]["schedule_steps"] == 6
    assert report["train"]["final"]["step"] == 9
    ckpt = torch.load(out / runs.CHECKPOINT, weights_only=True)
    assert ckpt["step"] == 9
    assert main(["prune", "--out", str(out), *QUICK, "--overwrite"]) == 0  # explicit fresh start
    assert json.loads((out / "report.json").read_text())["train"]["final"]["step"] == 6


def test_resume_reads_a_setting_an_older_run_json_lacks_as_what_that_run_did(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    opts = PruneOptions(out=str(folder))
    runs.check_settings(folder, opts, resume=False)
    (folder / runs.CHECKPOINT).write_bytes(b"")
    record = json.loads((folder / runs.SETTINGS).read_text())
    for key in ("train_extra", "train_data"):  # options newer than the run
        del record["settings"][key]
    (folder / runs.SETTINGS).write_text(json.dumps(record))
    with pytest.raises(runs.RunError, match=r'--train-data real \(now mix\)') as err:
        runs.check_settings(folder, opts, resume=True)  # such a run trained on real text alone
    assert "--train-extra" not in str(err.value)  # and on no extra text, as now
    assert runs.check_settings(folder, dataclasses.replace(opts, train_data="real"), resume=True) == opts.steps


def test_resume_without_a_checkpoint_is_an_error(tmp_path, capsys):
    if not STORIES.exists():
        pytest.skip("needs ../shared")
    assert main(["prune", "--out", str(tmp_path / "new"), *QUICK, "--resume"]) == 2
    assert "has no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


# -- eval on the recorded split -------------------------------------------------------------------------


@needs_shared
def test_eval_uses_the_plans_split_and_refuses_training_documents(finished_run, capsys):
    plan = TilePlan.load(finished_run / "plan.patch")
    split = plan.meta["data"]
    assert split["seed"] == 0 and split["files"] == [str(TINYSTORIES.resolve())] and split["train_documents"]
    capsys.readouterr()
    assert main(["eval", str(finished_run / "plan.patch")]) == 0
    printed = capsys.readouterr().out
    report = json.loads((finished_run / "report.json").read_text())
    patch_ppl = next(r["perplexity"] for r in report["results"] if r["name"].startswith("PATCH"))
    assert f"perplexity {patch_ppl:.4f}" in printed  # the same number the run reported
    assert main(["eval", str(finished_run / "plan.patch"), "--seed", "1"]) == 2
    assert "were used to train this plan" in capsys.readouterr().err
    assert main(["eval", str(finished_run / "plan.patch"), "--seed", "1", "--allow-overlap"]) == 0
    assert "documents seen in training" in capsys.readouterr().out


@needs_shared
def test_eval_refuses_a_model_with_other_weights(finished_run, tmp_path, capsys):
    raw = bytearray((STORIES / "stories260K.bin").read_bytes())
    weights = torch.frombuffer(raw, dtype=torch.float32, offset=28)  # llama2.c: 7 int32 header, then fp32
    weights.add_(1e-3 * torch.randn(weights.shape, generator=torch.Generator().manual_seed(0)))
    other = tmp_path / "noised.bin"
    other.write_bytes(bytes(raw))
    (tmp_path / "tok512.bin").write_bytes((STORIES / "tok512.bin").read_bytes())
    assert main(["eval", str(finished_run / "plan.patch"), "--model", str(other)]) == 2
    assert "this plan was made for other weights" in capsys.readouterr().err


# -- kill and resume ------------------------------------------------------------------------------------

_KILLED = textwrap.dedent("""
    import os, signal, sys, torch, patchc
    from torch import nn
    kill_at, ckpt = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    prog = patchc.transform(torch.export.export(model, (torch.randn(4, 32),)),
                            patchc.PatchConfig(tile=(16, 16), sparsity=0.35, steps=12))
    data = torch.randn(12, 4, 32, generator=torch.Generator().manual_seed(1))
    def batch(step):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return data[step]
    loss = lambda p, x: (p(x) - model(x)).pow(2).mean()
    patchc.train_masks(prog, batch, loss, checkpoint=ckpt, checkpoint_every=1, resume=True, progress=False)
    patchc.harden(prog).save(ckpt + ".plan")
""")


def test_a_run_killed_at_a_random_step_resumes_to_the_identical_plan(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_KILLED)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = lambda kill_at, ckpt: subprocess.run([sys.executable, str(script), str(kill_at), str(ckpt)],  # noqa: E731
                                               env=env, capture_output=True, text=True, timeout=300)
    straight = run(-1, tmp_path / "straight.ckpt")
    assert straight.returncode == 0, straight.stderr[-2000:]
    kill_at = random.Random(os.getpid()).randrange(1, 12)
    killed = run(kill_at, tmp_path / "killed.ckpt")
    assert killed.returncode == -9, f"kill at step {kill_at}: {killed.stderr[-2000:]}"
    resumed = run(-1, tmp_path / "killed.ckpt")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = (TilePlan.load(f"{tmp_path / name}.ckpt.plan") for name in ("straight", "killed"))
    for fqn, layer in a.layers.items():
        for part, t in layer.tensors().items():
            assert torch.equal(t, b.layers[fqn].tensors()[part]), f"killed at step {kill_at}: {fqn} {part} differs"


@needs_shared
def test_export_command_writes_a_folder_that_loads_back_to_the_plans_logits(finished_run, tmp_path, capsys,
                                                                           monkeypatch):
    import patchc

    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")  # the exact CPU path, not the interpreted kernels
    from patchc.models import load_model

    out = tmp_path / "exported"
    assert main(["export", str(finished_run), "--out", str(out)]) == 0
    assert str(out.resolve()) in capsys.readouterr().out
    bundle = load_model(STORIES / "stories260K.bin")
    pruned = TilePlan.load(finished_run / "plan.patch").apply(bundle.reload())
    ids = torch.tensor([bundle.tokenizer.encode("Once upon a time")])
    with torch.no_grad():
        assert torch.equal(patchc.from_pretrained(out)(ids), pruned(ids))
    assert main(["export", str(finished_run), "--out", str(out)]) == 2  # never over a folder by accident
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
