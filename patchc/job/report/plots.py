"""The report's pictures (PNG, like the paper's figures), drawn from a plan by `plot_plan(plan, out_dir)`:

    sparsity_per_block.png        parameter-weighted sparsity of each transformer block, with the
                                  global achieved (and target) sparsity as horizontal lines
    sparsity_per_projection.png   the same per projection type (q, k, v, o, gate, up, down, ...)
    sparsity_heatmap.png          blocks x projection types: which layers stay dense
    sparsity_per_expert.png       blocks x experts, for a plan with MoE experts: which experts stay dense
    tile_map_<layer>.png          the tile grid of a few layers (densest, middle, sparsest):
                                  dense vs 2:4 tiles

Example:
    >>> [p.name for p in plot_plan(TilePlan.load("runs/stories260K/plan.patch"), "runs/stories260K")][:2]
    ['sparsity_per_block.png', 'sparsity_per_projection.png']
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchc.job.report.stats import PROJECTION_ORDER, plan_stats, short_name
from patchc.utils.files import write_bytes_atomic

if TYPE_CHECKING:  # matplotlib and the plan IR load lazily: `import patchc` must stay light
    from matplotlib.figure import Figure

    from patchc.ir import LayerPlan, TilePlan

DPI = 120
# The plan-wide pictures, in the order report.md shows them (tile maps follow)
SUMMARY_PICTURES = ("sparsity_per_block.png", "sparsity_per_projection.png", "sparsity_heatmap.png",
                    "sparsity_per_expert.png")
# Colours: dense tiles dark (they cost the most bytes), 2:4 tiles light; colour-blind safe pair.
DENSE_COLOR = "#1f4e79"
SPARSE_COLOR = "#f4b942"
BAR_COLOR = "#4c72b0"


def _new_figure(size: tuple[float, float]) -> Figure:
    """A Figure on its own Agg canvas.

    Going through `Figure` + `FigureCanvasAgg` instead of pyplot renders with Agg without switching
    the process-wide backend (a user's notebook keeps its own) and leaves no global figure state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save_figure(fig: Figure, path: Path) -> Path:
    """Render to memory, then write atomically: a crash never leaves a truncated PNG behind."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.15)
    write_bytes_atomic(path, buf.getvalue())
    return path


def _reference_lines(ax: Any, stats: Mapping[str, Any]) -> None:
    """Global achieved / target sparsity and the 2:4 ceiling as horizontal lines."""
    ax.axhline(50.0, color="0.6", linestyle=":", linewidth=1.2, label="all 2:4 (50%)")
    if stats["target"] is not None:
        ax.axhline(100 * stats["target"], color="#c44e52", linestyle="--", linewidth=1.6,
                   label=f"target {stats['target']:.1%}")
    if not math.isnan(stats["global"]):
        ax.axhline(100 * stats["global"], color="#222222", linestyle="-", linewidth=1.6,
                   label=f"achieved (global) {stats['global']:.1%}")


def _bars(ax: Any, labels: list[str], values: list[float], annotate: bool) -> None:
    xs = list(range(len(values)))
    ax.bar(xs, [100 * v for v in values], color=BAR_COLOR, width=0.75, zorder=2)
    ax.set_xticks(xs, labels)
    ax.set_ylim(0, 60)  # 2:4 everywhere is 50%: keep a fixed scale so runs compare by eye
    ax.set_ylabel("sparsity (%)")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    if annotate:
        for x, v in zip(xs, values):
            ax.text(x, 100 * v + 0.8, f"{100 * v:.1f}", ha="center", va="bottom", fontsize=9)


def _plot_per_block(stats: Mapping[str, Any], title: str | None, path: Path) -> Path:
    labels = [str(b) for b in stats["per_block"]]
    values = list(stats["per_block"].values())
    if stats["other"] is not None:  # embeddings / heads, when they were planned
        labels.append("other")
        values.append(stats["other"])
    fig = _new_figure((max(6.0, min(16.0, 1.5 + 0.45 * len(values))), 4.5))
    ax = fig.add_subplot()
    _bars(ax, labels, values, annotate=len(values) <= 24)
    if len(labels) > 32:  # keep the block axis readable on deep models
        step = math.ceil(len(labels) / 32)
        for i, tick in enumerate(ax.get_xticklabels()):
            tick.set_visible(i % step == 0)
    return _finish_bars(fig, ax, stats, "transformer block", "Sparsity per block (parameter weighted)", title, path)


def _plot_per_projection(stats: Mapping[str, Any], title: str | None, path: Path) -> Path:
    labels = list(stats["per_projection"])
    values = list(stats["per_projection"].values())
    fig = _new_figure((max(6.0, 1.5 + 0.8 * len(values)), 4.5))
    ax = fig.add_subplot()
    _bars(ax, labels, values, annotate=True)
    return _finish_bars(fig, ax, stats, "projection", "Sparsity per projection type (parameter weighted)", title, path)


def _finish_bars(fig, ax, stats: Mapping[str, Any], xlabel: str, heading: str, title: str | None, path: Path) -> Path:
    """Reference lines, labels, legend outside the axes, optional suptitle; saved atomically."""
    _reference_lines(ax, stats)
    ax.set_xlabel(xlabel)
    ax.set_title(heading)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=12)
    return _save_figure(fig, path)


def _plot_heatmap(stats: Mapping[str, Any], title: str | None, path: Path) -> Path:
    projs = [p for p in PROJECTION_ORDER if any(key[1] == p for key in stats["grid"])]
    return _plot_grid(stats["grid"], list(stats["per_block"]), projs, "projection",
                      "Sparsity (%) per block and projection", title, path)


def _plot_experts(stats: Mapping[str, Any], title: str | None, path: Path) -> Path:
    blocks = sorted({b for b, _ in stats["experts"]})
    experts = sorted({e for _, e in stats["experts"]})
    return _plot_grid(stats["experts"], blocks, experts, "expert",
                      "Sparsity (%) of each MoE expert's weights per block", title, path)


def _plot_grid(cells: Mapping[tuple[Any, Any], float], rows: list, cols: list, xlabel: str, heading: str,
               title: str | None, path: Path) -> Path:
    """Blocks (rows) x `cols` heatmap of sparsity in %, each cell annotated while they stay legible."""
    import matplotlib
    import numpy as np

    grid = np.full((len(rows), len(cols)), np.nan)
    for (r, c), v in cells.items():
        grid[rows.index(r), cols.index(c)] = 100 * v
    height = max(3.5, min(18.0, 1.8 + 0.32 * len(rows)))
    fig = _new_figure((max(5.5, min(24.0, 2.5 + 0.75 * len(cols))), height))
    ax = fig.add_subplot()
    # grey: a cell this block does not have (or that was skipped)
    cmap = matplotlib.colormaps["YlGnBu"].with_extremes(bad="0.9")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=50, aspect="auto", interpolation="nearest")
    col_step = max(1, math.ceil(len(cols) / 32))
    ax.set_xticks(range(0, len(cols), col_step), [str(c) for c in cols[::col_step]])
    step = max(1, math.ceil(len(rows) / 40))
    ax.set_yticks(range(0, len(rows), step), [str(b) for b in rows[::step]])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("transformer block")
    ax.set_title(f"{heading}\n(0 = all tiles dense, 50 = all tiles 2:4)", fontsize=11)
    if len(rows) <= 48 and len(cols) <= 32:
        for i in range(len(rows)):
            for j in range(len(cols)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=8,
                            color="white" if grid[i, j] > 30 else "black")
    fig.colorbar(im, ax=ax, label="sparsity (%)", shrink=0.9)
    if title:
        fig.suptitle(title, fontsize=12)
    return _save_figure(fig, path)


def _plot_tile_map(layer: LayerPlan, title: str | None, path: Path) -> Path:
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    from patchc.ir import TILE_DENSE

    kinds = layer.kinds.cpu().numpy()
    tn, tk = kinds.shape
    cell = min(10.0 / tk, 8.0 / tn, 0.45)  # inches per tile: big grids shrink, small ones stay legible
    fig = _new_figure((max(4.5, tk * cell + 3.0), max(3.0, tn * cell + 1.6)))
    ax = fig.add_subplot()
    # kinds: 0 dense, 1 2:4 (any later kind shows as 2:4's colour rather than failing the picture)
    sparse = (kinds != TILE_DENSE).astype(float)
    ax.imshow(sparse, cmap=ListedColormap([DENSE_COLOR, SPARSE_COLOR]), vmin=0, vmax=1,
              interpolation="nearest", aspect="equal")
    if max(tn, tk) <= 64:  # tile borders help on small grids, but turn into noise on big ones
        ax.set_xticks([x - 0.5 for x in range(1, tk)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, tn)], minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("K tiles")
    ax.set_ylabel("N tiles")
    b1, b2 = layer.tile
    ax.set_title(f"{layer.name}\n{layer.shape[0]}x{layer.shape[1]}, tile {b1}x{b2}, density {layer.density:.1%}",
                 fontsize=10)
    handles = [Patch(color=DENSE_COLOR, label=f"dense ({layer.n_dense} tiles)"),
               Patch(color=SPARSE_COLOR, label=f"2:4 ({layer.n_sparse} tiles)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return _save_figure(fig, path)


def pick_tile_map_layers(plan: TilePlan, count: int = 3) -> list[str]:
    """FQNs of `count` layers spread over the density range: densest first, sparsest last, the rest
    evenly in between (for 3: densest, middle, sparsest). Ties keep the plan's layer order.

    Example:
        >>> pick_tile_map_layers(plan, 3)
        ['layers.0.mlp.down_proj.weight', 'layers.1.self_attn.v_proj.weight', 'layers.1.mlp.up_proj.weight']
    """
    order = sorted(plan.layers, key=lambda f: -plan.layers[f].density)  # stable: ties in plan order
    if count <= 0 or not order:
        return []
    if count >= len(order):
        return order
    if count == 1:
        return [order[len(order) // 2]]
    picks = [round(i * (len(order) - 1) / (count - 1)) for i in range(count)]
    return list(dict.fromkeys(order[i] for i in picks))


def plot_plan(plan: TilePlan, out_dir: str | os.PathLike, title: str | None = None, tile_maps: int = 3) -> list[Path]:
    """Draw a plan's sparsity pictures (PNG, 120 dpi) into `out_dir`; returns their paths.

    Writes sparsity_per_block.png (when some layer sits in a block), sparsity_per_projection.png,
    sparsity_heatmap.png (blocks x projection types), sparsity_per_expert.png (blocks x experts, when
    the plan has MoE experts) and tile_map_<short name>.png for `tile_maps` layers spread over the
    density range (`pick_tile_map_layers`). An empty plan draws nothing. Pictures of those names that
    an earlier plan left in `out_dir` and this one did not draw are deleted; other files stay.

    Example:
        >>> plot_plan(plan, "runs/x", title="stories260K: PATCH joint at 35.0% sparsity")
        [PosixPath('runs/x/sparsity_per_block.png'), ..., PosixPath('runs/x/tile_map_block0_down.png')]
    """
    out = Path(out_dir)
    if not plan.layers:
        remove_pictures(out)
        return []
    out.mkdir(parents=True, exist_ok=True)
    stats = plan_stats(plan)
    written: list[Path] = []
    import matplotlib

    with matplotlib.rc_context({"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11}):
        if stats["per_block"]:
            written.append(_plot_per_block(stats, title, out / "sparsity_per_block.png"))
        written.append(_plot_per_projection(stats, title, out / "sparsity_per_projection.png"))
        if stats["per_block"]:
            written.append(_plot_heatmap(stats, title, out / "sparsity_heatmap.png"))
        if stats["experts"]:
            written.append(_plot_experts(stats, title, out / "sparsity_per_expert.png"))
        names = {fqn: short_name(fqn) for fqn in plan.layers}
        counts: dict[str, int] = {}
        for n in names.values():
            counts[n] = counts.get(n, 0) + 1
        for fqn in pick_tile_map_layers(plan, tile_maps):
            name = names[fqn]
            if counts[name] > 1:  # two weights map to one short name: fall back to the full FQN
                name = re.sub(r"[^A-Za-z0-9_-]+", "_", fqn).strip("_")
            written.append(_plot_tile_map(plan.layers[fqn], title, out / f"tile_map_{name}.png"))
    _remove_stale(out, written)
    return written


def remove_pictures(out_dir: str | os.PathLike) -> None:
    """Delete the pictures an earlier plan drew into `out_dir` (a run that draws none, `--no-plots`, must not
    leave another plan's beside its report); other files stay."""
    out = Path(out_dir)
    if out.is_dir():
        _remove_stale(out, [])


def _remove_stale(out: Path, written: list[Path]) -> None:
    """Delete pictures an earlier plan drew into `out` that this one did not (a re-run into the same
    folder would otherwise leave another plan's tile maps beside this plan's report)."""
    keep = {p.name for p in written}
    for old in out.glob("*.png"):
        if old.name not in keep and (old.name in SUMMARY_PICTURES or old.name.startswith("tile_map_")):
            old.unlink(missing_ok=True)
