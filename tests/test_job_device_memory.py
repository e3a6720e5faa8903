"""What `patchc prune` keeps on the device: never the whole dense model twice, nor beside FSDP shards.

Under --fsdp on 2 gloo ranks, the job's own `train` on stories260K never runs the loaded dense model (a
forward hook counts its calls): the distillation teacher is the sharded program with its masks off
(`fsdp.DenseTeacher`) and the plan is hardened one block at a time (`fsdp.harden_sharded`);
tests/test_fsdp.py checks both against one process. The dense model waits in host memory (`parked`)
while sharded masks train and while a pruned copy is scored (`score_copy`). The ranks are spawned (see
tests/test_fsdp.py for why).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.test_fsdp import WORLD, _join_ranks


def _options(**kw):
    from patchc.job.options import PruneOptions

    return PruneOptions(steps=3, batch_size=4, block_len=32, train_data="real", eval_data=(), prior="magnitude",
                        tile=(16, 16), baselines=False, progress=False, plots=False, **kw)


def _worker(rank: int, out: Path) -> None:
    from patchc.job.corpus import load_data
    from patchc.job.model import load_bundle
    from patchc.job.stages import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=WORLD)
    try:
        opts = _options(fsdp=True)
        bundle = load_bundle(opts)
        data = load_data(bundle, opts, cache_dir=out / "cache")
        exported = bundle.export(bundle.model, fixed_len=opts.block_len)  # before the hook: tracing runs forward
        calls = []
        bundle.model.register_forward_hook(lambda *_: calls.append(1))
        plan, result = train(bundle, opts.patch_config(), data, opts, None, None, False, exported=exported)
        if rank == 0:
            torch.save({"calls": len(calls), "density": plan.density, "layers": len(plan.layers),
                        "loss": result.history[-1]["task"]}, out / "result.pt")
            plan.save(out / "plan.patch")
    finally:
        dist.destroy_process_group()


def test_fsdp_job_distils_from_its_shards_and_never_runs_the_dense_model(tmp_path):
    import patchc
    from patchc.job.corpus import load_data
    from patchc.job.model import load_bundle

    ranks = mp.start_processes(_worker, args=(tmp_path,), nprocs=WORLD, join=False, start_method="spawn")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one process with the same options: its teacher is the loaded model, and the hook sees it run
        from patchc.job.stages import global_batches, make_loss

        opts = _options()
        bundle = load_bundle(opts)
        prog = patchc.transform(bundle.export(bundle.model, fixed_len=opts.block_len), opts.patch_config())
        batch = global_batches(bundle, load_data(bundle, opts, cache_dir=tmp_path / "cache"), opts)(0)
        calls = []
        bundle.model.register_forward_hook(lambda *_: calls.append(1))
        loss = make_loss(bundle, bundle.model, opts)(prog, batch)
    finally:
        torch.set_num_threads(threads)
    _join_ranks(ranks)
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    assert len(calls) == 1 and torch.isfinite(loss)
    assert got["calls"] == 0, f"the loaded dense model ran {got['calls']} times while the sharded masks trained"
    plan = patchc.TilePlan.load(tmp_path / "plan.patch")
    plan.verify()
    assert len(plan.layers) == got["layers"] == 35 and abs(plan.density - 0.65) < 0.01


def test_parked_leaves_a_model_in_host_memory_alone():
    from patchc.job.model import parked

    model = torch.nn.Linear(8, 4)
    weight = model.weight
    for when in (True, False):
        with parked(model, when=when) as held:
            assert held is model and model.weight is weight and weight.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: parking moves weights off one")
def test_parked_frees_the_device_and_brings_back_the_same_parameters():
    from patchc.job.model import parked

    model = torch.nn.Linear(1024, 1024).cuda()
    params, values = list(model.parameters()), [p.detach().cpu().clone() for p in model.parameters()]
    before = torch.cuda.memory_allocated()
    with parked(model):
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert torch.cuda.memory_allocated() <= before - 1024 * 1024 * 4  # the 4 MB weight left the GPU
    assert all(a is b for a, b in zip(model.parameters(), params))  # an export sharing them follows
    assert all(p.is_cuda and torch.equal(p.detach().cpu(), v) for p, v in zip(model.parameters(), values))


def test_score_copy_evaluates_the_copy_with_the_dense_model_parked_and_drops_it(monkeypatch):
    import contextlib
    import types
    import weakref

    from patchc.job import stages

    dense, copies, log = torch.nn.Linear(4, 4), [], []

    @contextlib.contextmanager
    def parked(model):
        log.append(("park", model))
        yield model
        log.append(("back", model))

    def evaluate(bundle, model, data, opts, dense_ref=None):
        log.append(("evaluate", type(model)))  # not the copy itself: the test must not keep it alive
        return {"perplexity": 1.0}

    def make():
        copies.append(weakref.ref(copy := torch.nn.Linear(4, 4)))
        return copy

    monkeypatch.setattr(stages, "parked", parked)
    monkeypatch.setattr(stages, "evaluate", evaluate)
    assert stages.score_copy(types.SimpleNamespace(model=dense), make, {}, _options()) == {"perplexity": 1.0}
    assert [event for event, _ in log] == ["park", "evaluate", "back"] and log[0][1] is dense
    assert copies[0]() is None  # nothing holds the copy once its scores are back
