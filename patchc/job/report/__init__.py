"""The report of a pruning run: statistics of the plan, pictures, report.json and report.md.

    stats.py      projection types from weight names; sparsity per block, per projection, per cell
    plots.py      the PNGs: sparsity per block / per projection, the block x projection heatmap, tile maps
    markdown.py   report.md from the report dict, and the table `patchc prune` prints
    write.py      report.json + report.md written atomically; `redraw` (the `patchc report` command)

The report dict is built by the prune job (`patchc.job.prune`).

Example:
    >>> pictures = plot_plan(plan, "runs/x", title="stories260K: PATCH joint at 35.0% sparsity")
    >>> write_report(report, "runs/x")
"""

from patchc.job.report.markdown import format_perplexity, format_results, render_markdown, scored_files
from patchc.job.report.plots import pick_tile_map_layers, plot_plan, remove_pictures
from patchc.job.report.stats import PROJECTION_ORDER, expert_index, plan_stats, projection_type, short_name
from patchc.job.report.write import redraw, write_report
from patchc.utils.names import block_index

__all__ = [
    "PROJECTION_ORDER",
    "block_index",
    "expert_index",
    "format_perplexity",
    "format_results",
    "scored_files",
    "pick_tile_map_layers",
    "plan_stats",
    "plot_plan",
    "projection_type",
    "redraw",
    "remove_pictures",
    "render_markdown",
    "short_name",
    "write_report",
]
