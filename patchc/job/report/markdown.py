"""report.md: the run's report dict rendered for people (quality table, plan, training, pictures, timings).

Example:
    >>> md = render_markdown({"model": "stories260K", "metric": "perplexity", "results": [
    ...     {"name": "dense", "method": "dense", "pattern": "-", "sparsity": 0.0, "perplexity": 12.08}]})
    >>> "| dense | - | 0.0% | 12.08 |" in md
    True
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from patchc.job.report.plots import SUMMARY_PICTURES


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
    extra_key = "perplexity_extra" if metric == "perplexity" else "cosine_extra"
    extra_fmt = format_perplexity if metric == "perplexity" else (lambda v: _fmt(v, ".4f"))
    extras = list(dict.fromkeys(k for r in rows for k in (r.get(extra_key) or {})))
    head += [f"{name} ({'unsplit' if metric == 'perplexity' else 'cosine'})" for name in extras]
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
        cells += [extra_fmt((r.get(extra_key) or {}).get(name)) for name in extras]
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
    rank = {name: i for i, name in enumerate(SUMMARY_PICTURES)}
    return sorted(names, key=lambda n: rank.get(n, len(rank)))  # stable: tile maps keep densest..sparsest order


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
    out = [f"# patchc report: {model}", ""]
    if report.get("command"):
        out += ["```", str(report["command"]), "```", ""]
    sections = (_facts(report), _quality(report), _plan(report), _training(report), _speed(report),
                _picture_links(_pictures(report, pictures)), _timings(report), _versions(report), _files(report))
    for section in sections:
        out += section
    return "\n".join(out).rstrip() + "\n"


def _facts(report: Mapping[str, Any]) -> list[str]:
    """Model, data (train / eval / extra text and their sizes), a replaced recovery, device and date."""
    kind = report.get("kind")
    facts = [f"- **model**: {report.get('model') or 'model'}" + (f" ({kind})" if kind else "")]
    data = report.get("data") or {}
    if data:
        facts.append(_data_line(data, kind))
    replaced = report.get("recovery_replaced")
    if replaced:
        by = replaced.get("command") or "patchc recover"
        facts.append(f"- **recovered plan replaced** on {replaced.get('date')} by `{by}`: "
                     f"its scores are in {Path(str(replaced.get('record'))).name}; PATCH's `+ recovery` row "
                     "here describes the plan it replaced")
    resumed = report.get("resumed_rows")
    if resumed:  # `patchc prune --resume`: these rows' timings are an earlier process's, not in the table below
        facts.append(f"- **rows read back** from an earlier process of this run (rows.json): {', '.join(resumed)}")
    for key, label in (("device", "device"), ("date", "date")):
        if report.get(key):
            facts.append(f"- **{label}**: {report[key]}")
    return facts + [""]


def _data_line(data: Mapping[str, Any], kind: str | None) -> str:
    unit = "sentences" if kind == "encoder" else "tokens"
    train = ", ".join(map(str, data.get("train") or [])) or "–"
    evals = ", ".join(map(str, data.get("eval") or [])) or "–"
    line = f"- **data**: train {train}"
    if data.get("train_tokens") is not None:
        line += f" ({data['train_tokens']:,} {unit})"
    line += f"; eval {evals}"
    if data.get("eval_tokens") is not None:
        line += f" ({data['eval_tokens']:,} {unit})"
    if data.get("train_tokens_generated"):
        line += (f"; of the training tokens {data['train_tokens_generated']:,} were written by the dense model "
                 "from the training documents' first tokens")
    if data.get("train_tokens_extra"):
        line += f"; {data['train_tokens_extra']:,} training {unit} from --train-extra files"
    if data.get("eval_extra"):
        counts = data.get("eval_extra_tokens") or {}
        line += ("; also scored " + ("unsplit, from the start" if kind != "encoder" else "on its sentences") + ": "
                 + ", ".join(f"{p} ({counts[p]:,} {unit})" if p in counts else str(p) for p in data["eval_extra"]))
    return line


def _quality(report: Mapping[str, Any]) -> list[str]:
    out = ["## Quality", ""] + _quality_table(report) + [""]
    protocol = (report.get("evaluation") or {}).get("protocol")
    if protocol:
        out += [f"Protocol: {str(protocol).rstrip('.')}.", ""]
    return out


def _plan(report: Mapping[str, Any]) -> list[str]:
    """Density against the target, layers and tile, the plan file and the skipped layers (50 at most)."""
    plan = report.get("plan") or {}
    if not plan:
        return []
    cfg = report.get("config") or {}
    out = ["## Plan", ""]
    density = _num(plan.get("density"))
    sparsity = _num(plan.get("sparsity"))
    if sparsity is None and density is not None:
        sparsity = 1 - density
    target = _num(cfg.get("sparsity"))
    line = f"- global density {_fmt(density, '.4f')} (sparsity {_fmt(sparsity, '.2%')}"
    line += f", target {target:.2%})" if target is not None else ")"
    out.append(line)
    if plan.get("n_layers") is not None:
        tile = cfg.get("tile")
        out.append(f"- {plan['n_layers']} layers planned" + (f" in {tile[0]} × {tile[1]} tiles" if tile else ""))
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
    return out + [""]


def _training(report: Mapping[str, Any]) -> list[str]:
    """Steps, batch, lr, processes, time and the last log record; the whole configuration folded."""
    out: list[str] = []
    train = report.get("train") or {}
    if train:
        out += ["## Training", ""]
        bits = []
        if train.get("steps") is not None:
            bits.append(f"{train['steps']} steps")
        if train.get("batch_size") is not None:
            bits.append(f"batch {train['batch_size']}")
        if train.get("lr") is not None:
            tiles = train.get("tile_lr")  # the tile logits' own group (runs before 2026-12-07 did not record it)
            bits.append(f"lr {_fmt_value(train['lr'])}" + (f" (tile logits {_fmt_value(tiles)})" if tiles else ""))
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
    cfg = report.get("config") or {}
    if cfg:
        out += ["<details><summary>configuration</summary>", "", "| field | value |", "|---|---|"]
        out += [f"| {_cell(k)} | {_cell(_fmt_value(v))} |" for k, v in cfg.items()]
        out += ["", "</details>", ""]
    return out


def _speed(report: Mapping[str, Any]) -> list[str]:
    speed = report.get("speed")
    if not (isinstance(speed, Mapping) and speed):
        return []
    return ["## Speed", ""] + [f"- {k}: {_fmt_value(v)}" for k, v in speed.items()] + [""]


def _picture_links(pngs: list[str]) -> list[str]:
    if not pngs:
        return []
    out = ["## Pictures", ""]
    for name in pngs:
        out += [f"![{Path(name).stem.replace('_', ' ')}]({name})", ""]
    return out


def _timings(report: Mapping[str, Any]) -> list[str]:
    timings = report.get("timings") or {}
    if not timings:
        return []
    total = sum(v for v in (_num(t) for t in timings.values()) if v is not None)
    out = ["## Timings", "", "| stage | seconds |", "|---|---:|"]
    out += [f"| {_cell(k)} | {_fmt(v, '.1f')} |" for k, v in timings.items()]
    return out + [f"| total | {total:.1f} |", ""]


def _versions(report: Mapping[str, Any]) -> list[str]:
    versions = report.get("versions") or {}
    return ["## Versions", "", ", ".join(f"{k} {v}" for k, v in versions.items()), ""] if versions else []


def _files(report: Mapping[str, Any]) -> list[str]:
    """Every file the run wrote but the pictures (linked above)."""
    files = report.get("files") or {}
    others = {k: v for k, v in files.items() if not str(v).lower().endswith(".png")}
    return ["## Files", ""] + [f"- {k}: `{v}`" for k, v in others.items()] + [""] if others else []


def scored_files(scored: Mapping[str, int], kind: str, cap: int) -> str:
    """How much of each --eval-data / --text file was scored, as a clause per file.

    Example:
        >>> scored_files({"wiki.txt": 16384, "story.txt": 812}, "causal", cap=16384)
        '; wiki.txt scored on its first 16384 tokens; story.txt scored whole (812 tokens)'
    """
    def span(n: int) -> str:
        if kind != "causal":
            return f"on {n} of its sentences"
        return f"on its first {n} tokens" if n >= cap else f"whole ({n} tokens)"

    return "".join(f"; {Path(path).name} scored {span(n)}" for path, n in scored.items())


def format_results(report: dict) -> str:
    """The results as `patchc prune` prints them: a line per row, extra texts by file name.

    Example:
        >>> print(format_results({"metric": "perplexity", "results": [{"name": "dense", "sparsity": 0.0, "perplexity": 5.257}]}))
          dense                  sparsity   0.0%   perplexity     5.257
    """
    lines = []
    width = max([22] + [len(r["name"]) for r in report["results"]])  # "learned 2:4 (nm) + recovery" is 27
    for r in report["results"]:
        if report["metric"] == "perplexity":
            extra = "".join(f"   {Path(k).stem} {v:9.3f}" for k, v in (r.get("perplexity_extra") or {}).items())
            lines.append(f"  {r['name']:<{width}} sparsity {r['sparsity']:6.1%}   perplexity {r['perplexity']:9.3f}{extra}")
        else:
            extra = "".join(f"   {Path(k).stem} {v:.4f}" for k, v in (r.get("cosine_extra") or {}).items())
            lines.append(f"  {r['name']:<{width}} sparsity {r['sparsity']:6.1%}   cosine {r['cosine']:.4f}   "
                         f"retrieval agreement {r['retrieval_agreement']:.3f}{extra}")
    return "\n".join(lines)
