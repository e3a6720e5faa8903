"""How long sampling the dense model's own text takes a step: the nucleus draw against a whole-row multinomial.

`patchc prune` trains on text the dense model writes (65,536 tokens by default: 64 rows a batch, one token a
step). Each step samples the next token of every row at `--self-temperature` from its top-p nucleus, on the
CPU from one seeded generator. "whole row" is how every vocabulary was sampled before 2026-12-07 and how
vocabularies of up to 1,024 tokens still are (stories260K's 512): softmax, the nucleus (a whole sort where
the top 1,024 tokens do not hold it), `torch.multinomial` over the whole row, which draws an exponential per
token of every row. "nucleus draw" is `patchc.job.sampling.sample_next` for larger ones: on the logits'
device, one uniform per row by inverse CDF over the nucleus, found in the top 1,024 tokens or by binning the
row by probability.

Rows: (1) one step on Gaussian logits of 64 rows, "peaked" (standard deviation 4: at temperature 1.2 the
nuclei hold 1K-16K tokens) and "flat" (1: tens of thousands, as any random-initialised model's), at
vocabularies of 32,000 and 151,936; (2) `generate_blocks` end to end, one batch of 64 rows x 64 tokens from a
tiny random Llama (2 layers, hidden 64), with its LM head as initialised (flat logits) and scaled to give
peaked ones, with each sampler.

    .venv/bin/python benchmarks/bench_selfdata.py                 # both, 2 torch threads
    .venv/bin/python benchmarks/bench_selfdata.py --vocab 32000 --no-record

Prints a table and appends a JSON line to benchmarks/results/selfdata.jsonl.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "selfdata.jsonl"
TEMPERATURE, TOP_P, ROWS = 1.2, 0.95, 64  # the job's defaults


def whole_row(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """The sampler before 2026-12-07 at every vocabulary size: the nucleus from the top 1,024 tokens or a whole
    sort, on the CPU, then `torch.multinomial` over the whole row."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    out = torch.zeros_like(probs)
    top, order = probs.topk(min(1024, probs.shape[-1]), dim=-1)
    mass = top.cumsum(-1)
    out.scatter_(-1, order, top.masked_fill(mass - top >= top_p, 0.0))
    short = torch.nonzero(mass[:, -1] < top_p).flatten()
    if len(short):
        whole, whole_order = probs[short].sort(dim=-1, descending=True)
        kept = whole.masked_fill(whole.cumsum(-1) - whole >= top_p, 0.0)
        out[short] = torch.zeros_like(whole).scatter_(-1, whole_order, kept)
    return torch.multinomial(out, 1, generator=gen)


def step_rows(vocabs: list[int], rounds: int) -> list[dict]:
    """One sampling step of 64 rows, both samplers, on peaked and flat Gaussian logits."""
    from patchc.bench.layers import cpu_timer
    from patchc.job.sampling import nucleus, sample_next, top_nucleus

    timer, out = cpu_timer(reps=rounds), []
    for vocab in vocabs:
        for shape, std in (("peaked", 4.0), ("flat", 1.0)):
            logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(0)) * std
            probs = torch.softmax(logits / TEMPERATURE, dim=-1)
            share = len(top_nucleus(probs, TOP_P)[0]) / ROWS  # the others are binned
            row = {"vocab": vocab, "logits": shape, "std": std, "nucleus_in_top_1024": share,
                   "nucleus_tokens_median": float((nucleus(probs, TOP_P) > 0).sum(-1).float().median())}
            for name, fn in (("whole row", whole_row), ("nucleus draw", sample_next)):
                gen = torch.Generator().manual_seed(0)
                row[name] = timer(lambda fn=fn, gen=gen: fn(logits, TEMPERATURE, TOP_P, gen))  # ms
            row["speedup"] = row["whole row"] / row["nucleus draw"]
            out.append(row)
            print(f"V={vocab:7d} {shape:6s} (nucleus in the top 1K: {share:4.0%}, median "
                  f"{row['nucleus_tokens_median']:6.0f} tokens)"
                  f"  whole row {row['whole row']:7.1f} ms"
                  f"  nucleus draw {row['nucleus draw']:6.1f} ms  x{row['speedup']:.1f}")
    return out


def generation_rows(vocab: int, tokens: int) -> list[dict]:
    """`generate_blocks` for one batch of 64 rows from a tiny random Llama, each sampler: its LM head as
    initialised (flat logits, as a random model's), then scaled to give peaked ones."""
    import transformers

    import patchc.job.selfdata as selfdata

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    bundle = type("Bundle", (), {"model": model, "logits": staticmethod(lambda m, ids: m(ids).logits)})()
    spec = selfdata.SelfDataSpec(tokens=ROWS * (tokens + 1), block_len=tokens, temperature=TEMPERATURE, top_p=TOP_P,
                                 batch=ROWS)
    prompts = torch.randint(0, vocab, (ROWS, 5), generator=torch.Generator().manual_seed(0))
    out, real = [], selfdata.sample_next
    for shape in ("flat", "peaked"):
        if shape == "peaked":
            with torch.no_grad():  # the final norm gives unit-scale states: logits of standard deviation ~4
                model.lm_head.weight.normal_(std=4.0 / cfg.hidden_size**0.5)
        row = {"vocab": vocab, "logits": shape, "rows": ROWS, "tokens": tokens}
        try:
            for name, fn in (("whole row", whole_row), ("nucleus draw", real)):
                selfdata.sample_next = fn
                start = time.perf_counter()
                selfdata.generate_blocks(bundle, spec, prompts)
                row[name] = time.perf_counter() - start
        finally:
            selfdata.sample_next = real
        row["speedup"] = row["whole row"] / row["nucleus draw"]
        out.append(row)
        print(f"generate_blocks V={vocab} {shape:6s} {ROWS} rows x {tokens} tokens: whole row {row['whole row']:.1f} s,"
              f" nucleus draw {row['nucleus draw']:.1f} s  x{row['speedup']:.1f}")
    return out


def main(argv: list[str] | None = None) -> int:
    from patchc.bench.record import cpu_bench_parser

    p = cpu_bench_parser(__doc__, RESULTS, rounds=10)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--tokens", type=int, default=64, help="tokens a row generated end to end")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = {"temperature": TEMPERATURE, "top_p": TOP_P, "threads": torch.get_num_threads(),
              "steps": step_rows(args.vocab, args.rounds), "generate": generation_rows(args.vocab[0], args.tokens)}
    if not args.no_record:
        from patchc.bench.record import record_run

        record_run(RESULTS, {"bench": "selfdata", **record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
