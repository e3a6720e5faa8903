"""Reports of a pruning run: sparsity plots of a tile plan, and report.json / report.md.

Pictures (PNG, like the paper's figures), from `plot_plan(plan, out_dir)`:

    sparsity_per_block.png        parameter-weighted sparsity of each transformer block, with the
                                  global achieved (and target) sparsity as horizontal lines
    sparsity_per_projection.png   the same per projection type (q, k, v, o, gate, up, down, ...)
    sparsity_heatmap.png          blocks x projection types: which layers stay dense
    tile_map_<layer>.png          the tile grid of a few layers (densest, middle, sparsest):
                                  dense vs 2:4 tiles

The report dict (built by `patchc prune`, see `patchc.job`) is written by `write_report` as
`report.json` (the record) and `report.md` (for people; `render_markdown`). `redraw(plan_path)` is
`patchc report PLAN`: it redraws the pictures from a saved plan and rewrites report.md from the
report.json beside it.

Example:
    >>> from patchc.tile_plan import TilePlan
    >>> plan = TilePlan.load("runs/stories260K/plan.patch")
    >>> [p.name for p in plot_plan(plan, "runs/stories260K")][:2]
    ['sparsity_per_block.png', 'sparsity_per_projection.png']
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchc.names import block_index
from patchc.files import write_bytes_atomic

if TYPE_CHECKING:  # matplotlib and the plan IR load lazily: `import patchc` must stay light
    from matplotlib.figure import Figure

    from patchc.tile_plan import LayerPlan, TilePlan

# Display order of projection types (attention, then MLP, like the paper's figures).
PROJECTION_ORDER = ("q", "k", "v", "qkv", "o", "gate", "up", "down", "other")

DPI = 120
# Colours: dense tiles dark (they cost the most bytes), 2:4 tiles light; colour-blind safe pair.
DENSE_COLOR = "#1f4e79"
SPARSE_COLOR = "#f4b942"
BAR_COLOR = "#4c72b0"

# Last module-name component -> projection type (Llama / Qwen / Mistral, llama2.c, OPT, GPT-NeoX, phi).
_LEAF_TYPES = {
    "q_proj": "q", "query": "q", "wq": "q", "q": "q",
    "k_proj": "k", "key": "k", "wk": "k", "k": "k",
    "v_proj": "v", "value": "v", "wv": "v", "v": "v",
    "o_proj": "o", "out_proj": "o", "wo": "o", "o": "o",
    "qkv_proj": "qkv", "query_key_value": "qkv", "wqkv": "qkv", "c_attn": "qkv", "qkv": "qkv",
    "gate_proj": "gate", "w1": "gate", "gate": "gate",
    "up_proj": "up", "w3": "up", "fc1": "up", "c_fc": "up", "dense_h_to_4h": "up", "up": "up",
    "down_proj": "down", "w2": "down", "fc2": "down", "dense_4h_to_h": "down", "down": "down",
}
_ATTENTION_WORDS = ("attn", "attention")


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------


def _module_parts(fqn: str) -> list[str]:
    """FQN without a trailing .weight / .bias, split at dots."""
    parts = fqn.split(".")
    if parts and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return parts


def projection_type(fqn: str) -> str:
    """The projection a weight belongs to: q, k, v, qkv, o, gate, up, down, or "other".

    Knows Llama/Qwen (`q_proj` ... `down_proj`), llama2.c (`wq wk wv wo`, `w1`=gate, `w3`=up,
    `w2`=down), BERT/MiniLM (`query key value`, `attention.output.dense`=o, `intermediate.dense`=up,
    `output.dense`=down), GPT-2 (`c_attn`=qkv, `attn.c_proj`=o, `mlp.c_fc`=up, `mlp.c_proj`=down),
    OPT (`fc1`/`fc2`) and GPT-NeoX (`query_key_value`, `attention.dense`=o).

    Example:
        >>> projection_type("model.layers.3.mlp.gate_proj.weight"), projection_type("layers.0.attention.wo.weight")
        ('gate', 'o')
        >>> projection_type("model.encoder.layer.2.intermediate.dense.weight"), projection_type("lm_head.weight")
        ('up', 'other')
    """
    parts = [p.lower() for p in _module_parts(fqn)]
    if not parts:
        return "other"
    leaf = parts[-1]
    parent = parts[-2] if len(parts) > 1 else ""
    in_attention = any(w in p for p in parts[:-1] for w in _ATTENTION_WORDS)
    if leaf == "c_proj":  # GPT-2 uses one name for the attention output and the MLP down projection
        return "o" if in_attention else "down" if parent == "mlp" else "other"
    if leaf == "dense":  # BERT / GPT-NeoX reuse "dense": the module path decides
        if parent == "intermediate":
            return "up"
        if in_attention:  # BERT attention.output.dense, NeoX attention.dense
            return "o"
        return "down" if parent == "output" else "other"
    return _LEAF_TYPES.get(leaf, "other")


def short_name(fqn: str) -> str:
    """A short file-name-safe label of a weight: `block3_q` when the block and projection are
    known, else the FQN without `.weight` and with unsafe characters replaced.

    Example:
        >>> short_name("model.layers.3.self_attn.q_proj.weight"), short_name("lm_head.weight")
        ('block3_q', 'lm_head')
    """
    block, proj = block_index(fqn), projection_type(fqn)
    if block is not None and proj != "other":
        return f"block{block}_{proj}"
    return re.sub(r"[^A-Za-z0-9_-]+", "_", ".".join(_module_parts(fqn))).strip("_") or "layer"


# ---------------------------------------------------------------------------------------------
# Statistics of a plan
# ---------------------------------------------------------------------------------------------


def _weighted_sparsity(layers: Iterable[LayerPlan]) -> float:
    """1 - kept / total over the layers (parameter weighted, like the paper's global budget)."""
    layers = list(layers)
    total = sum(layer.numel for layer in layers)
    return 1.0 - sum(layer.n_kept for layer in layers) / total if total else float("nan")


def plan_stats(plan: TilePlan) -> dict[str, Any]:
    """Parameter-weighted sparsity per block, per projection type and per (block, projection).

    Returns {"global": float, "target": float | None, "per_block": {block: s}, "per_projection":
    {type: s}, "grid": {(block, type): s}, "other": s | None} with blocks sorted and projection types
    in `PROJECTION_ORDER`; "other" is the sparsity of the planned layers outside any block.

    Example:
        >>> plan_stats(plan)["per_projection"]
        {'q': 0.31, 'k': 0.44, ...}
    """
    by_block: dict[int, list] = {}
    by_proj: dict[str, list] = {}
    by_cell: dict[tuple[int, str], list] = {}
    outside = []
    for fqn, layer in plan.layers.items():
        block, proj = block_index(fqn), projection_type(fqn)
        by_proj.setdefault(proj, []).append(layer)
        if block is None:
            outside.append(layer)
        else:
            by_block.setdefault(block, []).append(layer)
            by_cell.setdefault((block, proj), []).append(layer)
    target = None
    cfg = plan.meta.get("config") if isinstance(plan.meta, dict) else None
    if isinstance(cfg, dict) and isinstance(cfg.get("sparsity"), (int, float)):
        target = float(cfg["sparsity"])
    return {
        "global": plan.sparsity if plan.layers else float("nan"),
        "target": target,
        "per_block": {b: _weighted_sparsity(by_block[b]) for b in sorted(by_block)},
        "per_projection": {p: _weighted_sparsity(by_proj[p]) for p in PROJECTION_ORDER if p in by_proj},
        "grid": {key: _weighted_sparsity(v) for key, v in by_cell.items()},
        "other": _weighted_sparsity(outside) if outside else None,
    }


# ---------------------------------------------------------------------------------------------
# Pictures
# ---------------------------------------------------------------------------------------------


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
    import numpy as np

    blocks = list(stats["per_block"])
    projs = [p for p in PROJECTION_ORDER if any(key[1] == p for key in stats["grid"])]
    grid = np.full((len(blocks), len(projs)), np.nan)
    for (b, p), v in stats["grid"].items():
        grid[blocks.index(b), projs.index(p)] = 100 * v
    height = max(3.5, min(18.0, 1.8 + 0.32 * len(blocks)))
    fig = _new_figure((max(5.5, 2.5 + 0.75 * len(projs)), height))
    ax = fig.add_subplot()
    import matplotlib

    # grey: a projection this block does not have (or that was skipped)
    cmap = matplotlib.colormaps["YlGnBu"].with_extremes(bad="0.9")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=50, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(projs)), projs)
    step = max(1, math.ceil(len(blocks) / 40))
    ax.set_yticks(range(0, len(blocks), step), [str(b) for b in blocks[::step]])
    ax.set_xlabel("projection")
    ax.set_ylabel("transformer block")
    ax.set_title("Sparsity (%) per block and projection\n(0 = all tiles dense, 50 = all tiles 2:4)", fontsize=11)
    if len(blocks) <= 48:
        for i in range(len(blocks)):
            for j in range(len(projs)):
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

    from patchc.tile_plan import TILE_DENSE

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
    sparsity_heatmap.png (blocks x projection types) and tile_map_<short name>.png for `tile_maps`
    layers spread over the density range (`pick_tile_map_layers`). An empty plan draws nothing.

    Example:
        >>> plot_plan(plan, "runs/x", title="stories260K: PATCH joint at 35.0% sparsity")
        [PosixPath('runs/x/sparsity_per_block.png'), ..., PosixPath('runs/x/tile_map_block0_down.png')]
    """
    out = Path(out_dir)
    if not plan.layers:
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
        names = {fqn: short_name(fqn) for fqn in plan.layers}
        counts: dict[str, int] = {}
        for n in names.values():
            counts[n] = counts.get(n, 0) + 1
        for fqn in pick_tile_map_layers(plan, tile_maps):
            name = names[fqn]
            if counts[name] > 1:  # two weights map to one short name: fall back to the full FQN
                name = re.sub(r"[^A-Za-z0-9_-]+", "_", fqn).strip("_")
            written.append(_plot_tile_map(plan.layers[fqn], title, out / f"tile_map_{name}.png"))
    return written


# ---------------------------------------------------------------------------------------------
# report.json / report.md
# ---------------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    """A finite-or-not float from anything numeric; None for missing / non-numbers."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def format_perplexity(x: Any) -> str:
    """Perplexity with precision that suits its size: 12.08, 136.4, 6,735; "–" when missing.

    Example:
        >>> format_perplexity(12.0812), format_perplexity(6735.2), format_perplexity(None)
        ('12.08', '6,735', '–')
    """
    v = _num(x)
    if v is None:
        return "–"
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _fmt(x: Any, spec: str) -> str:
    v = _num(x)
    return "–" if v is None else format(v, spec)


def _fmt_value(x: Any) -> str:
    """Free-form values (config, final log record): floats short, the rest as they are."""
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(_fmt_value(v) for v in x) + ")"
    return str(x)


def _cell(x: Any) -> str:
    """Markdown table cell text: pipes and newlines would break the row."""
    return str(x).replace("|", "\\|").replace("\n", " ")


def _metric(report: Mapping[str, Any]) -> str:
    metric = report.get("metric")
    if metric in ("perplexity", "cosine"):
        return metric
    rows = report.get("results") or []
    return "perplexity" if any(r.get("perplexity") is not None for r in rows) else "cosine"


def _quality_table(report: Mapping[str, Any]) -> list[str]:
    rows = [r for r in report.get("results") or [] if isinstance(r, Mapping)]
    if not rows:
        return ["No evaluation results."]
    metric = _metric(report)
    dense = next((r for r in rows if r.get("method") == "dense" or r.get("name") == "dense"), None)
    with_seconds = any(_num(r.get("seconds")) is not None for r in rows)
    if metric == "perplexity":
        head = ["method", "pattern", "sparsity", "perplexity (lower is better)"]
        if dense is not None and _num(dense.get("perplexity")):
            head.append("vs dense")
    else:
        head = ["method", "pattern", "sparsity", "cosine to dense (higher is better)",
                "retrieval agreement (higher is better)"]
    if with_seconds:
        head.append("mask training (s)")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        cells = [_cell(r.get("name") or r.get("method") or "?"), _cell(r.get("pattern", "–")),
                 _fmt(r.get("sparsity"), ".1%")]
        if metric == "perplexity":
            cells.append(format_perplexity(r.get("perplexity")))
            if "vs dense" in head:
                base, v = _num(dense.get("perplexity")), _num(r.get("perplexity"))
                cells.append("–" if v is None or r is dense else _relative(v, base))
        else:
            cells += [_fmt(r.get("cosine"), ".4f"), _fmt(r.get("retrieval_agreement"), ".3f")]
        if with_seconds:
            cells.append(_fmt(r.get("seconds"), ".1f"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _relative(value: float, base: float) -> str:
    """Change against dense: +14.6% when close, x557 when far (a +55649.8% is unreadable)."""
    ratio = value / base
    if math.isnan(ratio) or math.isinf(ratio):
        return str(ratio)
    if ratio >= 100:
        return f"×{ratio:,.0f}"
    if ratio >= 2:
        return f"×{ratio:.1f}"
    return f"{ratio - 1:+.1%}"


def _pictures(report: Mapping[str, Any], pictures: Iterable[str | os.PathLike] | None) -> list[str]:
    """PNG file names to link: the given ones, else those listed under report["files"]."""
    if pictures is None:
        files = report.get("files") or {}
        pictures = [p for p in files.values() if isinstance(p, str) and p.lower().endswith(".png")]
    names = list(dict.fromkeys(Path(p).name for p in pictures))
    rank = {"sparsity_per_block.png": 0, "sparsity_per_projection.png": 1, "sparsity_heatmap.png": 2}
    return sorted(names, key=lambda n: rank.get(n, 3))  # stable: tile maps keep densest..sparsest order


def render_markdown(report: Mapping[str, Any], pictures: Iterable[str | os.PathLike] | None = None) -> str:
    """report.md text of a run's report dict (see the module docstring); tolerant of missing keys.

    PNGs are linked by file name (report.md sits beside them); `pictures` overrides the PNGs found in
    `report["files"]`.

    Example:
        >>> md = render_markdown({"model": "stories260K", "metric": "perplexity", "results": [
        ...     {"name": "dense", "method": "dense", "pattern": "-", "sparsity": 0.0, "perplexity": 12.08}]})
        >>> "| dense | - | 0.0% | 12.08 |" in md
        True
    """
    model = report.get("model") or "model"
    kind = report.get("kind")
    out = [f"# patchc report: {model}", ""]
    if report.get("command"):
        out += ["```", str(report["command"]), "```", ""]

    facts = [f"- **model**: {model}" + (f" ({kind})" if kind else "")]
    data = report.get("data") or {}
    if data:
        unit = "sentences" if kind == "encoder" else "tokens"
        train = ", ".join(map(str, data.get("train") or [])) or "–"
        evals = ", ".join(map(str, data.get("eval") or [])) or "–"
        line = f"- **data**: train {train}"
        if data.get("train_tokens") is not None:
            line += f" ({data['train_tokens']:,} {unit})"
        line += f"; eval {evals}"
        if data.get("eval_tokens") is not None:
            line += f" ({data['eval_tokens']:,} {unit})"
        if data.get("data_free"):
            line += "; data-free (training text sampled from the dense model)"
        facts.append(line)
    for key, label in (("device", "device"), ("date", "date")):
        if report.get(key):
            facts.append(f"- **{label}**: {report[key]}")
    out += facts + [""]

    out += ["## Quality", ""] + _quality_table(report) + [""]
    protocol = (report.get("evaluation") or {}).get("protocol")
    if protocol:
        out += [f"Protocol: {str(protocol).rstrip('.')}.", ""]

    plan = report.get("plan") or {}
    cfg = report.get("config") or {}
    if plan:
        out += ["## Plan", ""]
        density = _num(plan.get("density"))
        sparsity = _num(plan.get("sparsity"))
        if sparsity is None and density is not None:
            sparsity = 1 - density
        target = _num(cfg.get("sparsity"))
        line = f"- global density {_fmt(density, '.4f')} (sparsity {_fmt(sparsity, '.2%')}"
        line += f", target {target:.2%})" if target is not None else ")"
        out.append(line)
        if plan.get("n_layers") is not None:
            out.append(f"- {plan['n_layers']} layers planned")
        if plan.get("path"):
            out.append(f"- plan file: `{plan['path']}`")
        skipped = plan.get("skipped") or {}
        if skipped:
            out += ["", f"Skipped layers ({len(skipped)}):", ""]
            items = list(skipped.items())
            out += [f"- `{fqn}`: {reason}" for fqn, reason in items[:50]]
            if len(items) > 50:
                out.append(f"- ... and {len(items) - 50} more (see report.json)")
        else:
            out.append("- no layers skipped")
        out.append("")

    train = report.get("train") or {}
    if train:
        out += ["## Training", ""]
        bits = []
        if train.get("steps") is not None:
            bits.append(f"{train['steps']} steps")
        if train.get("batch_size") is not None:
            bits.append(f"batch {train['batch_size']}")
        if train.get("lr") is not None:
            bits.append(f"lr {_fmt_value(train['lr'])}")
        if train.get("processes") not in (None, 1):
            bits.append(f"{train['processes']} processes")
        if train.get("seconds") is not None:
            bits.append(f"{_fmt(train['seconds'], '.1f')} s")
        if bits:
            out.append("- " + ", ".join(bits))
        final = train.get("final") or {}
        if final:
            out.append("- last log record: " + ", ".join(f"{k} {_fmt_value(v)}" for k, v in final.items()))
        out.append("")
    if cfg:
        out += ["<details><summary>configuration</summary>", "", "| field | value |", "|---|---|"]
        out += [f"| {_cell(k)} | {_cell(_fmt_value(v))} |" for k, v in cfg.items()]
        out += ["", "</details>", ""]

    speed = report.get("speed")
    if isinstance(speed, Mapping) and speed:
        out += ["## Speed", ""] + [f"- {k}: {_fmt_value(v)}" for k, v in speed.items()] + [""]

    pngs = _pictures(report, pictures)
    if pngs:
        out += ["## Pictures", ""]
        for name in pngs:
            out += [f"![{Path(name).stem.replace('_', ' ')}]({name})", ""]

    timings = report.get("timings") or {}
    if timings:
        total = sum(v for v in (_num(t) for t in timings.values()) if v is not None)
        out += ["## Timings", "", "| stage | seconds |", "|---|---:|"]
        out += [f"| {_cell(k)} | {_fmt(v, '.1f')} |" for k, v in timings.items()]
        out += [f"| total | {total:.1f} |", ""]

    versions = report.get("versions") or {}
    if versions:
        out += ["## Versions", "", ", ".join(f"{k} {v}" for k, v in versions.items()), ""]

    files = report.get("files") or {}
    others = {k: v for k, v in files.items() if not str(v).lower().endswith(".png")}
    if others:
        out += ["## Files", ""] + [f"- {k}: `{v}`" for k, v in others.items()] + [""]
    return "\n".join(out).rstrip() + "\n"


def _json_default(x: Any) -> Any:
    """Paths, numpy / torch scalars and tuples-in-sets that the job may hand over, as JSON."""
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if hasattr(x, "item") and callable(x.item):
        try:
            return x.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(x, (set, frozenset)):
        return sorted(x, key=str)
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"report value of type {type(x).__name__} is not JSON serialisable")




def write_report(report: Mapping[str, Any], out_dir: str | os.PathLike,
                 pictures: Iterable[str | os.PathLike] | None = None) -> dict[str, Path]:
    """Write `report.json` (indent 2, keys in insertion order) and `report.md` into `out_dir`.

    Both texts are built before either file is touched, and each file is replaced atomically, so
    a failure leaves the previous files as they were.

    Example:
        >>> write_report(report, "runs/x")
        {'report_json': PosixPath('runs/x/report.json'), 'report_md': PosixPath('runs/x/report.md')}
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_json = json.dumps(report, indent=2, default=_json_default) + "\n"
    text_md = render_markdown(report, pictures)
    paths = {"report_json": out / "report.json", "report_md": out / "report.md"}
    write_bytes_atomic(paths["report_json"], text_json.encode("utf-8"))
    write_bytes_atomic(paths["report_md"], text_md.encode("utf-8"))
    return paths


def redraw(plan_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """`patchc report PLAN`: redraw a saved plan's pictures, and report.md if report.json is beside it.

    `out_dir` defaults to the plan's folder. report.md is written into `out_dir` (next to the
    pictures it links); report.json is read, never rewritten. Returns the written paths.

    Example:
        >>> [p.name for p in redraw("runs/stories260K/plan.patch")][-1]
        'report.md'
    """
    from patchc.tile_plan import TilePlan

    plan_path = Path(plan_path)
    plan = TilePlan.load(plan_path)
    out = Path(out_dir) if out_dir is not None else plan_path.parent
    report: dict | None = None
    report_json = plan_path.parent / "report.json"
    if report_json.exists():
        try:
            loaded = json.loads(report_json.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{report_json}: cannot read the run's report ({e}); move it away to redraw the plots only") from None
        report = loaded if isinstance(loaded, dict) else None
    title = _title(plan, report, plan_path)
    written = plot_plan(plan, out, title=title)
    if report is not None:
        md = out / "report.md"
        write_bytes_atomic(md, render_markdown(report, pictures=written).encode("utf-8"))
        written.append(md)
    return written


def _title(plan: TilePlan, report: Mapping[str, Any] | None, plan_path: Path) -> str:
    """The job's figure title when the run is known, else the plan file's name."""
    variant = (plan.meta.get("config") or {}).get("variant") if isinstance(plan.meta.get("config"), dict) else None
    label = f"PATCH {variant}" if variant else "plan"
    model = (report or {}).get("model") or (f"{plan_path.parent.name}/{plan_path.name}" if plan_path.parent.name else plan_path.name)
    return f"{model}: {label} at {plan.sparsity:.1%} sparsity"


__all__ = [
    "PROJECTION_ORDER",
    "block_index",
    "format_perplexity",
    "pick_tile_map_layers",
    "plan_stats",
    "plot_plan",
    "projection_type",
    "redraw",
    "render_markdown",
    "short_name",
    "write_report",
]
