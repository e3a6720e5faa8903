"""How long the job's default task loss (LM + KD at temperature 1) takes, forward and backward, on large vocabularies.

Mask training's loss per step is next-token cross-entropy plus the KL divergence to the dense model's
next-token distribution, both over (tokens, vocab) logits: at a 152K vocabulary and the job's 8 x 128 tokens,
each such tensor is 622 MB in fp32. "whole" is the loss before 2026-12-07's second change, one expression over
the whole batch (a dozen such tensors, each mapped and zeroed afresh by the kernel on a CPU); "now" is
`patchc.job.losses.task_loss`, a few positions at a time (`patchc.utils.chunks.piecewise`). Both give each
position the same gradient, bit for bit (`tests/test_task_loss.py`). The student's logits are a leaf here, so
the time is the loss's alone, not the LM head's. (The first change, the same day, stopped dividing by T = 1.)

    .venv/bin/python benchmarks/bench_kd_loss.py                    # vocab 32,000 and 151,936, 2 threads
    .venv/bin/python benchmarks/bench_kd_loss.py --vocab 32000 --no-record

Prints a table and appends a JSON line to benchmarks/results/kd_loss.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "kd_loss.jsonl"


def whole(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """LM + KD at T = 1 as one expression over the whole batch: the loss before it was taken in pieces."""
    s = student.float().flatten(0, -2)
    kd = F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(teacher.float().flatten(0, -2), dim=-1), log_target=True,
                  reduction="batchmean")
    return F.cross_entropy(s, targets.flatten()) + kd


def now(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The job's loss: `task_loss` with `--loss lm+kd`."""
    from patchc.job.losses import LossSpec, task_loss

    return task_loss(student, targets, teacher, LossSpec("lm+kd"))


def step(loss, logits: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor) -> None:
    """Forward and backward of `loss`, as a step of mask training runs it."""
    loss(logits.detach().requires_grad_(), teacher, targets).backward()


def run(vocabs: list[int], tokens: int, rounds: int) -> list[dict]:
    from patchc.bench.layers import cpu_timer

    timer, rows = cpu_timer(reps=rounds), []
    for vocab in vocabs:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(1, tokens, vocab, generator=gen) * 3
        teacher = torch.randn(1, tokens, vocab, generator=gen) * 3
        targets = torch.randint(0, vocab, (1, tokens), generator=gen)
        row = {"vocab": vocab, "tokens": tokens}
        for name, loss in (("whole", whole), ("now", now)):
            row[name] = timer(lambda loss=loss: step(loss, logits, teacher, targets))  # ms
        row["speedup"] = row["whole"] / row["now"]
        rows.append(row)
        print(f"V={vocab:7d} x {tokens} tokens: whole {row['whole']:8.1f} ms  now {row['now']:8.1f} ms"
              f"  x{row['speedup']:.2f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    from patchc.bench.record import cpu_bench_parser

    p = cpu_bench_parser(__doc__, RESULTS, rounds=5)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--tokens", type=int, default=1024, help="tokens a step (the job's 8 x 128)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = {"threads": torch.get_num_threads(), "rows": run(args.vocab, args.tokens, args.rounds)}
    if not args.no_record:
        from patchc.bench.record import record_run

        record_run(RESULTS, {"bench": "kd_loss", **record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
