"""Where `patchc export` / `import` / `sample` / `recover` write: never over what they read, no hidden leftovers
of a killed run, and an unwritable place refused before any work, naming the folder given."""

from __future__ import annotations

import os

import pytest
import torch

from patchc.export import ExportError, export_run, import_sparse
from patchc.ir import TilePlan
from patchc.job.cli import main
from tests.conftest import TinyMLP


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


@pytest.mark.parametrize("where", ["itself", "its parent", "inside it", "a link to it"])
def test_export_refuses_an_out_that_is_holds_or_lies_in_its_run(run, where):
    out = {"itself": run, "its parent": run.parent, "inside it": run / "export", "a link to it": run.parent / "l"}
    if where == "a link to it":
        out[where].symlink_to(run)
    how = {"itself": "is", "its parent": "holds", "inside it": "lies inside", "a link to it": "is"}[where]
    before = {p: kept(p) for p in run.parent.iterdir() if p.is_dir() and not p.is_symlink()}
    with pytest.raises(ExportError, match=f"--out {out[where]} {how} the run folder {run}; choose an --out outside"):
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
    assert err == f"patchc export: error: --out {run} is the run folder {run}; choose an --out outside it\n"
    assert kept(run) == ["plan.patch", "report.json"]
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    assert main(["import", str(src), "--out", str(src), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err == f"patchc import: error: --out {src} is the checkpoint {src}; choose an --out outside it\n"
    assert kept(src) == ["config.json"]
    with pytest.raises(ExportError, match=f"--out {tmp_path} holds the checkpoint {src}"):
        import_sparse(src, tmp_path, overwrite=True)
    assert os.path.isfile(src / "config.json")
