"""The README's quality table is printed by benchmarks/quality_table.py --summary: its arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def quality_table():
    return load_benchmark("quality_table")


def _record(seed: int, ppl: dict[str, float], trained: dict[str, float] | None, recipe: dict) -> dict:
    rows = [{"name": n, "perplexity": v, **({} if trained is None else {"ppl training documents": trained[n]})}
            for n, v in ppl.items()]
    return {"seed": seed, "recipe": recipe, "rows": rows}


def test_summary_means_the_newest_run_of_each_seed_and_closes_the_gap_per_column(quality_table, tmp_path):
    old, new = {"steps": 100}, {"steps": 300}
    names = ("dense", "learned 2:4", "PATCH joint 35%")
    records = [
        _record(0, dict(zip(names, (5.0, 9.0, 1.0))), None, old),             # another recipe: ignored
        _record(0, dict(zip(names, (5.0, 9.0, 8.0))), None, new),             # superseded by the next seed-0 run
        _record(0, dict(zip(names, (5.0, 9.0, 7.0))), dict(zip(names, (6.0, 10.0, 9.0))), new),
        _record(1, dict(zip(names, (5.0, 11.0, 7.0))), dict(zip(names, (6.0, 10.0, 7.0))), new),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    text = quality_table.summary(path)
    assert "seeds [0, 1]" in text
    assert "| PATCH joint 35% | 7.00 ± 0.00 | 8.00 ± 1.00 | ×1.40 |" in text
    # held out: learned 2:4 10, PATCH 7, dense 5 -> 60%; training documents: 10, 8, 6 -> 50%
    assert "- PATCH joint 35%: closes 60% held out, 50% on training documents of the dense → learned 2:4 gap" in text


def test_summary_leaves_out_a_gap_the_baseline_does_not_open(quality_table, tmp_path):
    # Recovered weights fit their training text about as well as dense: no share of a ~0 gap is printed.
    names = ("dense", "learned 2:4 + recovery", "PATCH joint 35% + recovery")
    record = _record(0, dict(zip(names, (5.0, 7.0, 6.0))), dict(zip(names, (6.0, 6.02, 5.5))), {"steps": 300})
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert "- PATCH joint 35% + recovery: closes 50% held out of the dense → learned 2:4 + recovery gap" in \
        quality_table.summary(path)


def test_a_recipe_from_before_the_temperature_was_recorded_sampled_at_one(quality_table, tmp_path):
    names = ("dense", "learned 2:4", "PATCH joint 35%")
    records = [
        _record(0, dict(zip(names, (5.0, 9.0, 7.0))), None, {"steps": 300}),  # recorded before: 1.0
        _record(1, dict(zip(names, (5.0, 11.0, 9.0))), None, {"steps": 300, "self_temperature": 1.0}),
        _record(2, dict(zip(names, (5.0, 9.0, 1.0))), None, {"steps": 300, "self_temperature": 1.2}),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    assert "seeds [0, 1]" in quality_table.summary(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "seeds [2]" in quality_table.summary(path)  # another temperature is another recipe


def test_plot_quality_draws_the_latest_recipe_and_skips_missing_rows(tmp_path):
    """benchmarks/plot_quality.py (the README's picture) from a records file with some rows absent."""
    import subprocess
    import sys

    recipe = {"steps": 300, "tile": [16, 16]}
    names = ("dense", "learned 2:4", "PATCH joint 35%", "PATCH joint 45%", "wanda 2:4 (one-shot)")
    records = [_record(s, dict(zip(names, (5.0, 9.0 + s, 7.0, 8.0, 70.0))), None, recipe) for s in (0, 1)]
    for r in records:
        for row in r["rows"]:
            row["ppl wikitext2_raw_test.txt"] = 20 * row["perplexity"]
    path, out = tmp_path / "results.jsonl", tmp_path / "pic" / "quality.png"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    script = Path(__file__).parents[1] / "benchmarks" / "plot_quality.py"
    proc = subprocess.run([sys.executable, str(script), "--results", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert [p.name for p in out.parent.iterdir()] == ["quality.png"]  # written atomically: no temp file left
