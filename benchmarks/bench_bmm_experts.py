"""Llama 4's experts served by `TileBmmExperts`: the rows the router scored against every row, in one run.

Llama 4's MoE block hands every expert every token, scaled by its router score (0 for all but the block's
`top_k` experts). `TileBmmExperts` computes the non-zero rows only, bounded to T x top_k; "every row" is the
same module with that turned off (`skips_zero_rows = False`), which is what it did before 2026-12-06 and what
transformers' own `bmm` does. Experts (E, H -> 2F -> H) hold a random hybrid plan (tiles 16 x 16); the rows
come from `Llama4Router` on random tokens, as `Llama4TextMoe.forward` builds them. On a CPU this times the
fallback (torch threads: `--threads`); on CUDA the grouped kernels (`triton.testing.do_bench`).

    .venv/bin/python benchmarks/bench_bmm_experts.py                          # E 16, top-1, T 1 and 32
    .venv/bin/python benchmarks/bench_bmm_experts.py --experts 128 --tokens 1 8 --no-record

Prints a table and appends a JSON line to benchmarks/results/bmm_experts.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bmm_experts.jsonl"


def build(experts: int, hidden: int, ffn: int, top_k: int, device: str):
    """(the served module, the transformers module it replaces, the router) with a random hybrid plan."""
    import transformers
    from transformers.models.llama4.modeling_llama4 import Llama4Router, Llama4TextExperts

    import patchc
    from patchc.codegen.reference import random_layer_plan
    from patchc.runtime.experts import experts_module

    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                                        num_experts_per_tok=top_k)
    module, layers = Llama4TextExperts(cfg).eval(), {}
    with torch.no_grad():
        for proj in ("gate_up_proj", "down_proj"):
            weight = getattr(module, proj)  # stored (E, K, N): each slice planned as its (N, K) transpose
            for e in range(experts):
                name = f"experts.{proj}.{e}"
                layers[name] = random_layer_plan(weight.shape[2], weight.shape[1], tile=(16, 16), kinds="mixed",
                                                 seed=len(layers), name=name)
                weight[e] = layers[name].to_dense().t()
    plan = patchc.TilePlan(layers=layers)
    served = experts_module(module, plan, "experts", top_k=top_k, device=device)
    return served, module.to(device), Llama4Router(cfg).to(device)


def timed(fn, rounds: int, device: str) -> float:
    """Median seconds per call."""
    if device.startswith("cuda"):
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    from patchc.bench.layers import cpu_timer

    return cpu_timer(reps=rounds)(fn) / 1e3


def run(args: argparse.Namespace) -> dict:
    served, module, router = build(args.experts, args.hidden, args.ffn, args.top_k, args.device)
    rows_out = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device=args.device)
        with torch.no_grad():
            scores, _ = router(x)
            rows = x.repeat(args.experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
            want = module(rows)
            row = {"tokens": tokens}
            for name, skip in (("every row", False), ("scored rows", True)):
                served.skips_zero_rows = skip
                err = (served(rows) - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
                row[name] = {"ms": timed(lambda: served(rows), args.rounds, args.device) * 1e3, "rel_err": err}
        row["speedup"] = row["every row"]["ms"] / row["scored rows"]["ms"]
        rows_out.append(row)
        print(f"T={tokens:4d}  every row {row['every row']['ms']:8.3f} ms  scored rows {row['scored rows']['ms']:8.3f}"
              f" ms  x{row['speedup']:.2f}  (rel. error {row['scored rows']['rel_err']:.1e})")
    return {"experts": args.experts, "hidden": args.hidden, "ffn": args.ffn, "top_k": args.top_k,
            "threads": torch.get_num_threads(), "rows": rows_out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=50, help="calls timed per row on a CPU (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/bmm_experts.jsonl")
    args = p.parse_args(argv)
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    record = run(args)
    if not args.no_record:
        from patchc.bench.record import record_run

        record_run(RESULTS, record, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
