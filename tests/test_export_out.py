"""Where `patchc export` / `import` / `sample` / `recover` write: never over what they read, no hidden leftovers
of a killed run, and an unwritable place refused before any work, naming the folder given."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from patchc.export import ExportError, export_run, import_sparse
from patchc.export.outdir import prepare_out
from patchc.ir import TilePlan
from patchc.job.cli import main
from patchc.utils.files import check_apart
from patchc.utils.owners import host_name, owner_tag, pid_namespace
from tests.conftest import TinyMLP

ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def run(tmp_path):
    """runs/a (a plan.patch, a report.json and masks the export must never delete) beside runs/b."""
    model = TinyMLP()
    plan = TilePlan.from_masks(model, {"up.weight": torch.ones_like(model.up.weight, dtype=torch.bool)}, tile=(8, 8))
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        (runs / name).mkdir(parents=True)
        plan.save(runs / name / "plan.patch")
        (runs / name / "report.json").write_text('{"model_spec": "stories260K"}')
    return runs / "a"


def kept(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("where", ["itself", "its parent", "a link to it"])
def test_export_refuses_an_out_that_is_or_holds_its_run(run, where):
    out = {"itself": run, "its parent": run.parent, "a link to it": run.parent / "l"}
    if where == "a link to it":
        out[where].symlink_to(run)
    check_apart(run / "export", [("the run folder", run)], "")  # inside it: replacing it deletes nothing read
    how = {"itself": "is", "its parent": "holds", "a link to it": "is"}[where]
    before = {p: kept(p) for p in run.parent.iterdir() if p.is_dir() and not p.is_symlink()}
    with pytest.raises(ExportError, match=f"--out {out[where]} {how} the run folder {run}; choose an --out apart"):
        export_run(run, out[where], overwrite=True)
    assert {p: kept(p) for p in run.parent.iterdir() if p.is_dir() and not p.is_symlink()} == before


def test_export_of_a_plan_file_refuses_its_folder_and_the_model_it_loads(run, tmp_path):
    with pytest.raises(ExportError, match=f"--out {run} is the run folder {run}"):
        export_run(run / "plan.patch", run, overwrite=True)  # its report.json and masks are the run's too
    model = tmp_path / "models" / "dense"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    with pytest.raises(ExportError, match=f"--out {model.parent} holds the model {model}"):
        export_run(run, model.parent, model=str(model), overwrite=True)
    assert kept(model) == ["config.json"]


def test_cli_export_and_import_name_both_paths_in_one_line(run, tmp_path, capsys):
    assert main(["export", str(run), "--out", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err == (f"patchc export: error: --out {run} is the run folder {run}; choose an --out apart from it "
                   "(inside it is fine)\n")
    assert kept(run) == ["plan.patch", "report.json"]
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    assert main(["import", str(src), "--out", str(src), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err == (f"patchc import: error: --out {src} is the checkpoint {src}; choose an --out apart from it "
                   "(inside it is fine)\n")
    assert kept(src) == ["config.json"]
    with pytest.raises(ExportError, match=f"--out {tmp_path} holds the checkpoint {src}"):
        import_sparse(src, tmp_path, overwrite=True)
    assert os.path.isfile(src / "config.json")


# --- what a killed export leaves beside --out --------------------------------------------------------------
KILLED = """
import os, signal, sys
from pathlib import Path
from patchc.export import outdir

real = os.replace
def replace(src, dst):  # killed between atomic_dir's two renames: --out is moved aside, the new one not yet in
    real(src, dst)
    if sys.argv[2] == "between" and Path(dst).name == "x":
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
with outdir.atomic_dir(Path(sys.argv[1]), overwrite=True) as tmp:
    (tmp / "model.safetensors").write_bytes(bytes(3 << 20))
    if sys.argv[2] == "writing":
        os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_export(out, when: str) -> None:
    """Run atomic_dir onto `out` in a process SIGKILLed while `when` ("writing", "between" the renames)."""
    done = subprocess.run([sys.executable, "-c", KILLED, str(out), when], env=os.environ | {"PYTHONPATH": ROOT})
    assert done.returncode == -signal.SIGKILL


def hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_killed_exports_temporary_folder_is_removed_by_the_next_one(tmp_path):
    out = tmp_path / "pruned"
    killed_export(out, "writing")
    (left,) = hidden(tmp_path)
    assert re.fullmatch(rf"\.pruned\.\d+-{pid_namespace()}@{re.escape(host_name())}\.\w{{8}}\.tmp", left), "owner"
    with pytest.warns(UserWarning, match=rf"--out {out}: removed 1 temporary folder\(s\) left by an export or "
                                         rf"import killed before it finished \(3\.1 MB: {re.escape(left)}\)$"):
        prepare_out(out, overwrite=False)
    assert hidden(tmp_path) == [] and not out.exists()


def test_a_kill_between_the_renames_puts_the_earlier_export_back(tmp_path):
    out = tmp_path / "pruned"
    out.mkdir()
    (out / "old.txt").write_text("the earlier export")
    killed_export(out, "between")
    assert not out.exists() and len(hidden(tmp_path)) == 2  # .old/x holds the earlier export; .tmp the new one
    with pytest.warns(UserWarning, match=rf"removed 2 .*; put back {out}, which it had moved aside into "
                                         r"\.pruned\.\d+-\d+@.*\.old$"):
        with pytest.raises(ExportError, match="not empty"):  # it is back: replacing it takes --overwrite again
            prepare_out(out, overwrite=False)
    assert kept(out) == ["old.txt"] and hidden(tmp_path) == []


def test_only_folders_whose_owner_is_gone_are_swept(tmp_path):
    """Removed: this host's and PID namespace's, whose process is gone. Only named: any other owner (another
    host, a container with its own PID namespace but the host's name) or none, since one may still be writing;
    a rule of "an hour untouched" would have removed import's decoded checkpoint, written once then read."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = f"{int(dead.stdout)}-{pid_namespace()}@{host_name()}"
    names = {
        "dead here": f".pruned.{here}.abcdefgh.tmp",
        "alive here": f".pruned.{owner_tag()}.bcdefghi.tmp",  # a concurrent export: kept, not named
        "other host": ".pruned.1-4026531836@elsewhere.cdefghij.old",
        "other container": f".pruned.{int(dead.stdout)}-{pid_namespace() + 1}@{host_name()}.defghijk.tmp",
        "unowned": ".pruned.efghijkl.tmp",  # written before owners were recorded
        "another --out": f".other.{here}.ghijklmn.tmp",
        "decoded, dead": f".patchc-import.{here}.hijklmno",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "part").write_bytes(b"x")
    out = tmp_path / "pruned"
    named = ", ".join(sorted(names[w] for w in ("other container", "other host", "unowned")))
    with pytest.warns(UserWarning, match=rf"removed 1 temporary folder.*{re.escape(names['dead here'])}\); left "
                                         rf"{re.escape(named)} \(0.0 kB\): another host's or container's"):
        prepare_out(out, overwrite=False)  # an export: not import's decoded checkpoints
    assert hidden(tmp_path) == sorted(name for what, name in names.items() if what != "dead here")
    with pytest.warns(UserWarning, match=f"removed 1 temporary folder.*{names['decoded, dead']}"):
        prepare_out(out, overwrite=False, decoded=True)  # an import's


def test_export_refuses_a_non_empty_out_before_the_model_loads(run, tmp_path, monkeypatch):
    import patchc.models

    monkeypatch.setattr(patchc.models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("mine")
    with pytest.raises(ExportError, match="taken: folder exists and is not empty"):
        export_run(run, tmp_path / "taken")


# --- a folder this process cannot write in: refused before any work, naming the folder given -------------------
@pytest.fixture
def deny(monkeypatch):
    """deny(folder): `folder` unwritable, chmod 555 (what a user other than root meets) and os.access saying so
    (for root); its mode comes back after the test (the module's run folder serves later tests)."""
    modes = {}

    def make(folder):
        folder.mkdir(exist_ok=True)
        modes[folder] = folder.stat().st_mode & 0o777
        folder.chmod(0o555)
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: not (
            os.path.realpath(p) == os.path.realpath(folder) and mode & os.W_OK) and real(p, mode, **kw))
        return folder

    yield make
    for folder, mode in modes.items():
        folder.chmod(mode)


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model fails the test: every refusal here comes first."""
    import patchc.job.model
    import patchc.job.prune
    import patchc.models

    def loaded(*a, **k):
        pytest.fail("the model loaded before the unwritable folder was refused")

    for module, name in ((patchc.models, "load_model"), (patchc.job.model, "load_bundle"),
                         (patchc.job.prune, "load_bundle")):
        monkeypatch.setattr(module, name, loaded)


@pytest.fixture(autouse=True)
def writable_again(tmp_path):
    yield
    for p in tmp_path.rglob("*"):  # pytest removes tmp_path later
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)


def test_export_and_import_into_an_unwritable_folder(run, tmp_path, monkeypatch, no_work, capsys, deny):
    ro = deny(tmp_path / "ro")
    assert main(["export", str(run), "--out", str(ro / "e")]) == 2
    denied = f"cannot write in {ro} (Permission denied)\n"
    assert capsys.readouterr().err == f"patchc export: error: --out {ro / 'e'}: {denied}"
    with pytest.raises(PermissionError, match=f"--out {ro / 'a' / 'b'}: cannot write in {ro} "):
        export_run(run, ro / "a" / "b")  # the folders mkdir would make: the nearest existing one is named
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    assert main(["import", str(src), "--out", str(ro / "served")]) == 2
    assert capsys.readouterr().err.endswith(f"--out {ro / 'served'}: cannot write in {ro} (Permission denied)\n")
    (tmp_path / "w").mkdir()
    taken = deny(tmp_path / "w" / "taken")  # replacing it moves it aside and empties it
    with pytest.raises(PermissionError, match=f"--out {taken}: cannot write in {taken} "):
        export_run(run, taken, overwrite=True)


def test_sample_recover_and_prune_into_an_unwritable_folder(run, tmp_path, monkeypatch, no_work, capsys, deny):
    from patchc.job.recover import run_recover

    ro = deny(tmp_path / "ro")
    small = ["--tokens", "60", "--block-len", "19", "--threads", "1", "--no-progress"]
    assert main(["sample", "--out", str(ro / "s.txt"), *small]) == 2
    denied = f"cannot write in {ro} (Permission denied)\n"
    assert capsys.readouterr().err == f"patchc sample: error: --out {ro / 's.txt'}: {denied}"
    assert main(["prune", "--out", str(ro / "run"), "--steps", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"patchc prune: error: --out {ro / 'run'}: {denied}"
    monkeypatch.chdir(ro)  # without --out: runs/<model> here
    assert main(["prune", "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == ("patchc prune: error: runs/ (the run folders without --out): cannot write in . "
                   "(Permission denied); pass --out\n")
    deny(run)
    with pytest.raises(PermissionError, match=rf"^{run}: cannot write in {run} \(Permission denied\); recovery writes"):
        run_recover(run)


def test_report_and_generate_into_an_unwritable_folder(run, tmp_path, monkeypatch, capsys, deny):
    """`patchc report` and `generate` failed on a hidden temp file, after drawing or compiling."""
    import importlib

    monkeypatch.setattr(importlib.import_module("patchc.job.report"), "redraw", lambda *a, **k: pytest.fail("drew"))
    monkeypatch.setattr(importlib.import_module("patchc.codegen.generate"), "generate",  # the module, not the function
                        lambda *a, **k: pytest.fail("it compiled"))
    ro = deny(tmp_path / "ro")
    denied = f"cannot write in {ro} (Permission denied)"
    for command in ("report", "generate"):
        assert main([command, str(run), "--out", str(ro / "x")]) == 2
        assert capsys.readouterr().err == f"patchc {command}: error: --out {ro / 'x'}: {denied}\n"
    deny(run)  # report's default: the plan's folder
    assert main(["report", str(run)]) == 2
    assert capsys.readouterr().err == (f"patchc report: error: {run} (the plan's folder): cannot write in {run} "
                                       "(Permission denied); pass --out\n")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a chmod 555 folder")
def test_a_chmod_555_folder_is_refused_by_what_it_says(tmp_path):
    from patchc.utils.files import check_writable

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(PermissionError, match=f"--out {ro / 'e'}: cannot write in {ro} \\(Permission denied\\)"):
        check_writable(ro, f"--out {ro / 'e'}")
