"""The README's quality numbers: the arithmetic of benchmarks/quality_table.py --summary, its picture, and of
benchmarks/gap_by_sparsity.py."""

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


def _gap_record(seed: int, nm: float, patch: dict[float, float]) -> dict:
    rows = [{"name": "dense", "sparsity": 0.0, "perplexity": 5.0, "wikitext2": 100.0},
            {"name": "learned 2:4", "sparsity": 0.5, "perplexity": nm, "wikitext2": 140.0}]
    rows += [{"name": f"PATCH joint {s * 100:g}%", "sparsity": s, "perplexity": p, "wikitext2": 120.0 + seed}
             for s, p in patch.items()]
    return {"seed": seed, "rows": rows}


def test_gap_by_sparsity_closes_each_seeds_own_gap_and_keeps_5_apart_from_15_25_35_45(tmp_path):
    """benchmarks/gap_by_sparsity.py: a row's share is taken against its own seed's learned 2:4, and a 5% row
    is never read as part of the 15% / 25% / 35% / 45% rows (whose names end in "5%" too)."""
    gap = load_benchmark("gap_by_sparsity")
    records = [
        _gap_record(0, 9.0, {0.05: 5.1, 0.15: 6.0, 0.35: 8.0}),  # old seed-0 run: superseded below
        _gap_record(0, 9.0, {0.05: 5.4, 0.15: 6.0, 0.35: 7.0}),
        _gap_record(1, 13.0, {0.05: 5.8, 0.15: 7.0, 0.35: 10.2}),
    ]
    # seed 0: gap 4 -> 90%, 75%, 50%; seed 1: gap 8 -> 90%, 75%, 35%
    shares = gap.closed(records[1]["rows"])
    assert {n: s for n, (s, _) in shares.items()} == {"PATCH joint 5%": 0.05, "PATCH joint 15%": 0.15,
                                                      "PATCH joint 35%": 0.35}
    assert [x for _, x in shares.values()] == pytest.approx([0.9, 0.75, 0.5])
    path = tmp_path / "gap.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    kept = gap.read(path)
    assert [r["seed"] for r in kept] == [0, 1] and kept[0] == records[1]
    text = gap.table(kept)
    assert "| PATCH joint 5% | 5.600 ± 0.200 | 120.5 | 90.0% ± 0.0% |" in text
    assert "| PATCH joint 15% | 6.500 ± 0.500 | 120.5 | 75.0% ± 0.0% |" in text
    assert "| PATCH joint 35% | 8.600 ± 1.600 | 120.5 | 42.5% ± 7.5% |" in text
    assert "| learned 2:4 | 11.000 ± 2.000 | 140.0 |  |" in text
    later = _gap_record(2, 9.0, {0.125: 6.0})  # a seed that ran another sparsity: its row alone, no KeyError
    text = gap.table(kept + [later])
    assert "| PATCH joint 12.5% | 6.000 ± 0.000 | 122.0 | 75.0% ± 0.0% |" in text
    assert "| PATCH joint 5% | 5.600 ± 0.200 | 120.5 | 90.0% ± 0.0% |" in text
    out = tmp_path / "pic" / "gap.png"
    out.parent.mkdir()
    gap.draw(kept + [later], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert [p.name for p in out.parent.iterdir()] == ["gap.png"]
