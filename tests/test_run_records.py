"""patchc's JSON records read back (run.json, rows.json, report.json, the claim): a damaged or hand-edited one
is one line naming the file, why, and what to do; never a traceback, a bare KeyError or a flag never typed."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from patchc.ir import TilePlan
from patchc.job import runs
from patchc.job.cli import main
from patchc.job.options import PruneOptions
from patchc.utils.files import RecordError, read_record


@pytest.mark.parametrize("text, why", [
    ("[1, 2, 3]", "a list, not an object"),
    ("", "empty"),
    ("{not json", "not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ('{"steps": 6}', "no 'settings'"),
    ('{"settings": "oops", "steps": 6}', "'settings' is a string, not an object"),
    ('{"settings": {}, "steps": true}', "'steps' is true / false, not an integer"),
])
def test_a_record_that_is_not_one_names_its_file_why_and_what_to_do(tmp_path, text, why):
    path = tmp_path / "run.json"
    path.write_text(text)
    with pytest.raises(RecordError) as err:
        read_record(path, "run", "start again", needs={"settings": dict, "steps": int})
    assert str(err.value) == f"{path}: not a patchc run record ({why}); start again"
    path.write_text('{"settings": {}, "steps": 6, "note": null}')
    assert read_record(path, "run", "-", needs={"steps": int}, may={"note": dict, "other": list})["steps"] == 6


def _crashed_run(folder):
    folder.mkdir()
    runs.check_settings(folder, PruneOptions(out=str(folder)), resume=False)
    (folder / runs.CHECKPOINT).write_bytes(b"")
    return json.loads((folder / runs.SETTINGS).read_text())


@pytest.mark.parametrize("edit, why", [
    (lambda r: [1, 2, 3], "a list, not an object"),
    (lambda r: r | {"settings": "oops"}, "'settings' is a string, not an object"),
    (lambda r: {k: v for k, v in r.items() if k != "settings"}, "no 'settings'"),
    (lambda r: r | {"steps": "6"}, "'steps' is a string, not an integer"),
])
def test_resume_of_a_damaged_run_json_says_which_file(tmp_path, capsys, monkeypatch, edit, why):
    """It raised TypeError from `OLDER_RUNS | saved["settings"]`, or printed `error: settings` (a KeyError)."""
    monkeypatch.setattr("patchc.job.prune.load_bundle", lambda *_: pytest.fail("the model loaded"))
    folder = tmp_path / "run"
    record = _crashed_run(folder)
    (folder / runs.SETTINGS).write_text(json.dumps(edit(record)))
    assert main(["prune", "--out", str(folder), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"patchc prune: error: {folder / runs.SETTINGS}: not a patchc run record ({why}); its settings "
                   "cannot be checked, so start again with --overwrite instead of --resume, or in another --out")


@pytest.mark.parametrize("edit, why", [
    (lambda r: [1, 2, 3], "a list, not an object"),
    (lambda r: r | {"settings": "oops"}, "'settings' is a string, not an object"),
    (lambda r: r | {"settings": r["settings"] | {"batch_size": "4"}}, "settings: 'batch_size' is a string, not an "
                                                                       "integer"),
    (lambda r: r | {"settings": r["settings"] | {"tau": "x"}}, "settings: 'tau' is a string, not a list"),
    (lambda r: r | {"settings": r["settings"] | {"tile": ["x"]}}, "settings: --tile must be two ints"),
])
def test_recover_blames_a_damaged_run_json_not_a_flag(tmp_path, edit, why):
    """`patchc recover` raised AttributeError / TypeError, or `--tile must be two ints` of a flag never typed."""
    from patchc.job.recover import run_options

    folder = tmp_path / "run"
    record = _crashed_run(folder)
    assert run_options(folder / runs.SETTINGS) == PruneOptions(out=None, **{
        k: tuple(v) if isinstance(v, list) else v for k, v in record["settings"].items()})
    (folder / runs.SETTINGS).write_text(json.dumps(edit(record)))
    with pytest.raises(RecordError, match=rf"^{folder / runs.SETTINGS}: not a patchc run record \({why}.*\); "
                                          "restore the run's run.json, or move it away to recover with the "
                                          "settings its plan.patch records$"):
        run_options(folder / runs.SETTINGS)


def test_export_and_report_name_a_report_json_that_is_not_one(tmp_path, capsys):
    """A list raised AttributeError in `patchc export` (model_spec), "config": "oops" one in `patchc report`."""
    from patchc.export.pretrained import recorded_spec

    plan = TilePlan()
    plan.save(tmp_path / "plan.patch")
    (tmp_path / "report.json").write_text("[1]")
    with pytest.raises(RecordError, match=r"report.json: not a patchc report record \(a list, not an object\); "
                                          r"pass model= \(CLI: --model\)"):
        recorded_spec(tmp_path, plan)
    (tmp_path / "report.json").write_text(json.dumps({"model": "m", "config": "oops", "results": []}))
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"patchc report: error: {tmp_path / 'report.json'}: not a patchc report record ('config' is a string, not "
        "an object); move it away to redraw the plots only")


def test_a_rows_entry_without_its_inputs_is_scored_again(tmp_path, caplog):
    """read_rows accepted it, then `KeptRows.get` raised KeyError: `patchc prune: error: inputs`."""
    from patchc.job.resume import KeptRows, read_rows

    entry = {"row": {"name": "dense", "perplexity": 5.0}}
    (tmp_path / runs.ROWS).write_text(json.dumps({"format": "patchc.rows", "version": 1, "rows": [entry]}))
    with caplog.at_level(logging.WARNING):
        assert read_rows(tmp_path / runs.ROWS) is None
        kept = KeptRows(tmp_path, dataclasses.replace(PruneOptions(), out=str(tmp_path)))
    assert kept.get("dense") is None
    assert "rows.json: not a patchc rows record (entry 0 is not a row with its name and inputs)" in caplog.text


def test_a_damaged_claim_reads_as_busy(tmp_path):
    """A claim file holding a JSON list raised AttributeError (`held.get`)."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / runs.CLAIM).write_text("[1]")
    with pytest.raises(runs.RunError, match=r"another patchc run \(pid \? on \?, started \?\) is using it"):
        runs.claim_run_dir(folder, tmp_path, "x", resume=False)
