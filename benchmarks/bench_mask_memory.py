"""Memory of mask training against dense Adam fine-tuning: bytes per masked weight and peak extra RSS.

Run:
    python benchmarks/bench_mask_memory.py                 # Llama hidden 512, 4 layers, batch 4x128, 2 threads
    python -m pytest benchmarks/bench_mask_memory.py -q    # the same on a tiny model, as a check

Each mode runs in a fresh subprocess: a random-weight HF Llama is built (and, for the mask modes,
exported and transformed: setup, reported apart as "setup MiB"); then what setup freed is returned
to the OS (gc, malloc_trim), the resident high-water mark is reset (/proc/self/clear_refs) and the
resident set size read; N training steps run and the high-water mark (VmHWM) is read. "extra" is the
difference plus the logits, so it counts everything training adds: logits, gradients, optimizer
state, activations, the saved W * M, the noise bank. Modes:

    dense      torch Adam over every weight (plain fine-tuning), the reference
    default    mask training, `MaskOptimConfig()`: fused fp32 Adam, all gradients alive at the step
    low        mask training, `MaskOptimConfig(memory="low")`: bf16 m / v, step in backward
    low-4      low, with 4 scores per 2:4 group (PatchConfig(nm_param="weight"))
    low-4v     low-4 with one Adam v per 2:4 group (MaskOptimConfig(v_per_group=True))

Bytes per weight = (logits + the most gradient bytes alive at once + optimizer state) / masked weights,
read from the real tensors after training (`patchc.masking.optim.state_bytes`, `GradPeak`).
The main prints a table and appends one JSON line to benchmarks/results/mask_memory.jsonl.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mask_memory.jsonl"
MODES = ("dense", "default", "low", "low-4", "low-4v")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model and batch of one measurement."""

    hidden: int = 512
    inter: int = 1376
    layers: int = 4
    heads: int = 8
    vocab: int = 2048
    batch: int = 4
    seq: int = 128
    steps: int = 4
    threads: int = 2
    impl: str = ""  # HybridMask.impl of the mask modes; "" = its default

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.steps < 2:
            raise ValueError(f"Shape: hidden {self.hidden} must split into {self.heads} heads, steps >= 2")


TINY = Shape(hidden=64, inter=160, layers=2, heads=4, vocab=128, batch=2, seq=16, steps=2, threads=1)


def _rss() -> int:
    """Resident bytes now (Linux), else the peak so far."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _peak()


def _peak() -> int:
    """The resident high-water mark since the last `_settle` (Linux), else since the process started."""
    from patchc.utils.env import proc_bytes

    hwm = proc_bytes("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _settle() -> int:
    """Free what setup left (gc, glibc's malloc_trim), restart the high-water mark, and return the RSS:
    the export's transient peak and memory glibc kept from it would otherwise hide or absorb training's."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass
    return _rss()


def _model(s: Shape):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.inter,
                                   num_hidden_layers=s.layers, num_attention_heads=s.heads,
                                   num_key_value_heads=s.heads, max_position_embeddings=2 * s.seq)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _batch(s: Shape, step: int):
    import torch

    return torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=torch.Generator().manual_seed(step))


def _dense(model, s: Shape) -> tuple[list[float], dict]:
    import torch

    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    times = []
    for t in range(s.steps):
        start = time.perf_counter()
        ids = _batch(s, t)
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    n = sum(p.numel() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    return times, {"weights": n, "bytes_per_weight": (4 * n + state) / n}  # grads (all alive) + m, v


def _program(model, s: Shape, mode: str):
    """The masked program of `model` for `mode` (export and transform: setup, not training)."""
    import patchc
    from patchc.models import export_causal_lm

    extra = {"nm_param": "weight"} if mode.startswith("low-4") else {}
    cfg = patchc.PatchConfig(tile=(16, 16), steps=s.steps, **extra)
    prog = patchc.transform(export_causal_lm(model), cfg)
    if extra and not all(m.nm_logits.shape[-1] == 4 for m in prog.layers.values()):
        raise RuntimeError("low-4: transform did not build 4-score masks for nm_param='weight'")
    for m in prog.layers.values() if s.impl else ():
        m.impl = s.impl
    return prog


def _masked(prog, s: Shape, mode: str) -> tuple[list[float], dict]:
    import patchc
    from patchc.masking.optim import GradPeak, MaskOptimConfig, state_bytes
    from patchc.masking.train import make_optimizer

    optim = MaskOptimConfig(memory="default" if mode == "default" else "low", v_per_group=mode == "low-4v")
    params = prog.mask_parameters()
    opt = make_optimizer(prog, 1e-3, optim)
    times: list[float] = []
    last = [time.perf_counter()]

    def tick(_record=None):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    with GradPeak(params) as peak:
        patchc.train_masks(prog, lambda t: _batch(s, t), patchc.lm_loss, steps=s.steps, optimizer=opt, optim=optim,
                           log_every=1, on_log=tick, progress=False)
    b = state_bytes(params, opt, peak.bytes)
    weights = sum(m.numel for m in prog.layers.values())
    return times, {"weights": weights, "bytes_per_weight": sum(b.values()) / weights,
                   **{f"{k}_per_weight": v / weights for k, v in b.items()}}


def child(mode: str, s: Shape) -> dict:
    """Measure one mode in this process (fresh: ru_maxrss is per process). Returns the JSON record."""
    import torch

    torch.set_num_threads(s.threads)
    model = _model(s)
    if mode == "dense":
        base = _settle()
        times, info = _dense(model, s)
        return {"mode": mode, "extra_mib": (_peak() - base) / 2**20, "step_s": statistics.median(times[1:]), **info}
    start = _settle()
    prog = _program(model, s, mode)
    logits = sum(p.numel() * p.element_size() for p in prog.mask_parameters())
    base = _settle()
    setup = base - start - logits  # the exported graph, buffers, and any weight copies: setup, not training
    times, info = _masked(prog, s, mode)
    # the logits were allocated by transform (before `base`) but are training state: counted in
    return {"mode": mode, "extra_mib": (_peak() - base + logits) / 2**20, "setup_mib": setup / 2**20,
            "step_s": statistics.median(times[1:]), **info}


def measure(mode: str, s: Shape) -> dict:
    """`child(mode, s)` in a subprocess."""
    cmd = [sys.executable, __file__, "--child", mode, "--shape", json.dumps(dataclasses.asdict(s))]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(s.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"bench_mask_memory --child {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(s: Shape, repeats: int = 1, modes: tuple[str, ...] | None = None) -> dict[str, dict]:
    """Every mode, `repeats` times, modes interleaved; medians per mode."""
    modes = modes or MODES
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:
            runs[m].append(measure(m, s))
    table = {}
    for m, rs in runs.items():
        table[m] = {**rs[0], "extra_mib": statistics.median(r["extra_mib"] for r in rs),
                    "extra_mib_all": [round(r["extra_mib"], 1) for r in rs],
                    "step_s": statistics.median(r["step_s"] for r in rs)}
    return table


def format_table(table: dict[str, dict]) -> str:
    dense = table["dense"]["extra_mib"] if "dense" in table else float("nan")
    lines = [f"{'mode':<8} {'B/weight':>9} {'extra MiB':>10} {'x dense':>8} {'setup MiB':>10} {'step s':>7}   (runs)"]
    for m, r in table.items():
        setup = f"{r['setup_mib']:10.1f}" if "setup_mib" in r else f"{'':>10}"
        lines.append(f"{m:<8} {r['bytes_per_weight']:9.2f} {r['extra_mib']:10.1f} {r['extra_mib'] / dense:8.2f} "
                     f"{setup} {r['step_s']:7.3f}   {r['extra_mib_all']}")
    return "\n".join(lines)


def record(table: dict[str, dict], s: Shape, command: str) -> None:
    import patchc  # noqa: F401 - versions() reads its version
    from patchc.utils.env import device_name, versions
    from patchc.utils.files import write_bytes_atomic

    line = {"bench": "mask_memory", "command": command, "shape": dataclasses.asdict(s), "results": table,
            "device": device_name("cpu"), "versions": versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    old = RESULTS.read_bytes() if RESULTS.exists() else b""
    write_bytes_atomic(RESULTS, old + (json.dumps(line) + "\n").encode())


def time_optimizers(s: Shape, repeats: int = 3) -> dict[str, float]:
    """Seconds per optimizer step over the logits a joint 16x16 program of `s` has (6 per 2:4 group + tiles),
    for torch Adam (for-loop, foreach, fused) and LowMemAdam (bf16 + stochastic rounding); interleaved,
    median of `repeats`."""
    import torch

    from patchc.masking.optim import LowMemAdam

    torch.set_num_threads(s.threads)
    shapes = [(n * k // 4, 6) for n, k in [(s.hidden, s.hidden)] * 4 + [(s.inter, s.hidden)] * 2 + [(s.hidden, s.inter)]]
    shapes = shapes * s.layers
    makers = {"adam-loop": lambda p: torch.optim.Adam(p, foreach=False), "adam-foreach": lambda p: torch.optim.Adam(p, foreach=True),
              "adam-fused": lambda p: torch.optim.Adam(p, fused=True), "lowmem-bf16-sr": lambda p: LowMemAdam(p)}
    opts = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opts[name] = make(params)
        opts[name].step()  # state allocated outside the timing
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(repeats):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def test_low_mode_uses_less_memory_than_default():
    table = run(TINY, modes=("dense", "default", "low"))
    assert all(r["extra_mib"] > 0 for r in table.values())
    assert table["low"]["bytes_per_weight"] < 0.6 * table["default"]["bytes_per_weight"]
    assert table["low"]["grads_per_weight"] < table["default"]["grads_per_weight"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=Shape.steps, help="training steps per mode")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode (medians reported)")
    p.add_argument("--impl", default="", help="HybridMask.impl of the mask modes (default: its default)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None, help="default: all")
    p.add_argument("--optimizer-times", action="store_true", help="time one optimizer step per kind instead")
    p.add_argument("--tiny", action="store_true", help="the tiny model of the pytest check")
    p.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS.relative_to(ROOT)}")
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, Shape(**json.loads(a.shape)))))
        return
    s = dataclasses.replace(TINY if a.tiny else Shape(), steps=a.steps, impl=a.impl)
    if a.optimizer_times:
        for name, sec in time_optimizers(s, a.repeats).items():
            print(f"{name:<16} {sec:.3f} s per step")
        return
    table = run(s, a.repeats, tuple(a.modes) if a.modes else None)
    print(format_table(table))
    if not a.no_record:
        record(table, s, "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *sys.argv[1:]]))


if __name__ == "__main__":
    main()
