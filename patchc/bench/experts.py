"""Fused-MoE part of `patchc bench`: every expert of a 3-D weight in one grouped launch, against dense.

Cases: Qwen3-30B-A3B's experts (128 of 1536 x 2048 for gate_up, 2048 x 768 for down, top-8) at 35% / 45%
sparsity and all-2:4, and Mixtral-8x7B's (8 of 28672 x 4096 and 4096 x 14336, top-2) at 45%, bf16, 128 x 128
tiles; tokens 1 and 16 (decode) and 2048 (prefill), each routed to top-k distinct experts at random.

Correctness: `TileGroupedLinear` against the float64 loop over the experts, with `check`'s bound against
the same loop in the dtype (cuBLAS). Speed, both timed with CUDA graphs in the same run: the grouped
launch against the dense baseline, ``torch._grouped_mm`` where it runs (transformers' own path: bf16 on
sm_90) or else an F.linear per routed expert. At decode the bound is the weight bytes of the experts that
receive tokens: `ceiling` = their dense bytes / their hybrid bytes. As in the speed part, each timing
calls copies of the experts in turn (`cold_copies` of one token's experts), so a graph replay reads them
from HBM, not from an L2 that still holds them from the replay before.

Example:
    >>> rows = run_experts(expert_cases(BenchOptions(dry_run=True)), "cpu", cpu_timer(), 0, Deadline(60))  # doctest: +SKIP
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from patchc.bench.check import error_bound
from patchc.bench.layers import DTYPES, Deadline, cold_copies, in_turn, make_layer, run_cases, weight_bytes
from patchc.bench.options import BenchOptions, LayerCase

DISTINCT_PLANS = 2  # experts cycle through this many random plans (building 128 costs minutes, moves no bytes)


@dataclass(frozen=True)
class ExpertCase:
    """One 3-D expert weight: `num_experts` slices of `shape` (N, K), `top_k` experts per token."""

    model: str
    num_experts: int
    shape: tuple[int, int]
    top_k: int
    kinds: str | float
    dtype: str
    tokens: tuple[int, ...]
    check_tokens: tuple[int, ...]
    tile: tuple[int, int] = (128, 128)

    @property
    def label(self) -> str:
        kinds = self.kinds if isinstance(self.kinds, str) else f"{round(100 * self.kinds)}%"
        return f"{self.model} {self.num_experts}x{self.shape[0]}x{self.shape[1]} top-{self.top_k} {kinds} {self.dtype}"


def expert_cases(opts: BenchOptions) -> list[ExpertCase]:
    """The cases of the module docstring; the dry run: 4 tiny experts under the interpreter."""
    if opts.dry_run:
        return [ExpertCase("tiny", 4, (48, 64), 2, 0.35, "fp16", (1, 5), (1, 5), (16, 16))]
    qwen = [ExpertCase("qwen3-30b-a3b", 128, shape, 8, kinds, "bf16", (1, 16, 2048), (1, 16, 256))
            for kinds in (0.45, "2:4", 0.35) for shape in ((1536, 2048), (2048, 768))]
    mixtral = [ExpertCase("mixtral-8x7b", 8, shape, 2, 0.45, "bf16", (1, 16, 2048), (1, 16))
               for shape in ((28672, 4096), (4096, 14336))]
    return qwen[:2] + mixtral + qwen[2:]


def routing(tokens: int, case: ExpertCase, device: str, seed: int) -> tuple[torch.Tensor, list[int]]:
    """(offs (E,) int32 row ends on `device`, rows per expert): each token to top_k distinct random experts."""
    gen = torch.Generator().manual_seed(seed)
    choice = torch.rand(tokens, case.num_experts, generator=gen).topk(case.top_k, dim=-1).indices
    counts = torch.bincount(choice.reshape(-1), minlength=case.num_experts)
    return counts.cumsum(0).to(device=device, dtype=torch.int32), counts.tolist()


def build(case: ExpertCase, device: str, seed: int) -> tuple[Any, torch.Tensor, Any]:
    """(TileGroupedLinear on the architecture's default configs, dense slices (E, N, K), expert 0's plan)."""
    from patchc.codegen.configs import arch_of
    from patchc.codegen.grouped_layout import stack_experts
    from patchc.codegen.layout import pack
    from patchc.runtime.grouped_op import TileGroupedLinear
    from patchc.runtime.tuner import default_tuning

    dtype = DTYPES[case.dtype]
    distinct = [make_layer(LayerCase(case.shape, case.kinds, case.tile, case.dtype, ()), seed + i)
                for i in range(min(DISTINCT_PLANS, case.num_experts))]
    packed = [pack(lp, allow_all_dense=True) for lp in distinct]
    stacked = stack_experts([packed[e % len(packed)] for e in range(case.num_experts)], name=case.label)
    tuning = default_tuning(distinct[0], packed[0], 16, 128, arch_of(device))
    mod = TileGroupedLinear(stacked, case.num_experts, case.shape, tuning, dtype, device)
    slices = torch.stack([lp.to_dense() for lp in distinct]).to(device=device, dtype=dtype)
    return mod, slices[torch.arange(case.num_experts) % len(distinct)], distinct[0]


def dense_loop(x: torch.Tensor, slices: torch.Tensor, counts: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each expert's rows times its slice (F.linear per routed expert; `dtype` float64 for the reference)."""
    dtype = dtype or x.dtype
    out, start = torch.zeros(x.shape[0], slices.shape[1], dtype=dtype, device=x.device), 0
    for e, c in enumerate(counts):
        if c:
            out[start : start + c] = F.linear(x[start : start + c].to(dtype), slices[e].to(dtype))
        start += c
    return out


def dense_baseline(x: torch.Tensor, slices: torch.Tensor, offs: torch.Tensor,
                   counts: list[int]) -> tuple[str, Callable[[], Any]]:
    """("grouped_mm", fn) when torch._grouped_mm runs these operands (checked once), else ("F.linear loop", fn)."""
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None and x.is_cuda:
        try:
            want = dense_loop(x, slices, counts)
            got = grouped(x, slices.transpose(1, 2), offs=offs)
            if torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
                return "grouped_mm", lambda: grouped(x, slices.transpose(1, 2), offs=offs)
        except Exception:  # dtype / architecture / layout torch's kernel does not take: use the loop
            pass
    return "F.linear loop", lambda: dense_loop(x, slices, counts)


def run_case(case: ExpertCase, device: str, timer: Callable[[Callable[[], Any]], float], seed: int,
             peak: float | None) -> list[dict[str, Any]]:
    """One row per token count: correctness where it is in `check_tokens`, then both timings."""
    from patchc.runtime.timing import compile_ahead

    dtype = DTYPES[case.dtype]
    mod, slices, layer = build(case, device, seed)
    compile_ahead([mod], [tokens * case.top_k for tokens in case.tokens])  # every routed row count (GPU only)
    elem = torch.empty((), dtype=dtype).element_size()
    hybrid_b, dense_b = weight_bytes(layer, elem)  # per expert: the distinct plans share the sparsity
    copies = cold_copies(case.top_k * hybrid_b, device)
    mods = [mod] + [copy.deepcopy(mod) for _ in range(copies - 1)]
    slice_sets = [slices] + [slices.clone() for _ in range(copies - 1)]
    rows = []
    for tokens in case.tokens:
        offs, counts = routing(tokens, case, device, seed + tokens)
        s, active = sum(counts), sum(c > 0 for c in counts)
        x = (torch.randn(s, case.shape[1], generator=torch.Generator().manual_seed(seed)) / case.shape[1] ** 0.5)
        x = x.to(device=device, dtype=dtype)
        row: dict[str, Any] = {"case": case.label, "tokens": tokens, "rows": s, "active_experts": active,
                               "copies": copies}
        with torch.no_grad():
            if tokens in case.check_tokens:
                ref = dense_loop(x, slices, counts, torch.float64)
                err = (mod(x, offs).double() - ref).abs().max().item()
                bound = error_bound((dense_loop(x, slices, counts).double() - ref).abs().max().item(),
                                    ref.abs().max().item(), dtype)
                row.update(err=err, bound=bound, ok=err <= bound)
            baselines = [dense_baseline(x, si, offs, counts) for si in slice_sets]
            row["baseline"] = baselines[0][0]
            row["dense_ms"] = timer(in_turn([fn for _, fn in baselines])) / copies
            row["tile_ms"] = timer(in_turn([lambda mi=mi: mi(x, offs) for mi in mods])) / copies
        row["speedup"] = row["dense_ms"] / row["tile_ms"]
        row["tile_GBps"] = active * hybrid_b / row["tile_ms"] / 1e6
        if tokens <= 16:  # decode: bound by the routed experts' weight bytes
            row["ceiling"] = dense_b / hybrid_b
            row["of_ceiling"] = row["speedup"] / row["ceiling"]
            if peak:
                row["of_peak"] = row["tile_GBps"] * 1e9 / peak
        rows.append(row)
    return rows


def run_experts(cases: list[ExpertCase], device: str, timer: Callable[[Callable[[], Any]], float], seed: int,
                deadline: Deadline, peak: float | None = None, show: bool = True) -> dict[str, Any]:
    """Every case until the deadline: {"rows", "failed": rows whose check failed, "skipped": labels}."""
    rows, skipped = run_cases(cases, lambda case: run_case(case, device, timer, seed, peak), deadline,
                              "bench experts", show)
    return {"rows": rows, "failed": [r for r in rows if r.get("ok") is False], "skipped": skipped}
