"""How much of the dense -> learned 2:4 gap PATCH closes at each sparsity, on held-out text, over seeds.

    python benchmarks/gap_by_sparsity.py                       # seeds 0 1 2, sparsity 5 15 25 35 45%
    python benchmarks/gap_by_sparsity.py --summary             # the table and picture from the records

stories260K under the job's own recipe and stages (`patchc.job.stages`, as `patchc prune --sparsity S --seed N`
trains and scores): per seed, the dense model and learned 2:4 once, then PATCH joint at each sparsity. A row
closes (learned 2:4 - PATCH) / (learned 2:4 - dense) of the gap in held-out perplexity, seed for seed (each
seed's own learned 2:4). Appends one record per seed to `benchmarks/results/gap_by_sparsity.jsonl` and draws
`docs/gap_by_sparsity.png`: the share closed against sparsity, mean +- std, beside issue 15's 65% at 35%.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import statistics
from pathlib import Path

import torch

from patchc.job.corpus import load_data
from patchc.job.model import choose_threads, with_tile
from patchc.job.options import PruneOptions
from patchc.job.prune import cache_dir
from patchc.job.stages import calibrate, evaluate, train
from patchc.models import load_model
from patchc.utils.env import device_name, versions
from patchc.utils.files import write_bytes_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gap_by_sparsity.jsonl"
PICTURE = ROOT / "docs" / "gap_by_sparsity.png"
WIKI = "wikitext2_raw_test.txt"


def score(bundle, model, data, opts: PruneOptions) -> dict[str, float]:
    m = evaluate(bundle, model, data, opts)
    return {"perplexity": m["perplexity"], "wikitext2": m["extra"][WIKI]}


def run_seed(seed: int, sparsities: list[float]) -> list[dict]:
    """dense, learned 2:4 and PATCH joint at each sparsity, for one seed."""
    opts = PruneOptions(seed=seed, progress=False, out="runs/gap")
    bundle = load_model(opts.model)
    choose_threads(opts, bundle.model)
    opts = with_tile(opts, bundle)
    data = load_data(bundle, opts, cache_dir=cache_dir(opts))
    calib = calibrate(bundle, data, opts)
    rows = [{"name": "dense", "sparsity": 0.0, **score(bundle, bundle.model, data, opts)}]
    runs = [("learned 2:4", dict(variant="nm", sparsity=0.5))]
    runs += [(f"PATCH joint {s * 100:g}%", dict(sparsity=s)) for s in sparsities]  # 12.5% stays apart from 12%
    for name, changes in runs:
        run_opts = dataclasses.replace(opts, **changes)
        plan, _ = train(bundle, run_opts.patch_config(), data, run_opts, calib, None, False)
        rows.append({"name": name, "sparsity": round(plan.sparsity, 4),
                     **score(bundle, plan.apply(bundle.reload()), data, run_opts)})
        print(f"seed {seed}  {name:<16} {rows[-1]['perplexity']:8.3f}  WikiText-2 {rows[-1]['wikitext2']:8.2f}",
              flush=True)
    return rows


def closed(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """{PATCH row: (its sparsity, the share of the dense -> learned 2:4 held-out gap it closes)} for one seed."""
    by_name = {r["name"]: r for r in rows}
    dense, nm = by_name["dense"]["perplexity"], by_name["learned 2:4"]["perplexity"]
    return {r["name"]: (r["sparsity"], (nm - r["perplexity"]) / (nm - dense))
            for r in rows if r["name"].startswith("PATCH")}


def table(records: list[dict]) -> str:
    """Mean +- std over the records (one per seed) of each row, and of the share each PATCH row closes (over
    the seeds that ran it)."""
    shares = [closed(r["rows"]) for r in records]
    lines = [f"seeds {[r['seed'] for r in records]}", "",
             "| row | held-out perplexity | WikiText-2 | gap closed |", "|---|---:|---:|---:|"]
    for name in dict.fromkeys(row["name"] for r in records for row in r["rows"]):
        rows = [row for r in records for row in r["rows"] if row["name"] == name]
        held = [row["perplexity"] for row in rows]
        s = [share[name][1] for share in shares if name in share]
        cell = f"{statistics.mean(s):.1%} ± {statistics.pstdev(s):.1%}" if s else ""
        lines.append(f"| {name} | {statistics.mean(held):.3f} ± {statistics.pstdev(held):.3f} | "
                     f"{statistics.mean(row['wikitext2'] for row in rows):.1f} | {cell} |")
    return "\n".join(lines)


def draw(records: list[dict], path: Path = PICTURE) -> None:
    """The share closed against sparsity, mean +- std over the records, beside the target and the paper's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = [closed(r["rows"]) for r in records]
    at = {n: x for share in shares for n, (x, _) in share.items()}  # row -> its sparsity
    names = sorted(at, key=at.get)
    xs = [at[n] * 100 for n in names]
    mean = [statistics.mean(s[n][1] for s in shares if n in s) * 100 for n in names]
    std = [statistics.pstdev(s[n][1] for s in shares if n in s) * 100 for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.errorbar(xs, mean, yerr=std, marker="o", color="#1b9e77", capsize=3,
                label=f"PATCH joint (mean ± std, {len(records)} seeds)")
    ax.plot([35], [65], marker="*", markersize=12, color="#d95f02", linestyle="none", label="issue 15's target")
    ax.vlines(36, 33, 44, linewidth=6, color="#bbbbbb", label="the paper's Qwen-2.5 0.5B and LLaMA-3.2 1B at 35%")
    ax.set_xlabel("sparsity (%): 2:4 tiles are twice this share of the tiles")
    ax.set_ylabel("dense → learned 2:4 gap closed (%)")
    ax.set_title("stories260K, held-out TinyStories, masks only")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


def read(path: Path) -> list[dict]:
    """The newest record of each seed."""
    if not path.exists():
        raise SystemExit(f"{path}: no records yet (run benchmarks/gap_by_sparsity.py without --summary first)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted({r["seed"]: r for r in records}.values(), key=lambda r: r["seed"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.05, 0.15, 0.25, 0.35, 0.45])
    parser.add_argument("--summary", action="store_true", help="only the table and picture from the records")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--picture", type=Path, default=PICTURE)
    args = parser.parse_args(argv)
    if not args.summary:
        for seed in args.seeds:
            rows = run_seed(seed, args.sparsity)  # first: it sets the thread count the device line names
            record = {"date": datetime.date.today().isoformat(), "device": device_name("cpu"),
                      "versions": versions(), "seed": seed, "rows": rows}
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with args.results.open("a") as f:
                f.write(json.dumps(record) + "\n")
    records = read(args.results)
    print(table(records))
    draw(records, args.picture)
    print(f"picture: {args.picture}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
