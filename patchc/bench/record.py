"""Where a bench ran and what it found: the environment record, the JSONL history and the markdown summary.

`benchmarks/results/<device>.jsonl` gets one line per run (device, driver, CUDA, torch, triton, date,
git sha and every row); `<device>.md` is the latest run as tables. Both are written atomically: a run
that dies half-way leaves the history as it was.

Example:
    >>> slug("NVIDIA H100 80GB HBM3")
    'nvidia-h100-80gb-hbm3'
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from patchc.codegen.configs import groups_in_use
from patchc.utils.env import device_name, versions
from patchc.utils.files import write_bytes_atomic

ROOT = Path(__file__).resolve().parents[2]


def slug(name: str) -> str:
    """A file-name-safe lower-case form of a device name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def environment(device: str, dry_run: bool) -> dict[str, Any]:
    """Device, driver, CUDA, library versions, date and the git commit of the working tree."""
    libs = versions()
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "dry_run": dry_run,
        **libs,
        "groups_per_load": groups_in_use(libs["triton"]),  # which 2:4 load was timed
        "cuda": torch.version.cuda,
        "git_sha": _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
        "source_digest": source_digest(),  # names the code even where the machine's .git is a stale copy
        "git_dirty": bool(_run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["capability"] = list(torch.cuda.get_device_capability())
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return env


def source_digest(root: Path = ROOT) -> str:
    """sha256 (12 hex digits) of patchc's Python sources, paths and bytes: the same at any checkout of the
    same code, whatever git says there (a GPU machine's copy of .git was stale).

    Example:
        >>> len(source_digest())
        12
    """
    h = hashlib.sha256()
    for path in sorted((root / "patchc").rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def append_jsonl(path: Path, record: dict[str, Any]) -> Path:
    """The file with one more line, written atomically (the old lines are kept byte for byte)."""
    old = path.read_bytes() if path.exists() else b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    return write_bytes_atomic(path, old + (json.dumps(record) + "\n").encode())


def cpu_bench_parser(doc: str, results: Path, rounds: int) -> argparse.ArgumentParser:
    """A CPU benchmark's command line with --rounds (timed per row), --threads (2) and --no-record (of
    `results`); the benchmark adds its own flags. `doc`: its module docstring, whose first paragraph describes."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=rounds, help="steps timed per row (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--no-record", action="store_true", help=f"do not append to {_shown(results)}")
    return p


def record_run(path: Path, record: dict[str, Any], device: str = "cpu") -> Path:
    """A benchmark's `record` appended to its history at `path`, after `environment(device)`; says where.

    Example:
        >>> record_run(ROOT / "benchmarks/results/kd_loss.jsonl", {"bench": "kd_loss", "rows": rows})
        appended to benchmarks/results/kd_loss.jsonl
    """
    out = append_jsonl(path, {**environment(device, dry_run=False), **record})
    print(f"appended to {_shown(out)}")
    return out


def _shown(path: Path) -> Path:
    """`path` as a reader in the project's root would type it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def markdown(record: dict[str, Any]) -> str:
    """The run as markdown: environment, correctness summary (and failures), speed and end-to-end tables."""
    env = record["env"]
    lines = [f"# patchc bench: {env['device']}", "",
             f"{env['date']} · torch {env['torch']} · triton {env['triton']} · CUDA {env.get('cuda')} · "
             f"driver {env.get('driver')} · git {str(env.get('git_sha'))[:10]}{' (dirty)' if env.get('git_dirty') else ''}"
             f" · sources {env.get('source_digest')}"
             f"{' · DRY RUN (CPU interpreter, tiny shapes: timings mean nothing)' if env['dry_run'] else ''}", ""]
    if "check" in record:
        lines += _check_md(record["check"])
    if "speed" in record:
        lines += _speed_md(record["speed"])
    if "e2e" in record:
        lines += _e2e_md(record["e2e"])
    if "experts" in record:
        lines += _experts_md(record["experts"])
    if "interrupted" in record:
        lines += [f"## INTERRUPTED during part {record['interrupted']} (its rows and the later parts are missing)", ""]
    for part, text in record.get("errors", {}).items():
        lines += [f"## FAILED: part {part} raised", "", "```", text.rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def _check_md(c: dict[str, Any]) -> list[str]:
    rows = c["rows"]
    out = ["## Correctness (max |y - fp64| against 2 x cuBLAS's error + one output rounding)", "",
           "| variant | checks | failed | worst err / bound |", "|---|---:|---:|---:|"]
    for v in sorted({r["variant"] for r in rows}):
        mine = [r for r in rows if r["variant"] == v]
        ratios = [r["err"] / r["bound"] for r in mine if r.get("err") is not None and r["bound"] > 0]
        out.append(f"| {v} | {len(mine)} | {sum(not r['ok'] for r in mine)} | {_fmt(max(ratios, default=None))} |")
    for r in c["failed"][:30]:
        out.append(f"\nFAILED {r['case']} M={r['M']} {r['variant']}: err {_fmt(r.get('err'))} > bound "
                   f"{_fmt(r['bound'])} {r.get('error', '')}")
    if c["skipped"]:
        out.append(f"\nNot checked (time budget): {', '.join(c['skipped'])}")
    return out + [""]


def _speed_md(s: dict[str, Any]) -> list[str]:
    out = ["## Layer speed (runtime TileLinear vs cuBLAS dense, same run)", "",
           "| layer | M | configs | kernel | dense us | patchc us | speedup | bytes ceiling | of ceiling | GB/s "
           "| of peak | cuSPARSELt us |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        out.append(f"| {r['case']} | {r['M']} | {r.get('tuning') or ('tuned' if r.get('tuned') else 'default')} "
                   f"| {_kernel_cell(r)} "
                   f"| {_fmt(1e3 * r['dense_ms'], '.1f')} | {_fmt(1e3 * r['tile_ms'], '.1f')} "
                   f"| {r['speedup']:.2f}x | {_fmt(r.get('ceiling'), '.2f')} | {_fmt(r.get('of_ceiling'), '.0%')} "
                   f"| {r['tile_GBps']:.0f} | {_fmt(r.get('of_peak'), '.0%')} "
                   f"| {_fmt(None if r['semi_ms'] is None else 1e3 * r['semi_ms'], '.1f')} |")
    if s["skipped"]:
        out.append(f"\nNot timed (time budget): {', '.join(s['skipped'])}")
    return out + [""]


def _kernel_cell(r: dict[str, Any]) -> str:
    """The route (with the decode kernel named where it serves prefill), and for a split-K launch its splits,
    how they were added and the other way's time against it ("decode 16-way fixup (launch 1.08x)": the second
    launch took 8% longer)."""
    cfg = r.get("config") or {}
    route = r.get("route", "-")
    if route == "prefill" and cfg.get("kernel") == "decode":
        route = f"prefill on the decode kernel ({cfg['block_m']} tokens)"
    if cfg.get("split_k", 1) <= 1:
        return route
    other = f" ({r['other_reduce']} {r['other_reduce_ms'] / r['tile_ms']:.2f}x)" if r.get("other_reduce_ms") else ""
    return f"{route} {cfg['split_k']}-way {cfg.get('reduce')}{other}"


def _e2e_md(e: dict[str, Any]) -> list[str]:
    sh = e["shape"]
    out = [f"## End to end: LLaMA-shaped ({sh['layers']} blocks, dim {sh['dim']}, hidden {sh['hidden']}), "
           "decode tokens/s", "",
           "| sparsity | configs | batch | dense tok/s | patchc tok/s | speedup "
           "| one prompt's prefill, dense / patchc ms | logits max err (scale) |",
           "|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in e["rows"]:
        configs = f"tuned ({r.get('tuned_layers')} layers)" if r.get("tuned") else "default"
        prefill = ("-" if r.get("prefill_speedup") is None else f"{r['prefill_tokens']} tokens: "
                   f"{r['dense_prefill_ms']:.1f} / {r['long_prefill_ms']:.1f} ({r['prefill_speedup']:.2f}x)")
        out.append(f"| {r['sparsity']:.0%} | {configs} | {r['batch']} "
                   f"| {r['dense_tok_s']:.1f} | {r['decode_tok_s']:.1f} "
                   f"| {r['speedup']:.2f}x | {prefill} | {_fmt(r['logits_max_err'])} ({_fmt(r['logits_max'])})"
                   f"{'' if r['logits_ok'] else ' FAILED'} |")
    if e["skipped"]:
        out.append(f"\nNot run (time budget): {', '.join(e['skipped'])}")
    return out + [""]


def _experts_md(x: dict[str, Any]) -> list[str]:
    out = ["## Fused MoE experts (one grouped launch vs dense, same run; err against fp64, bound as above)", "",
           "| experts | tokens | routed experts | dense us (baseline) | patchc us | speedup | bytes ceiling "
           "| of ceiling | GB/s | err / bound |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in x["rows"]:
        check = "-" if r.get("err") is None else f"{r['err'] / r['bound']:.2f}{'' if r['ok'] else ' FAILED'}"
        out.append(f"| {r['case']} | {r['tokens']} | {r['active_experts']} | {1e3 * r['dense_ms']:.1f} ({r['baseline']}) "
                   f"| {1e3 * r['tile_ms']:.1f} | {r['speedup']:.2f}x | {_fmt(r.get('ceiling'), '.2f')} "
                   f"| {_fmt(r.get('of_ceiling'), '.0%')} | {r['tile_GBps']:.0f} | {check} |")
    if x["skipped"]:
        out.append(f"\nNot run (time budget): {', '.join(x['skipped'])}")
    return out + [""]
