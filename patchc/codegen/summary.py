"""What `patchc generate` prints after writing a kernels folder: per variant, read back from its manifests,
the worst weight-loop cost of any layer and what limits it.

Example:
    >>> print(summary("kernels/"))   # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from patchc.codegen.sass import MMA_ISSUE_BUDGET, SMALLEST_FAST_TILE


def summary(out_dir: str | os.PathLike) -> str:
    """Per variant, over every generated layer: the worst weight-loop cost and what limits it.

    Warp-instructions per weight byte of the dense and 2:4 loops (an H100 stops being memory bound above
    ~0.28), barriers per iteration, registers and spill bytes, the longest loop body, the fewest 128-bit
    loads in a loop, and whether the decode targets (`sass.LOOP_TARGETS`) hold in every layer; "-" where
    the code has no such loop.

    Example:
        >>> print(summary("kernels/"))                                    # doctest: +SKIP
        variant     layers  warps  regs  spills  dense w-instr/B  2:4 w-instr/B  barriers  loop instrs  LDG.128/iter  targets
        decode_m1       35      4    72       0            0.020          0.123         2          148             4       ok
    """
    out = Path(out_dir)
    index = json.loads((out / "manifest.json").read_text())
    rows: dict[str, dict[str, Any]] = {}
    unpacks: list[dict[str, Any]] = []
    per_kflop: dict[str, float] = {}  # the prefill loops' worst warp-instructions per kFLOP
    missed_blocks: set[tuple[int, int]] = set()
    for entry in index["layers"].values():
        if entry.get("route") != "patchc":
            continue
        manifest = json.loads((out / entry["manifest"]).read_text())
        for v in manifest["variants"]:
            if v.get("target_misses"):
                missed_blocks.add(tuple(manifest["block"]))
            if v["kernel"] == "unpack":
                unpacks.append(v.get("profile") or {})
            if v["kernel"] in ("splitk_reduce", "unpack"):
                continue
            r = rows.setdefault(v["name"], {"layers": 0, "warps": set(), "regs": 0, "spills": 0, "dense": None,
                                            "2:4": None, "barriers": 0, "instrs": 0, "ldg128": None, "misses": 0,
                                            "unrolled": 0})
            r["layers"] += 1
            r["warps"].add(v["num_warps"])
            prof = v.get("profile") or {}
            r["regs"] = max(r["regs"], prof.get("registers", 0))
            r["spills"] += prof.get("spill_bytes", 0)
            for lp in v.get("loops") or []:
                if "warp_instr_per_kflop" in lp:
                    per_kflop[lp["loop"]] = max(per_kflop.get(lp["loop"], 0.0), lp["warp_instr_per_kflop"])
                r[lp["loop"]] = max(r[lp["loop"]] or 0.0, lp["warp_instr_per_byte"])
                r["barriers"] = max(r["barriers"], lp["barriers"])
                r["instrs"] = max(r["instrs"], lp["instructions"])
                r["ldg128"] = lp["ldg128"] if r["ldg128"] is None else min(r["ldg128"], lp["ldg128"])
            r["misses"] += bool(v.get("target_misses"))
            r["unrolled"] += v.get("loops") == []
    head = (f"{'variant':<10} {'layers':>6} {'warps':>6} {'regs':>5} {'spills':>7} {'dense w-instr/B':>16} "
            f"{'2:4 w-instr/B':>14} {'barriers':>9} {'loop instrs':>12} {'LDG.128/iter':>13} {'targets':>8}")
    lines = [head]
    for name, r in rows.items():
        cost = {k: "-" if r[k] is None else f"{r[k]:.3f}" for k in ("dense", "2:4")}
        warps = "/".join(map(str, sorted(r["warps"])))
        wide = "-" if r["ldg128"] is None else str(r["ldg128"])
        # targets: "ok", "miss:<layers>" or "-" (prefill and decode beyond M = 16 have none; nor has
        # unrolled code: "n/a" where no layer has a loop)
        held = ("-" if name == "prefill" else f"miss:{r['misses']}" if r["misses"]
                else "n/a" if r["unrolled"] == r["layers"] else "ok")
        lines.append(f"{name:<10} {r['layers']:>6} {warps:>6} {r['regs']:>5} {r['spills']:>7} {cost['dense']:>16} "
                     f"{cost['2:4']:>14} {r['barriers']:>9} {r['instrs']:>12} {wide:>13} {held:>8}")
    unrolled = max((r["unrolled"] for name, r in rows.items() if name != "prefill"), default=0)
    if unrolled:
        lines.append(f"{unrolled} layer(s) have decode kernels without a weight loop: each program reads a fixed "
                     "tile or two (split-K cuts a short row), unrolled by the compiler: no loop whose cost grows with "
                     "the layer, so the loop targets do not apply")
    if per_kflop:
        budget = MMA_ISSUE_BUDGET[index["target"]]
        worst = ", ".join(f"{kind} {v:.2f}" for kind, v in per_kflop.items())
        lines.append(f"prefill, bound by compute: at most {worst} warp-instructions per kFLOP of its products "
                     f"({index['target']} issues ~{budget:.2f} while its tensor cores run at peak)")
    if unpacks:
        worst = max((u.get("w_instr_per_byte", -1.0) for u in unpacks), default=-1.0)
        cost = f"at most {worst:.3f} warp-instructions per byte a 2:4 block moves" if worst >= 0 else "no SASS read"
        lines.append(f"unpack (the other prefill route: W * M for cuBLAS), {len(unpacks)} layer(s): {cost}, "
                     f"{max(u.get('registers', 0) for u in unpacks)} registers, "
                     f"{sum(u.get('spill_bytes', 0) for u in unpacks)} spill bytes")
    small = sorted(b for b in missed_blocks if min(b) < SMALLEST_FAST_TILE)
    if small:
        sizes = ", ".join(f"{b1}x{b2}" for b1, b2 in small)
        lines.append(f"targets missed with {sizes} tiles: a loop iteration moves one tile, too few bytes to stream "
                     f"weights at the memory limit; they hold from {SMALLEST_FAST_TILE}x{SMALLEST_FAST_TILE} tiles up "
                     f"(patchc prune --tile {SMALLEST_FAST_TILE} {SMALLEST_FAST_TILE}, or the paper's 128 128)")
    return "\n".join(lines)


__all__ = ["summary"]
