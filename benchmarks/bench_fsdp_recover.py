"""What weight recovery holds per rank: one process (`patchc.recover`) against 2 FSDP2 ranks (`recover_sharded`).

Run:
    python benchmarks/bench_fsdp_recover.py                 # Llama hidden 512, 8 layers, 2 gloo ranks
    python -m pytest benchmarks/bench_fsdp_recover.py -q    # the same on a tiny model, as a check

A random-weight HF Llama gets a plan (every third 16 x 16 tile of each block projection dense, the rest 2:4
by magnitude) and is recovered for a few Adam steps with KD to a dense teacher, in one process and on two CPU
ranks (gloo). After the first step each process counts the bytes of the tensors recovery holds on its device:
the student's weights, the teacher's, the gradients, Adam's two moments and the two bool masks (a rank counts
its shards: `to_local()`). On a GPU these are what the device holds while the loaded model waits in host
memory. It also times the steps. The main prints a table and appends one JSON line to
benchmarks/results/fsdp_recover.jsonl.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_mask_memory import Shape, _model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "fsdp_recover.jsonl"
WORLD = 2
PARTS = ("student", "teacher", "gradients", "adam", "masks")
DEFAULT = Shape(hidden=512, inter=1376, layers=8, heads=8, vocab=2048, batch=4, seq=64, steps=6, threads=1)
TINY = Shape(hidden=64, inter=160, layers=2, heads=4, vocab=128, batch=2, seq=16, steps=2, threads=1)


def _plan(model):
    import torch

    from patchc.ir import TilePlan
    from patchc.ir.tiles import to_tiles
    from patchc.pruning.patterns import mask_24, merge_tiles
    from patchc.utils.names import block_index

    masks = {}
    for fqn, w in model.named_parameters():
        if block_index(fqn) is not None and w.dim() == 2:
            grid = to_tiles(w.detach(), (16, 16)).shape[:2]
            dense = (torch.arange(grid[0] * grid[1]) % 3 == 0).view(grid)
            masks[fqn] = merge_tiles(dense, mask_24(w.detach().abs(), fqn), (16, 16))
    return TilePlan.from_masks(model, masks, tile=(16, 16))


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def _counting(teacher, counts: dict):
    """`recover`'s step, counting what recovery holds right after the first one (gradients still alive)."""
    from patchc.masking import recover as rec

    step = rec._step

    def counted(model, loss_fn, batch, optimizer, params, lr, grad_clip):
        loss = step(model, loss_fn, batch, optimizer, params, lr, grad_clip)
        if not counts:
            trained = [e.param for e in params]
            counts.update({"student": _bytes(model.parameters()), "teacher": _bytes(teacher.parameters()),
                           "gradients": _bytes(p.grad for p in trained if p.grad is not None),
                           "adam": _bytes(v for st in optimizer.state.values() for v in st.values() if v.dim()),
                           "masks": _bytes(t for e in params for t in (e.train, e.pruned))})
        return loss

    rec._step = counted


def _kd(teacher):
    import torch

    from patchc.job.losses import kd_loss
    from patchc.models.outputs import logits_of

    def loss(model, ids):
        with torch.no_grad():
            target = logits_of(teacher(ids))
        return kd_loss(logits_of(model(ids)), target)

    return loss


def _batches(s: Shape, rank: int = 0, world: int = 1):
    import torch

    from patchc.job.distributed import rank_slice

    return lambda t: rank_slice(torch.randint(0, s.vocab, (s.batch, s.seq), generator=torch.Generator().manual_seed(t)),
                                rank, world)


def _rank(rank: int, s: Shape, folder: Path) -> None:
    import torch
    import torch.distributed as dist

    from patchc.job.fsdp_recover import recover_sharded
    from patchc.masking.recover import RecoverConfig

    torch.set_num_threads(s.threads)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=WORLD)
    try:
        student = _model(s).eval()
        teacher, plan = copy.deepcopy(student), _plan(student) if rank == 0 else None
        counts: dict = {}
        _counting(teacher, counts)
        start = time.perf_counter()
        recover_sharded(plan, student, teacher, _batches(s, rank, WORLD), _kd(teacher),
                        RecoverConfig(steps=s.steps, lr=1e-3, score_batches=0), progress=False)
        counts["seconds"] = time.perf_counter() - start
        (folder / f"rank{rank}.json").write_text(json.dumps(counts))
    finally:
        dist.destroy_process_group()


def one_process(s: Shape) -> dict:
    import torch

    import patchc

    torch.set_num_threads(WORLD * s.threads)  # the cores the two ranks use
    student = _model(s).eval()
    teacher, plan = copy.deepcopy(student), _plan(student)
    counts: dict = {}
    _counting(teacher, counts)
    start = time.perf_counter()
    patchc.recover(plan, student, _batches(s), _kd(teacher), steps=s.steps, lr=1e-3, score_batches=0, progress=False)
    return counts | {"seconds": time.perf_counter() - start}


def sharded(s: Shape) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(s, Path(tmp)), nprocs=WORLD, start_method="spawn")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)]


def run(s: Shape) -> dict:
    from patchc.utils.env import cpu_model, versions

    alone, ranks = one_process(s), sharded(s)
    mib = lambda b: b / 2**20  # noqa: E731
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(), **versions(), "shape": s.__dict__, "ranks": WORLD,
            "one_mib": {k: mib(alone[k]) for k in PARTS}, "rank_mib": {k: mib(max(r[k] for r in ranks)) for k in PARTS},
            "one_seconds": alone["seconds"], "ranks_seconds": max(r["seconds"] for r in ranks)}


def test_each_rank_holds_about_half_of_what_one_process_holds():
    record = run(TINY)
    for part in PARTS:
        assert 0.4 <= record["rank_mib"][part] / record["one_mib"][part] <= 0.6, (part, record)


def main() -> None:
    from patchc.bench.record import append_jsonl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=DEFAULT.layers)
    parser.add_argument("--hidden", type=int, default=DEFAULT.hidden)
    args = parser.parse_args()
    record = run(Shape(**{**DEFAULT.__dict__, "layers": args.layers, "hidden": args.hidden}))
    print(f"MiB held by weight recovery after its first step, one process against each of {WORLD} ranks:")
    print("| part | one process | per rank |\n|---|---:|---:|")
    for part in PARTS:
        print(f"| {part} | {record['one_mib'][part]:.1f} | {record['rank_mib'][part]:.1f} |")
    total = [sum(record[k].values()) for k in ("one_mib", "rank_mib")]
    print(f"| all | {total[0]:.1f} | {total[1]:.1f} |")
    print(f"{DEFAULT.steps} steps: {record['one_seconds']:.1f} s in one process, {record['ranks_seconds']:.1f} s on "
          f"{WORLD} ranks")
    append_jsonl(RESULTS, record)


if __name__ == "__main__":
    main()
