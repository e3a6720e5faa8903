"""What `patchc bench` measures: the options and the layer cases they expand to.

The full run (a CUDA GPU) covers LLaMA-2-7B layer shapes and odd ones, M from 1 to 2048, fp16 / bf16,
all-dense / all-2:4 / mixed plans and two tile sizes; `dry_run` keeps the same stages on tiny shapes so
the harness runs on CPU under the Triton interpreter (CI runs it).

Example:
    >>> opts = BenchOptions(dry_run=True)
    >>> len(check_cases(opts)) > 0, opts.parts
    (True, ('check', 'speed', 'e2e', 'experts'))
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

PARTS = ("check", "speed", "e2e", "experts")
# shares of the time budget: speed most (a default-config pass, then tuning), check next (many compiles)
PART_WEIGHTS = {"check": 0.30, "speed": 0.35, "e2e": 0.20, "experts": 0.15}
LLAMA7B_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))
ODD_SHAPES = ((1000, 3000), (4160, 4104))  # N, K not multiples of the 64/128 block
FULL_MS = (1, 2, 4, 8, 16, 17, 64, 128, 2048)
# plan kinds: "dense" (no 2:4 tile), "2:4" (every tile), or a float = the layer's overall sparsity
FULL_KINDS: tuple[str | float, ...] = ("dense", "2:4", 0.25, 0.35, 0.45)

# The dry run: shapes with N and K tails at 32 x 32 tiles (and smaller ones with tails at 16 x 16: the
# interpreter's time goes with the number of tiles), M across every kernel variant.
DRY_SHAPES = ((96, 160), (72, 100))
DRY_SHAPES_T16 = ((40, 56), (56, 40))
DRY_MS = (1, 3, 4, 17, 70)
# Triton's interpreter multiplies bf16 tl.dot operands as raw uint16 bits: only the tl.dot-free M <= 4
# kernels can run bf16 there (the GPU run checks bf16 at every M).
DRY_BF16_MS = (1, 3, 4)
DRY_TILES = ((32, 32), (16, 16))


@dataclass(frozen=True)
class BenchOptions:
    """Options of one `patchc bench` run.

    parts: any of "check" (correctness), "speed" (do_bench against cuBLAS / cuSPARSELt), "e2e" (a
    7B-shaped Llama decoding through `patchc.compile`), "experts" (fused MoE experts in one grouped launch
    against torch's grouped mm). budget_s: wall-clock seconds for the whole run;
    each part gets its share and reports the cases it had no time for. out_dir: where
    `<device>.jsonl` and `<device>.md` go. tune: tune the layers of the speed and e2e parts (GPU only).
    cases: keep only the check and speed cases whose label holds one of these strings (e.g. "4096x11008",
    "35%", "t64x64 bf16"); empty: every case.

    Example:
        >>> BenchOptions(parts=("speed",), budget_s=300).parts
        ('speed',)
    """

    parts: tuple[str, ...] = PARTS
    dry_run: bool = False
    budget_s: float = 510.0
    out_dir: Path = Path("benchmarks/results")
    tune: bool = True
    e2e_layers: int = 4
    e2e_tokens: int = 128
    e2e_batches: tuple[int, ...] = (1, 16)
    seed: int = 0
    cases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown or not self.parts:
            raise ValueError(f"BenchOptions.parts: unknown {unknown or 'none given'}; choose from {PARTS}")
        if self.budget_s <= 0:
            raise ValueError(f"BenchOptions.budget_s must be > 0 seconds, got {self.budget_s}")
        if not 1 <= self.e2e_layers <= 32:
            raise ValueError(f"BenchOptions.e2e_layers must be in 1..32 (LLaMA-2-7B has 32), got {self.e2e_layers}")
        if self.e2e_tokens < 1 or not self.e2e_batches or min(self.e2e_batches) < 1:
            raise ValueError("BenchOptions: e2e_tokens and every e2e batch size must be >= 1")
        object.__setattr__(self, "cases", tuple(self.cases))
        if any(not c.strip() for c in self.cases):
            raise ValueError("BenchOptions.cases: an empty filter would keep every case; drop it or name a "
                             "case part such as '35%' or '4096x11008'")
        for part, cases in (("check", check_cases), ("speed", speed_cases)):
            if self.cases and part in self.parts:
                cases(self)  # a filter that keeps none of a part's cases fails here, before anything runs
        object.__setattr__(self, "out_dir", Path(self.out_dir))

    def share(self, part: str, left_s: float | None = None, todo: tuple[str, ...] | None = None) -> float:
        """Seconds for one part: its weight's share of `left_s` (default the whole budget) among the parts
        still to run (`todo`, this one included; default all of `parts`). Run with what is left, a part
        that overran its share shrinks the later ones, and the run still ends near the budget.

        Example:
            >>> BenchOptions(parts=("check", "speed"), budget_s=100).share("speed", left_s=40, todo=("speed",))
            40.0
        """
        todo = self.parts if todo is None else todo
        left = self.budget_s if left_s is None else max(0.0, left_s)
        return left * PART_WEIGHTS[part] / sum(PART_WEIGHTS[p] for p in todo)


@dataclass(frozen=True)
class LayerCase:
    """One layer to build: shape (N, K), plan kinds, tile, dtype name and the M values to run; `explicit`:
    also check each kernel variant by an explicit config (else the automatic choice and the runtime).

    Example:
        >>> LayerCase((96, 160), 0.35, (32, 32), "fp16", (1, 17)).label
        '96x160 35% t32x32 fp16'
    """

    shape: tuple[int, int]
    kinds: str | float
    tile: tuple[int, int]
    dtype: str
    ms: tuple[int, ...]
    explicit: bool = False

    @property
    def label(self) -> str:
        kinds = self.kinds if isinstance(self.kinds, str) else f"{round(100 * self.kinds)}%"
        return f"{self.shape[0]}x{self.shape[1]} {kinds} t{self.tile[0]}x{self.tile[1]} {self.dtype}"


def _only(opts: BenchOptions, part: str, cases: list[LayerCase]) -> list[LayerCase]:
    """`cases` whose label holds one of `opts.cases` (all when there is no filter); a filter that keeps none
    of a part's cases is an error that lists them, not a run that checks nothing."""
    if not opts.cases:
        return cases
    kept = [c for c in cases if any(f in c.label for f in opts.cases)]
    if not kept:
        labels = "; ".join(dict.fromkeys(c.label for c in cases))
        raise ValueError(f"--case {' '.join(map(repr, opts.cases))} keeps none of the {part} part's cases "
                         f"({labels}); widen it or leave {part} out of --parts")
    return kept


def check_cases(opts: BenchOptions) -> list[LayerCase]:
    """Correctness cases, most informative first (a run out of time drops the tail), less those
    `opts.cases` filters out.

    Full: every shape x kinds at 128 x 128 fp16 over all M, each kernel variant explicitly; bf16 and
    64 x 64 tiles on the 2:4-holding plans over a shorter M list (the same code paths, other constexprs).
    """
    return _only(opts, "check", _check_cases(opts))


def _check_cases(opts: BenchOptions) -> list[LayerCase]:
    if opts.dry_run:  # each kernel path once or twice: the interpreter takes ~0.1-0.5 s per launch
        (s0, s1), (u0, u1), (t0, t1) = DRY_SHAPES, DRY_SHAPES_T16, DRY_TILES
        return [LayerCase(s0, "2:4", t0, "fp16", DRY_MS, explicit=True),
                LayerCase(s1, 0.35, t0, "fp16", DRY_MS, explicit=True),
                LayerCase(u0, 0.35, t1, "fp16", DRY_MS),
                LayerCase(u1, 0.35, t1, "bf16", DRY_BF16_MS),
                LayerCase(s0, "dense", t0, "fp16", (1, 17), explicit=True)]
    shapes = LLAMA7B_SHAPES + ODD_SHAPES
    cases = [LayerCase(s, k, (128, 128), "fp16", FULL_MS, explicit=True) for s in shapes for k in FULL_KINDS]
    short = (1, 4, 16, 17, 2048)
    cases += [LayerCase(s, k, (128, 128), "bf16", short) for s in shapes for k in ("2:4", 0.45)]
    cases += [LayerCase(s, k, (64, 64), d, short) for s in shapes for k in ("2:4", 0.35) for d in ("fp16", "bf16")]
    return cases


def speed_cases(opts: BenchOptions) -> list[LayerCase]:
    """Speed cases: the 7B shapes at every sparsity (and all-2:4), fp16, decode and prefill M; less those
    `opts.cases` filters out."""
    if opts.dry_run:
        return _only(opts, "speed", [LayerCase(DRY_SHAPES[0], k, DRY_TILES[0], "fp16", (1, 17)) for k in ("2:4", 0.35)])
    ms = (1, 4, 8, 16, 2048)
    kinds = (0.45, "2:4", 0.35, 0.25)
    return _only(opts, "speed", [LayerCase(s, k, (128, 128), "fp16", ms) for k in kinds for s in LLAMA7B_SHAPES])


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """`patchc bench`'s flags (the fields of `BenchOptions`)."""
    p.add_argument("--dry-run", action="store_true", help="run the same harness on CPU under the Triton "
                                                         "interpreter with tiny shapes (timings mean nothing)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="which parts to run")
    p.add_argument("--budget", type=float, default=BenchOptions.budget_s,
                   help="seconds for the whole run, shared by the parts")
    p.add_argument("--out", default=None,
                   help="results folder (default: benchmarks/results; dry run: runs/bench-dry-run)")
    p.add_argument("--case", dest="cases", nargs="+", default=[], metavar="TEXT",
                   help="check and time only the layer cases whose label holds one of these, e.g. 4096x11008 "
                        "or '35%%' (the labels are the rows of the summary)")
    p.add_argument("--no-tune", dest="tune", action="store_false", help="use the default configs instead of tuning")
    p.add_argument("--layers", type=int, default=BenchOptions.e2e_layers,
                   help="blocks of the end-to-end LLaMA-2-7B-shaped model")
    p.add_argument("--tokens", type=int, default=BenchOptions.e2e_tokens,
                   help="tokens generated per end-to-end measurement")
    p.add_argument("--seed", type=int, default=BenchOptions.seed, help="random layers and inputs")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
