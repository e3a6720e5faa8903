"""One mask-training step against a dense fine-tuning step, per variant, tile and mask implementation.

Model: a random `transformers.LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1376,
num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=2048))` in fp32
(14.7M weights, 12.6M of them in the 28 masked block linears), batch 4 x 128 next-token loss, CPU
with 2 torch threads. Rows:

    dense Adam     all weights trainable, torch.optim.Adam(fused=True): zero_grad, loss, backward, step
    dense floor    the same forward + backward, no optimizer
    mask steps     the trainer's step (loss + regulariser, backward, clip to 1, the trainer's Adam over
                   the logits: `make_mask_optimizer`, fused fp32, schedule step) for joint / tile-only /
                   2:4-only at 16 x 16 and joint at 128 x 128, per impl: "reference" (the original
                   autograd graph), "fused" (the default: the C loop of `patchc.masking.native` on the
                   CPU), "compiled" (`patchc.masking.fused` through torch.compile; compile time is
                   reported apart and excluded)

Every configuration runs once per round, round after round (medians over rounds), so the ratios
share whatever else loads the machine. Prints a table and appends a JSON line to
benchmarks/results/mask_step.jsonl.

    .venv/bin/python benchmarks/bench_mask_step.py                       # everything, 5 rounds
    .venv/bin/python benchmarks/bench_mask_step.py --impls reference fused --rounds 3 --no-record
    .venv/bin/python -m pytest benchmarks/bench_mask_step.py             # small model, one call each
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mask_step.jsonl"
FULL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=2048, max_position_embeddings=256)
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
VARIANTS = {  # row name -> PatchConfig fields
    "joint 16x16": dict(variant="joint", tile=(16, 16)),
    "tile 16x16": dict(variant="tile", tile=(16, 16)),
    "nm 16x16": dict(variant="nm", tile=(16, 16), sparsity=0.5),
    "joint 128x128": dict(variant="joint", tile=(128, 128)),
    "joint 16x16 nm_param=weight": dict(variant="joint", tile=(16, 16), nm_param="weight"),
}


def build_model(config: dict, seed: int = 0):
    """A random fp32 Llama of `config` (see FULL / SMALL)."""
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float()


def batch(config: dict, rows: int, seq: int, seed: int = 0) -> torch.Tensor:
    """(rows, seq + 1) token ids: seq inputs and their next-token targets."""
    return torch.randint(0, config["vocab_size"], (rows, seq + 1), generator=torch.Generator().manual_seed(seed))


def _lm(model, ids):
    logits = model(ids[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@dataclass
class Case:
    """One timed configuration: `step()` runs one step; `impl` is set on every mask before it."""

    name: str
    step: object
    prog: object = None
    impl: str | None = None

    def run(self) -> float:
        if self.prog is not None:
            for m in self.prog.layers.values():
                m.impl = self.impl
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start


def dense_cases(model, ids) -> list[Case]:
    """The dense Adam fine-tuning step and its forward + backward floor."""
    model.train()
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-5, fused=True)

    def floor():
        model.zero_grad(set_to_none=True)
        _lm(model, ids).backward()

    def adam():
        opt.zero_grad(set_to_none=True)
        _lm(model, ids).backward()
        opt.step()

    return [Case("dense Adam", adam), Case("dense fwd+bwd", floor)]


def mask_program(model, ids, fields: dict):
    """`patchc.transform` of an export of `model` (weights frozen), magnitude prior."""
    import patchc
    import patchc.passes.transform as transform_mod
    from patchc.masking.hybrid_mask import HybridMask
    from patchc.models import export_causal_lm

    cfg = patchc.PatchConfig(prior="magnitude", steps=1000, **fields)
    original = transform_mod.HybridMask
    if cfg.nm_param != "pattern":  # until transform passes cfg.nm_param to HybridMask itself
        transform_mod.HybridMask = functools.partial(HybridMask, nm_param=cfg.nm_param)
    try:
        prog = patchc.transform(export_causal_lm(model, batch=ids.shape[0], seq=ids.shape[1] - 1), cfg)
    finally:
        transform_mod.HybridMask = original
    return prog.train()


def mask_step(prog, ids):
    """The trainer's step (`patchc.train_masks`): its optimizer, clipping and schedule."""
    import patchc

    from patchc.masking.optim import make_mask_optimizer

    params = prog.mask_parameters()
    opt = make_mask_optimizer(params, 1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = patchc.lm_loss(prog, ids) + prog.regularizer()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        prog.step()

    return step


def logit_bytes_per_weight(prog) -> float:
    """fp32 bytes of the learned logits per masked weight (grads and Adam add 3x this again)."""
    masks = prog.layers.values()
    return 4 * sum(p.numel() for p in prog.mask_parameters()) / sum(m.numel for m in masks)


def run(config: dict, rows: int, seq: int, rounds: int, impls: list[str], variants: list[str]) -> dict:
    model = build_model(config)
    ids = batch(config, rows, seq)
    cases = dense_cases(model, ids)
    extra: dict[str, dict] = {}
    for name in variants:
        prog = mask_program(model, ids, VARIANTS[name])
        step = mask_step(prog, ids)
        extra[name] = {"logit_bytes_per_weight": round(logit_bytes_per_weight(prog), 3)}
        for impl in impls:
            cases.append(Case(f"{name} [{impl}]", step, prog, impl))
    compile_s = {}
    for case in cases:  # warm up; a compiled impl compiles here
        first = case.run()
        if case.impl == "compiled":
            compile_s[case.name] = round(first, 1)
        case.run()
    times: dict[str, list[float]] = {c.name: [] for c in cases}
    for r in range(rounds):
        for case in cases:
            times[case.name].append(case.run())
        print(f"round {r + 1}/{rounds}", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["dense Adam"]
    rows_out = []
    for name, t in med.items():
        spread = (max(times[name]) - min(times[name])) / t
        variant = name.split(" [")[0]
        rows_out.append({"case": name, "median_s": round(t, 4), "x_dense_adam": round(t / base, 3),
                         "spread": round(spread, 3), **extra.get(variant, {}),
                         **({"compile_s": compile_s[name]} if name in compile_s else {})})
    return {"rows": rows_out, "rounds": rounds}


def print_table(result: dict) -> None:
    print(f"{'case':44s} {'median s':>9s} {'x dense Adam':>13s} {'spread':>7s} {'B/weight':>9s}")
    for r in result["rows"]:
        print(f"{r['case']:44s} {r['median_s']:9.3f} {r['x_dense_adam']:13.2f} {r['spread']:7.2f} "
              f"{r.get('logit_bytes_per_weight', ''):>9}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every case once)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--impls", nargs="+", default=["reference", "fused", "compiled"], help="mask implementations")
    ap.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS), metavar="VARIANT",
                    help=f"mask rows, of: {list(VARIANTS)} (default all; --small: the 16x16 ones)")
    ap.add_argument("--small", action="store_true", help="the small model (a quick check, not the issue's numbers)")
    ap.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = SMALL if args.small else FULL
    rows, seq = (2, 32) if args.small else (4, 128)
    variants = args.variants or [v for v in VARIANTS if not (args.small and "128" in v)]
    result = run(config, rows, seq, args.rounds, args.impls, variants)
    print_table(result)
    if not args.no_record:
        from patchc.bench.record import record_run

        import transformers

        record_run(RESULTS, {"bench": "mask_step", "transformers": transformers.__version__, "threads": args.threads,
                             "model": config, "batch": [rows, seq], **result, "command": " ".join(
                                 ["benchmarks/bench_mask_step.py", *(argv if argv is not None else sys.argv[1:])])})


# -- pytest-benchmark: the small model, one call each under --benchmark-disable -------------------
@pytest.fixture(scope="module")
def small():
    pytest.importorskip("transformers")
    model = build_model(SMALL)
    return model, batch(SMALL, 2, 32)


def test_dense_adam_step(benchmark, small):
    benchmark(dense_cases(*small)[0].step)


@pytest.mark.parametrize("impl", ["reference", "fused"])
@pytest.mark.parametrize("variant", ["joint 16x16", "tile 16x16", "nm 16x16"])
def test_mask_step(benchmark, small, variant, impl):
    prog = mask_program(*small, VARIANTS[variant])
    for m in prog.layers.values():
        m.impl = impl
    before = [p.detach().clone() for p in prog.mask_parameters()]
    benchmark(mask_step(prog, small[1]))
    assert any(not torch.equal(a, p) for a, p in zip(before, prog.mask_parameters()))


if __name__ == "__main__":
    main()
