"""The quality table as a picture: held-out perplexity against sparsity, every method, mean ± std over seeds.

    python benchmarks/plot_quality.py        # docs/quality_stories260K.png from the latest recipe's records

Reads `benchmarks/results/quality_stories260K.jsonl` (what `quality_table.py` appended: real runs, one
record per seed) and draws two panels, held-out TinyStories and WikiText-2, log-scaled: the PATCH rows as a
line over their sparsities, the 2:4 methods at 50%, dense as a dashed line. Nothing is measured here.
"""

from __future__ import annotations

import argparse
import io
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from quality_table import RESULTS, latest_scores  # noqa: E402

from patchc.utils.files import write_bytes_atomic  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "quality_stories260K.png"
# (row name in the records, label, marker, colour); the PATCH rows are drawn as lines below
ONE_SHOT = [("magnitude 2:4 (one-shot)", "magnitude 2:4", "v", "#9e9e9e"),
            ("wanda 2:4 (one-shot)", "Wanda 2:4", "^", "#7b7b7b"),
            ("sparsegpt 2:4 (one-shot)", "SparseGPT 2:4", "s", "#555555"),
            ("learned 2:4", "learned 2:4", "D", "#d95f02"),
            ("learned 2:4 + recovery", "learned 2:4 + recovery", "d", "#fdae6b"),
            ("PATCH tile-only 35%", "PATCH tile-only 35%", "x", "#7570b3")]
PATCH = [("PATCH joint {}%", "PATCH joint", "o", "#1b9e77"),
         ("PATCH joint {}% + recovery", "PATCH joint + recovery", "o", "#66c2a5")]
SPARSITIES = (25, 35, 45)


def stats(value: dict, name: str, metric: str) -> tuple[float, float] | None:
    scores = value.get((name, metric))
    return (statistics.mean(scores), statistics.pstdev(scores)) if scores else None


def draw_panel(ax, value: dict, metric: str, title: str) -> None:
    dense = stats(value, "dense", metric)
    if dense:
        ax.axhline(dense[0], color="black", ls="--", lw=1, label="dense")
    for row, label, marker, colour in PATCH:
        points = [(s, stats(value, row.format(s), metric)) for s in SPARSITIES]
        points = [(s, m) for s, m in points if m]
        if points:
            ax.errorbar([s for s, _ in points], [m[0] for _, m in points], yerr=[m[1] for _, m in points],
                        marker=marker, color=colour, label=label, capsize=3, lw=1.8)
    for row, label, marker, colour in ONE_SHOT:
        m = stats(value, row, metric)
        if m:
            x = 35 if "tile-only" in row else 50
            ax.errorbar([x], [m[0]], yerr=[m[1]], marker=marker, color=colour, label=label, capsize=3, ls="none", ms=7)
    ax.set_yscale("log")
    ax.set_xlabel("sparsity (%)")
    ax.set_xticks([25, 35, 45, 50])
    ax.set_xlim(21, 54)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    recipe, runs, metrics, value = latest_scores(args.results)
    second = next((k for k in metrics if k.startswith("ppl wikitext")), None)
    panels = [("perplexity", "held-out TinyStories (no run trained on it)")]
    if second:
        panels.append((second, "WikiText-2, first 16,384 tokens (another domain)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    for ax, (metric, title) in zip(axes[0], panels):
        draw_panel(ax, value, metric, title)
    axes[0][0].set_ylabel("perplexity (log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=9, frameon=False)
    seeds = sorted(r["seed"] for r in runs)
    fig.suptitle(f"stories260K, {recipe['tile'][0]}×{recipe['tile'][1]} tiles, {recipe['steps']} steps: "
                 f"mean ± std over seeds {', '.join(map(str, seeds))}", fontsize=12)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(args.out, buf.getvalue())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
