"""End-to-end decode throughput of a LLaMA-2-7B-shaped model with random weights, dense vs hybrid.

    python benchmarks/bench_e2e.py                                   # fp16, batch 16, 128 + 128 tokens
    python benchmarks/bench_e2e.py --layers 8 --sparsity 0 0.45      # quicker

One run measures every sparsity (default 0 / 25 / 35 / 45 / 50 %; the share of 2:4 tiles is 2s, tiles
128 x 128 placed at random) so the speedups share one device state. The model: 32 blocks of
q/k/v/o (4096 x 4096) and gate/up (11008 x 4096) / down (4096 x 11008), RMSNorm, rotary embedding, a
static KV cache and a dense LM head (32000). The prompt is one prefill pass; each generated token is one
decode step replayed from a CUDA graph (the cache position is a device tensor, so one graph serves every
step). Planned linears are `TileLinear` modules tuned by `patchc.runtime.tune_plan` (one tuning per
distinct shape and sparsity; cached on disk). Prints decode tokens/s and the speedup over dense, and
appends one JSON line (device, versions, date, numbers) to benchmarks/results/e2e.jsonl. Exits with a
message without CUDA.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIM, HIDDEN, HEADS, VOCAB = 4096, 11008, 32, 32000


class Block(nn.Module):
    """One LLaMA block with a static KV cache (batch, heads, max_len, head_dim)."""

    def __init__(self, batch: int, max_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        lin = lambda n, k: nn.Linear(k, n, bias=False)  # noqa: E731
        self.q, self.k, self.v, self.o = lin(DIM, DIM), lin(DIM, DIM), lin(DIM, DIM), lin(DIM, DIM)
        self.gate, self.up, self.down = lin(HIDDEN, DIM), lin(HIDDEN, DIM), lin(DIM, HIDDEN)
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        hd = DIM // HEADS
        self.register_buffer("kc", torch.zeros(batch, HEADS, max_len, hd, dtype=dtype), persistent=False)
        self.register_buffer("vc", torch.zeros(batch, HEADS, max_len, hd, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.n1(x)
        q, k, v = (m(h).view(b, t, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        self.kc.index_copy_(2, pos, k)  # positions as a device tensor: no host sync, graph-safe
        self.vc.index_copy_(2, pos, v)
        a = F.scaled_dot_product_attention(q, self.kc, self.vc, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, DIM))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Model(nn.Module):
    def __init__(self, n_layers: int, batch: int, max_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(batch, max_len, dtype) for _ in range(n_layers))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        hd = DIM // HEADS
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", ang.cos().to(dtype), persistent=False)
        self.register_buffer("sin", ang.sin().to(dtype), persistent=False)
        self.max_len = max_len

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = self.cos[pos], self.sin[pos]
        keys = torch.arange(self.max_len, device=ids.device)
        mask = keys[None, :] <= pos[:, None]  # (t, max_len): causal over the filled cache
        for blk in self.blocks:
            x = blk(x, pos, cos, sin, mask)
        return self.head(self.norm(x[:, -1:]))


def sparsify(model: Model, s: float, args: argparse.Namespace, seed: int) -> dict:
    """Swap every block linear for a TileLinear of a random hybrid plan (one plan + tuning per shape)."""
    from patchc.codegen.reference import random_layer_plan
    from patchc.runtime import TileLinear, tune_plan
    from patchc.ir import TilePlan

    shapes = {(DIM, DIM): "attn.weight", (HIDDEN, DIM): "up.weight", (DIM, HIDDEN): "down.weight"}
    layers = {name: random_layer_plan(n, k, tile=(128, 128), kinds=1.0 - 2.0 * s, dtype=torch.float16,
                                      seed=seed, name=name) for (n, k), name in shapes.items()}
    plan = TilePlan(layers=layers)
    tunings = tune_plan(plan, args.batch, args.prompt, torch.float16, "cuda", progress=True)
    for blk in model.blocks:
        for attr in ("q", "k", "v", "o", "gate", "up", "down"):
            lin = getattr(blk, attr)
            name = shapes[tuple(lin.weight.shape)]
            setattr(blk, attr, TileLinear.from_plan(layers[name], tunings[name], dtype=torch.float16,
                                                    device="cuda", batch_size=args.batch, prefill_len=args.prompt))
    torch.cuda.empty_cache()
    return {n: (t.to_dict() if t is not None else None) for n, t in tunings.items()}


@torch.no_grad()
def generate(model: Model, args: argparse.Namespace) -> dict:
    """Prefill once, then `args.gen` decode steps replayed from one CUDA graph; returns timings."""
    dev = "cuda"
    prompt = torch.randint(0, VOCAB, (args.batch, args.prompt), device=dev)
    tok = torch.zeros(args.batch, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    model(prompt, torch.arange(args.prompt, device=dev))  # warm-up: compiles every kernel
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(tok, pos)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model(tok, pos)
    times = []
    for _ in range(args.repeats):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        first = model(prompt, torch.arange(args.prompt, device=dev))
        tok.copy_(first.argmax(-1))
        mid.record()
        for i in range(args.gen):
            pos.fill_(args.prompt + i)
            graph.replay()
            tok.copy_(logits.argmax(-1))
        end.record()
        torch.cuda.synchronize()
        times.append((start.elapsed_time(mid), mid.elapsed_time(end)))
    pre_ms, dec_ms = min(times, key=lambda t: t[0] + t[1])
    total = args.batch * (args.prompt + args.gen)
    return {"prefill_ms": pre_ms, "decode_ms": dec_ms, "decode_tok_s": args.batch * args.gen / dec_ms * 1e3,
            "e2e_tok_s": total / (pre_ms + dec_ms) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.25, 0.35, 0.45, 0.5])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e.jsonl")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_e2e: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
        return 2
    if any(not 0.0 <= s <= 0.5 for s in args.sparsity):
        p.error("--sparsity values must lie in [0, 0.5]")
    from patchc.utils.env import device_name, versions

    rows, dense = [], None
    for i, s in enumerate(sorted(set(args.sparsity))):
        torch.manual_seed(0)
        model = Model(args.layers, args.batch, args.prompt + args.gen, torch.float16).cuda().half().eval()
        tunings = sparsify(model, s, args, seed=i) if s > 0 else None
        r = {"sparsity": s, **generate(model, args)}
        if s == 0:
            dense = r
        r["speedup_decode"] = r["decode_tok_s"] / dense["decode_tok_s"] if dense else None
        r["speedup_e2e"] = r["e2e_tok_s"] / dense["e2e_tok_s"] if dense else None
        r["decode_ceiling"] = 1.0 / (1.0 - 0.875 * s)
        r["tunings"] = tunings
        rows.append(r)
        print(f"sparsity {s:4.2f}: decode {r['decode_tok_s']:9.1f} tok/s  e2e {r['e2e_tok_s']:9.1f} tok/s  "
              f"speedup decode {r['speedup_decode'] or math.nan:5.3f}x  e2e {r['speedup_e2e'] or math.nan:5.3f}x  "
              f"(decode ceiling {r['decode_ceiling']:.2f}x)", flush=True)
        del model
        torch.cuda.empty_cache()
    record = {
        "bench": "e2e", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "device": device_name("cuda"), **versions(),
        "batch": args.batch, "prompt": args.prompt, "gen": args.gen, "layers": args.layers, "dtype": "fp16",
        "cuda_graphs": True, "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
