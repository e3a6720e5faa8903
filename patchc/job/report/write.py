"""Writing a run's report: report.json (the record) and report.md, atomically; `patchc report` (redraw).

Example:
    >>> write_report(report, "runs/x")
    {'report_json': PosixPath('runs/x/report.json'), 'report_md': PosixPath('runs/x/report.md')}
    >>> [p.name for p in redraw("runs/x/plan.patch")][-1]
    'report.md'
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchc.job.report.markdown import render_markdown
from patchc.job.report.plots import plot_plan
from patchc.utils.files import read_record, write_bytes_atomic

if TYPE_CHECKING:
    from patchc.ir import TilePlan

# report.json's parts that report.md reads as objects (results: a list of rows), checked before it reads them
SECTIONS = {**dict.fromkeys(("config", "data", "evaluation", "plan", "train", "timings", "versions", "files",
                             "recovery_replaced"), dict), "results": list, "resumed_rows": list}


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

    `plan_path` may be the run folder (its plan.patch). `out_dir` defaults to the plan's folder.
    report.md is written into `out_dir` (next to the
    pictures it links); report.json is read, never rewritten. Returns the written paths.

    Example:
        >>> [p.name for p in redraw("runs/stories260K/plan.patch")][-1]
        'report.md'
    """
    from patchc.ir import TilePlan
    from patchc.job.runs import resolve_plan

    plan_path = resolve_plan(plan_path)
    plan = TilePlan.load(plan_path)
    out = Path(out_dir) if out_dir is not None else plan_path.parent
    report: dict | None = None
    report_json = plan_path.parent / "report.json"
    if report_json.exists():
        report = read_record(report_json, "report", "move it away to redraw the plots only", may=SECTIONS)
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
