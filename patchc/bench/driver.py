"""`patchc bench` (`make gpu`): correctness, layer speed and end-to-end decode on one GPU, in one command.

    run -> pick the device (a CUDA GPU; the Triton interpreter on CPU for --dry-run)
        -> check  (every kernel variant and the runtime vs fp64 and cuBLAS)
        -> speed  (TileLinear vs cuBLAS dense / cuSPARSELt, do_bench with CUDA graphs)
        -> e2e    (LLaMA-shaped model, patchc.compile vs dense, CUDA-graphed decode)
        -> experts (fused MoE experts: one grouped launch vs torch's grouped mm, checked against fp64)
        -> record (append benchmarks/results/<device>.jsonl, write <device>.md, print the tables)

Each part has a share of the time budget (default 510 s, under the 9 minutes asked of `make gpu`), taken
of the time left when it starts (a part that overran shrinks the later ones), and lists what it had no
time for. The exit status is 1 when a correctness check failed.

Example:
    >>> record = run(BenchOptions(dry_run=True, out_dir=tmp))   # doctest: +SKIP
    >>> exit_status(record)                                      # doctest: +SKIP
    0
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from patchc.bench.check import run_checks
from patchc.bench.e2e import run_e2e
from patchc.bench.experts import expert_cases, run_experts
from patchc.bench.layers import Deadline, cpu_timer, gpu_timer, peak_bandwidth
from patchc.bench.options import PARTS, BenchOptions, check_cases, speed_cases
from patchc.bench.record import append_jsonl, environment, markdown, slug
from patchc.bench.speed import run_speed
from patchc.utils.files import write_bytes_atomic


class BenchError(RuntimeError):
    """The bench cannot run here (no CUDA GPU without --dry-run)."""


def pick_device(dry_run: bool) -> str:
    """"cuda" with compiled kernels, or "cpu" with the kernels in the Triton interpreter (dry run)."""
    if dry_run:
        _use_interpreter()
        return "cpu"
    if not torch.cuda.is_available():
        raise BenchError("patchc bench needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "use --dry-run to run the same harness on CPU under the Triton interpreter")
    from patchc.runtime.op import kernels_interpreted

    if os.environ.pop("TRITON_INTERPRET", None) is not None or kernels_interpreted():
        _reload_kernels()
    return "cuda"


def _use_interpreter() -> None:
    """TRITON_INTERPRET=1 for patchc's kernels. Triton decides per @jit function when it is decorated, its
    own library (tl.sum, ...) included, so the variable must be set before triton is first imported."""
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(standard.sum, InterpretedFunction):
            raise BenchError("--dry-run: triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
                             "cannot run on CPU in this process; run `TRITON_INTERPRET=1 patchc bench --dry-run` "
                             "or set the variable before importing triton")
    from patchc.runtime.op import kernels_interpreted

    if not kernels_interpreted():
        _reload_kernels()  # decorated again, now as interpreted functions


def _reload_kernels() -> None:
    """Decorate patchc's kernels again (under the current TRITON_INTERPRET): the grouped kernels after the
    single-layer ones whose helpers they import."""
    from patchc.codegen import grouped_kernels, kernels

    importlib.reload(kernels)
    importlib.reload(grouped_kernels)


def run(opts: BenchOptions, progress: bool = True) -> dict[str, Any]:
    """Run the parts of `opts`, record them, print the summary; returns the record (see `exit_status`)."""
    device = pick_device(opts.dry_run)
    env = environment(device, opts.dry_run)
    # a dry run's timings mean nothing (interpreted kernels): one call each shows the path runs
    timer = cpu_timer(reps=1, warmup=0) if opts.dry_run else gpu_timer()
    tune = opts.tune and not opts.dry_run
    record: dict[str, Any] = {"env": env, "options": _jsonable(dataclasses.asdict(opts))}
    todo = tuple(p for p in PARTS if p in opts.parts)
    end = time.monotonic() + opts.budget_s

    def deadline(part: str) -> Deadline:  # its share of the time left among the parts not yet run
        return Deadline(opts.share(part, end - time.monotonic(), todo[todo.index(part):]))

    parts = {
        "check": lambda: run_checks(check_cases(opts), device, opts.seed, deadline("check"), progress),
        "speed": lambda: run_speed(speed_cases(opts), device, timer, tune, opts.seed, deadline("speed"),
                                   peak_bandwidth(env["device"]), progress),
        "e2e": lambda: run_e2e(dataclasses.replace(opts, tune=tune), device, deadline("e2e"), progress),
        "experts": lambda: run_experts(expert_cases(opts), device, timer, opts.seed, deadline("experts"),
                                       peak_bandwidth(env["device"]), progress),
    }
    with _sigterm_as_interrupt():
        for part in todo:
            try:
                _run_part(record, part, parts[part])
            except KeyboardInterrupt:  # Ctrl-C or `timeout`: keep the parts already done
                record["interrupted"] = part
                print(f"patchc bench: interrupted during part {part!r}; recording the parts done", file=sys.stderr)
                break
    name = slug(env["device"]) + ("-dry-run" if opts.dry_run else "")
    text = markdown(record)
    append_jsonl(opts.out_dir / f"{name}.jsonl", record)
    write_bytes_atomic(opts.out_dir / f"{name}.md", text.encode())
    print(text)
    print(f"patchc bench: appended to {opts.out_dir / (name + '.jsonl')}, summary in {opts.out_dir / (name + '.md')}")
    return record


def _run_part(record: dict[str, Any], part: str, fn: Callable[[], dict[str, Any]]) -> None:
    """record[part] = fn(); a part that raises is recorded under record["errors"] with its traceback and the
    run goes on, so one broken part (on a GPU session that is rare and short) does not lose the others."""
    try:
        record[part] = fn()
    except Exception:  # noqa: BLE001 - any failure of a part is a finding to record, not a reason to stop
        text = traceback.format_exc()
        print(f"patchc bench: part {part!r} failed:\n{text}", file=sys.stderr)
        record.setdefault("errors", {})[part] = text
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (`timeout`, a job scheduler) raises KeyboardInterrupt like Ctrl-C, so the record is written."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def exit_status(record: dict[str, Any]) -> int:
    """1 when a part raised or was interrupted, a correctness check (layers or experts) or the end-to-end
    logits comparison failed, else 0."""
    failed = bool(record.get("errors")) or "interrupted" in record
    failed |= bool(record.get("check", {}).get("failed")) or bool(record.get("experts", {}).get("failed"))
    failed |= any(not r["logits_ok"] for r in record.get("e2e", {}).get("rows", []))
    return int(failed)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}
