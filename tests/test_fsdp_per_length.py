"""FSDP2 on a program with one graph per sequence length (Qwen3.5, Qwen4-Exp, the Mamba-2 hybrids).

Such a model's program exports a graph per length on first use, each reading the first graph's weights.
Sharding moves the weights out of the first graph, so a sharded program runs at that length only, which is
the length `patchc prune --fsdp` trains at (it exports the first graph at --block-len). The tiny Llama of
tests/test_fsdp.py stands in for such a model: wrapped as a `PerLengthExport`, its program takes the
per-length path whatever the model.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import patchc
from patchc.job.fsdp import DenseTeacher, full_state_dict, group_blocks, shard_program
from patchc.models.per_length import PerLengthExport
from tests.test_fsdp import (EVAL_IDS, WORLD, _batch, _config, _join_ranks, _load, _start, _train, exported,  # noqa: F401
                             exported_file)

LENGTH = _batch(0).shape[1] - 1  # the training blocks' inputs


def _per_length(ep, other_lengths: bool = False) -> PerLengthExport:
    def export(length: int):
        if not other_lengths:
            raise AssertionError(f"no graph for length {length} should be exported")
        return ep  # the tiny Llama's export holds for every length

    return PerLengthExport(ep, export, LENGTH, "a stand-in for chunked layers")


def test_a_sharded_per_length_program_runs_at_its_own_length_only(exported):  # noqa: F811
    """group_blocks (the rewrite under FSDP2) keeps what the program computes at its length and refuses any
    other with the reason; a program that already built other lengths is refused before it is rewritten."""
    plain = patchc.transform(_per_length(exported), _config())
    grouped = patchc.transform(_per_length(exported), _config())
    group_blocks(grouped)
    ids = _batch(0)[:, :-1]
    with plain.mask_mode("hard"), grouped.mask_mode("hard"), torch.no_grad():
        torch.testing.assert_close(grouped(ids).logits, plain(ids).logits, rtol=0, atol=0)
        with pytest.raises(ValueError, match=rf"runs at sequence length {LENGTH} only, got 12: shard .* --block-len"):
            grouped(EVAL_IDS)
    ran = patchc.transform(_per_length(exported, other_lengths=True), _config())
    with torch.no_grad():
        ran(EVAL_IDS)
    with pytest.raises(ValueError, match=rf"already has graphs for sequence lengths \[12, {LENGTH}\]"):
        group_blocks(ran)


def _worker(rank: int, ep_file: Path, out: Path) -> None:
    torch.set_num_threads(1)
    ep = _load(ep_file)
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=WORLD)
    try:
        prog = shard_program(patchc.transform(_per_length(ep), _config()))
        result, _ = _train(prog, DenseTeacher(prog), rank, WORLD)  # distilling through its shards
        sharded = all(getattr(p, "placements", None) == (Shard(0),) for p in prog.mask_parameters())
        state = full_state_dict(prog)
        if rank == 0:
            torch.save({"state": state, "history": result.history, "sharded": sharded}, out / "result.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp_trains_a_per_length_program_as_one_process_does(exported, exported_file, tmp_path):  # noqa: F811
    """Two FSDP2 ranks train the per-length program's logits as one process trains them (up to the
    reassociation of two half-batch means, as tests/test_fsdp.py measures)."""
    ranks = _start(_worker, exported_file, tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks use the other core meanwhile
    try:
        reference = patchc.transform(_per_length(exported), _config())
        ref_result, _ = _train(reference, functools.partial(exported.module(), use_cache=False))
        ref_state = reference.state_dict()
    finally:
        torch.set_num_threads(threads)
    _join_ranks(ranks)
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    assert got["sharded"]  # every logit a Shard(0) DTensor: FSDP2 sharded the program's one graph
    assert got["state"].keys() == ref_state.keys()
    for key, value in ref_state.items():
        torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-4, msg=key)
    assert got["history"][-1]["task"] == pytest.approx(ref_result.history[-1]["task"], rel=1e-5)
