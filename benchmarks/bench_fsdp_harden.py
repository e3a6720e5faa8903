"""What an FSDP2 rank holds while the plan is hardened: gathering the whole program, or one block at a time.

Run:
    python benchmarks/bench_fsdp_harden.py                 # Llama hidden 512, 8 layers, 2 gloo ranks
    python -m pytest benchmarks/bench_fsdp_harden.py -q    # the same on a tiny model, as a check

Two CPU ranks (gloo) shard a random-weight HF Llama's masked program (`shard_program`) and train it two
steps. Then, in a fresh pair of ranks per way, the plan is hardened:

    gather    `gather_program` + `patchc.harden`: every rank gathers every weight and logit and keeps them
    blocks    `harden_sharded`: one block gathered at a time, resharded before the next
    cycle     each block gathered and resharded, nothing hardened: what one gathered block costs

Each rank frees what training left (gc, malloc_trim), restarts its resident high-water mark
(/proc/self/clear_refs) and reads its RSS; after hardening it reads the mark (VmHWM), frees again and
reads the RSS. "peak" is the most hardening added at once, "after" what it still holds when it returns
(the plan, at least). The ranks run with glibc's mmap threshold fixed at 64 KiB: otherwise the heap
keeps blocks freed between two gathers, and RSS measures glibc's fragmentation (gather 439-572 MiB peak,
blocks 354-473 MiB, on the default shape). Both ways must give the same plan (sha256 checksums of every
layer). The main prints a table and appends one JSON line to benchmarks/results/fsdp_harden.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_mask_memory import Shape, _model, _peak, _rss, _settle  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "fsdp_harden.jsonl"
WAYS = ("gather", "blocks", "cycle")
WORLD = 2
DEFAULT = Shape(hidden=512, inter=1376, layers=8, heads=8, vocab=2048, batch=4, seq=64, steps=2, threads=1)
TINY = Shape(hidden=64, inter=160, layers=2, heads=4, vocab=128, batch=2, seq=16, steps=2, threads=1)


def _rank(rank: int, way: str, s: Shape, folder: Path) -> None:
    """One rank: shard, train, harden `way`; writes its numbers (and rank 0 the plan's digest)."""
    import torch
    import torch.distributed as dist

    import patchc
    from patchc.job.distributed import rank_slice
    from patchc.job.fsdp import gather_program, gathered, harden_sharded, shard_program
    from patchc.models import export_causal_lm

    torch.set_num_threads(s.threads)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=WORLD)
    try:
        prog = patchc.transform(export_causal_lm(_model(s)), patchc.PatchConfig(tile=(16, 16), steps=s.steps))
        shard_program(prog)
        batch = lambda t: rank_slice(torch.randint(0, s.vocab, (s.batch, s.seq + 1),  # noqa: E731
                                                   generator=torch.Generator().manual_seed(t)), rank, WORLD)
        patchc.train_masks(prog, batch, patchc.lm_loss, steps=s.steps, progress=False)
        base = _settle()
        if way == "cycle":
            for shard in prog.fsdp_shards.values():
                with gathered(shard):
                    pass
            plan = None
        else:
            plan = patchc.harden(gather_program(prog), exact_budget=True) if way == "gather" else \
                harden_sharded(prog, exact_budget=True)
        peak = _peak() - base
        record = {"rank": rank, "peak_mib": peak / 2**20, "after_mib": (_settle() - base) / 2**20,
                  "plan": None if plan is None else _digest(plan)}
        (folder / f"{way}-{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def _digest(plan) -> list:
    """Every layer's name and the checksums of its tile kinds and of W * M: equal plans give equal lists."""
    from patchc.ir.file_format import checksum

    return [[name, checksum(layer.kinds), checksum(layer.to_dense())] for name, layer in plan.layers.items()]


def measure(way: str, s: Shape) -> list[dict]:
    """Both ranks' records for one way, each pair in fresh processes."""
    import torch.multiprocessing as mp

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # the spawned ranks' glibc: see the docstring
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(way, s, Path(tmp)), nprocs=WORLD, start_method="spawn")
        return [json.loads((Path(tmp) / f"{way}-{r}.json").read_text()) for r in range(WORLD)]


def run(s: Shape) -> dict:
    from patchc.utils.env import cpu_model, versions

    rows = {way: measure(way, s) for way in WAYS}
    digests = {json.dumps(r["plan"]) for records in rows.values() for r in records if r["plan"] is not None}
    if len(digests) != 1:
        raise RuntimeError(f"the two ways hardened different plans: {digests}")
    weights = sum(p.numel() for p in _model(s).parameters())
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(), **versions(), "shape": s.__dict__, "ranks": WORLD, "model_mib": weights * 4 / 2**20,
            **{way: {k: max(r[k] for r in records) for k in ("peak_mib", "after_mib")}
               for way, records in rows.items()}}


def test_harden_by_block_holds_less_than_gathering():
    record = run(TINY)  # the same plan both ways, else `run` raises
    assert record["blocks"]["after_mib"] < record["gather"]["after_mib"]


def main() -> None:
    from patchc.bench.record import append_jsonl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=DEFAULT.layers)
    parser.add_argument("--hidden", type=int, default=DEFAULT.hidden)
    args = parser.parse_args()
    s = Shape(**{**DEFAULT.__dict__, "layers": args.layers, "hidden": args.hidden})
    record = run(s)
    print(f"{record['model_mib']:.0f} MiB of fp32 weights, {WORLD} ranks; MiB per rank added by hardening:")
    print("| way | peak | still held after |\n|---|---:|---:|")
    for way in WAYS:
        print(f"| {way} | {record[way]['peak_mib']:.0f} | {record[way]['after_mib']:.0f} |")
    append_jsonl(RESULTS, record)


if __name__ == "__main__":
    main()
