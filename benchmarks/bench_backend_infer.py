"""How long `generate()` takes under ``torch.compile(backend="patch")`` when the plan is inferred from the zeros.

Builds a random bf16 Llama of the given shape with every projection 2:4 (random patterns), compiles its
forward with the backend and no plan (tune=False: no GPU here), and times a greedy `generate()` of
`--tokens` tokens, which hands the backend three graphs (the prompt, the first decode step, a graph dynamic
in the length). Reports the wall time, the backend's time in plan inference and in its rewrite (inference
and packing included), per graph. Appends a record to benchmarks/results/backend_infer.jsonl.

    python benchmarks/bench_backend_infer.py                       # 336M parameters: hidden 2048, 4 layers
    python benchmarks/bench_backend_infer.py --hidden 1024 --intermediate 2816 --no-record
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "backend_infer.jsonl"


def build(hidden: int, intermediate: int, layers: int, vocab: int):
    """A random bf16 Llama whose projections are 2:4 (random patterns, seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from patchc.codegen.reference import random_24_mask

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=hidden // 128,
                         num_key_value_heads=hidden // 128)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(random_24_mask(*p.shape, g).to(p.dtype))
    return model


def timed(stats: dict[str, list[float]], key: str, fn):
    """`fn`, its calls' seconds appended to stats[key]."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stats[key].append(time.perf_counter() - start)
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("PATCHC_CPU_IMPL", "reference")
    sys.path.insert(0, str(ROOT))
    import torch

    import patchc.runtime.backend as backend
    from patchc.bench.record import record_run

    model = build(args.hidden, args.intermediate, args.layers, args.vocab)
    stats: dict[str, list[float]] = {"infer": [], "rewrite": []}
    backend.infer_plan = timed(stats, "infer", backend.infer_plan)
    backend.rewrite_linears = timed(stats, "rewrite", backend.rewrite_linears)
    ids = torch.randint(3, args.vocab, (1, 7), generator=torch.Generator().manual_seed(2))
    model.forward = torch.compile(model.forward, backend="patch", options={"tune": False})
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    row = {"params": params, "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
           "tokens": args.tokens, "generate_s": round(seconds, 2), "graphs": len(stats["rewrite"]),
           "infer_s": [round(s, 3) for s in stats["infer"]], "rewrite_s": [round(s, 3) for s in stats["rewrite"]]}
    print(f"{params / 1e6:.0f}M parameters: generate() {seconds:.1f} s over {row['graphs']} graphs; "
          f"plan inference {sum(stats['infer']):.2f} s ({', '.join(f'{s:.2f}' for s in stats['infer'])}), "
          f"rewrite {sum(stats['rewrite']):.2f} s ({', '.join(f'{s:.2f}' for s in stats['rewrite'])})")
    if not args.no_record:
        record_run(RESULTS, {"bench": "backend_infer", "rows": [row]})


if __name__ == "__main__":
    main()
