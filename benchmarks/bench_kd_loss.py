"""How long the job's default task loss (LM + KD at temperature 1) takes, forward and backward, on large vocabularies.

Mask training's loss per step is next-token cross-entropy plus the KL divergence to the dense model's
next-token distribution, both over (tokens, vocab) logits: at a 152K vocabulary and the job's 8 x 128 tokens,
each such tensor is 622 MB in fp32. "divided" is `kd_loss` before 2026-12-07, which divided both logits by the
temperature even at 1 (two copies forward, one more in backward); "now" is `patchc.job.losses.kd_loss`. Both
give the same bits (`tests/test_selfdata.py`). The student's logits are a leaf here, so the time is the loss's
alone, not the LM head's.

    .venv/bin/python benchmarks/bench_kd_loss.py                    # vocab 32,000 and 151,936, 2 threads
    .venv/bin/python benchmarks/bench_kd_loss.py --vocab 32000 --no-record

Prints a table and appends a JSON line to benchmarks/results/kd_loss.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "kd_loss.jsonl"


def divided(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`kd_loss` before 2026-12-07: both logits divided by the temperature, whatever it is."""
    s = F.log_softmax(student.float().flatten(0, -2) / temperature, dim=-1)
    t = F.log_softmax(teacher.float().flatten(0, -2) / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def step(kd, logits: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor) -> None:
    """LM + KD forward and backward, as `make_lm_loss` with `--loss lm+kd`."""
    student = logits.detach().requires_grad_()
    (F.cross_entropy(student.flatten(0, 1), targets.flatten()) + kd(student, teacher)).backward()


def run(vocabs: list[int], tokens: int, rounds: int) -> list[dict]:
    from patchc.bench.layers import cpu_timer
    from patchc.job.losses import kd_loss

    timer, rows = cpu_timer(reps=rounds), []
    for vocab in vocabs:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(1, tokens, vocab, generator=gen) * 3
        teacher = torch.randn(1, tokens, vocab, generator=gen) * 3
        targets = torch.randint(0, vocab, (1, tokens), generator=gen)
        row = {"vocab": vocab, "tokens": tokens}
        for name, kd in (("divided", divided), ("now", kd_loss)):
            row[name] = timer(lambda kd=kd: step(kd, logits, teacher, targets))  # ms
        row["speedup"] = row["divided"] / row["now"]
        rows.append(row)
        print(f"V={vocab:7d} x {tokens} tokens: divided {row['divided']:8.1f} ms  now {row['now']:8.1f} ms"
              f"  x{row['speedup']:.2f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--tokens", type=int, default=1024, help="tokens a step (the job's 8 x 128)")
    p.add_argument("--rounds", type=int, default=5, help="steps timed per row (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/kd_loss.jsonl")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = {"threads": torch.get_num_threads(), "rows": run(args.vocab, args.tokens, args.rounds)}
    if not args.no_record:
        from patchc.bench.record import append_jsonl, environment

        append_jsonl(RESULTS, {**environment("cpu", dry_run=False), "bench": "kd_loss", **record})
        print(f"appended to {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
