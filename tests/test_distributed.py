"""torchrun with 2 processes (gloo, CPU) learns the same masks as one process with the same global batch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from patchc.ir import TilePlan
from tests.conftest import needs_shared

pytestmark = [needs_shared, pytest.mark.slow]

# The default SparseGPT prior: every rank must calibrate on the same (unsplit) text.
ARGS = ["prune", "--steps", "8", "--batch-size", "4", "--calib-blocks", "8", "--no-baselines", "--no-progress", "--threads", "1",
        "--self-tokens", "516", "--eval-tokens", "256", "--no-plots"]


def _run(launcher: list[str], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, "-m", "patchc", *ARGS, "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_two_processes_equal_one(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found beside the Python interpreter")
    from patchc.job.cli import main

    assert main([*ARGS, "--out", str(tmp_path / "one")]) == 0  # one process: this one (--threads 1, as the ranks)
    _run([torchrun, "--standalone", "--nproc_per_node=2"], tmp_path / "two")
    one = torch.load(tmp_path / "one" / "masks.ckpt", weights_only=True)["program"]
    two = torch.load(tmp_path / "two" / "masks.ckpt", weights_only=True)["program"]
    assert one.keys() == two.keys()
    # Gradients differ only by float reassociation (two half-batch means vs one mean); Adam turns
    # near-zero gradients into ~lr-sized steps, so after 8 steps at lr 1e-3 logits of scale ~0.07
    # agree to ~1e-5 (measured max 1.1e-5): 5e-5 is tight, a wrong reduction is off by ~1e-3.
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=5e-5, msg=key)
    state_one = torch.load(tmp_path / "one" / "masks.ckpt", weights_only=True)["history"][-1]
    state_two = torch.load(tmp_path / "two" / "masks.ckpt", weights_only=True)["history"][-1]
    assert state_two["task"] == pytest.approx(state_one["task"], rel=1e-5)  # logged loss is the global mean
    plan_one, plan_two = TilePlan.load(tmp_path / "one" / "plan.patch"), TilePlan.load(tmp_path / "two" / "plan.patch")
    assert plan_one.density == pytest.approx(plan_two.density, abs=1e-4)
    same = sum(int((plan_one.layers[f].mask() == plan_two.layers[f].mask()).sum()) for f in plan_one.layers)
    assert same / sum(lp.numel for lp in plan_one.layers.values()) > 0.9999
    # Rank 0 alone wrote the run's files.
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


# -- DDP resume: every rank goes on from the file rank 0 wrote --------------------------------------------------


def _ddp_worker(rank: int, out: str) -> None:
    """3 steps, then a fresh program (as a new process would build) resumed to 6, on 2 gloo ranks."""
    import torch.distributed as dist

    import patchc
    from patchc.job.distributed import RankZeroCheckpointIO, prepare_training, rank_slice

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        data = torch.randn(6, 8, 32, generator=torch.Generator().manual_seed(1))
        for steps in (3, 6):
            prog = patchc.transform(torch.export.export(model, (torch.randn(4, 32),)),
                                    patchc.PatchConfig(tile=(16, 16), sparsity=0.35, steps=6, prior="magnitude"))
            setup = prepare_training(prog, Path(out) / "masks.ckpt")
            loss = lambda _p, x, m=setup.forward_module: (m(x) - model(x)).pow(2).mean()  # noqa: E731
            patchc.train_masks(prog, lambda step: rank_slice(data[step], rank, 2), loss, steps=steps,
                               schedule_steps=6, checkpoint=setup.checkpoint, checkpoint_io=setup.checkpoint_io,
                               checkpoint_every=1, resume=True, progress=False)
            dist.barrier()
            del setup, loss  # DDP's reducer before its process group: torn down after it, it can wait on the peer
        torch.save(prog.state_dict(), f"{out}/rank{rank}.pt")
        try:  # a folder rank 1 cannot see, as on machines that share no filesystem
            RankZeroCheckpointIO().exists(Path(out) / ("masks.ckpt" if rank == 0 else "elsewhere.ckpt"))
        except ValueError as err:
            Path(f"{out}/unshared-rank{rank}.txt").write_text(str(err))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_resume_goes_on_from_rank_0s_checkpoint_on_every_rank(tmp_path):
    """`patchc prune --resume` under torchrun without --fsdp stopped on rank 1 ("needs checkpoint=PATH"): only
    rank 0 had the path. Now rank 0 writes the file and every rank reads it back: after 3 + 3 resumed steps the
    ranks hold the same logits (DDP never sends parameters again after it wraps: a rank that started afresh
    would differ)."""
    import torch.multiprocessing as mp

    from tests.test_fsdp import _join_ranks

    _join_ranks(mp.start_processes(_ddp_worker, args=(str(tmp_path),), nprocs=2, join=False, start_method="spawn"),
                timeout=180)
    first, second = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    for key, value in first.items():
        torch.testing.assert_close(second[key], value, rtol=0, atol=0, msg=key)
    assert torch.load(tmp_path / "masks.ckpt", weights_only=True)["step"] == 6
    for rank in (0, 1):  # every rank stops, with the reason, rather than some going on from the start
        said = (tmp_path / f"unshared-rank{rank}.txt").read_text()
        assert "only 1 of the 2 processes can read this checkpoint" in said


def test_ranks_wait_hours_for_rank_0s_solo_work_not_nccls_10_minutes(monkeypatch):
    """Rank 0 alone scores rows, recovers and runs the one-shot baselines while the others wait in a
    collective; NCCL's default 10-minute watchdog would end a 7B job there."""
    import datetime

    import torch.distributed as dist

    from patchc.job import distributed

    joined = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.update(backend=backend, **kw))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("PATCHC_DIST_TIMEOUT", raising=False)
    distributed.init_distributed("cpu")
    assert joined == {"backend": "gloo", "timeout": datetime.timedelta(hours=6)}
    monkeypatch.setenv("PATCHC_DIST_TIMEOUT", "90")
    distributed.init_distributed("cpu")
    assert joined["timeout"] == datetime.timedelta(seconds=90)
    for bad in ("0", "-5", "nan", "inf", "ten"):
        monkeypatch.setenv("PATCHC_DIST_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"PATCHC_DIST_TIMEOUT='{bad}': give the seconds"):
            distributed.init_distributed("cpu")


@pytest.fixture
def fake_group(monkeypatch) -> dict:
    """torch.distributed's join / leave, recorded instead of done, under a 2-process torchrun's environment."""
    import torch.distributed as dist

    state = {"joined": False, "joins": 0, "leaves": 0}
    monkeypatch.setattr(dist, "is_initialized", lambda: state["joined"])
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: state.update(joined=True,
                                                                                      joins=state["joins"] + 1))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: state.update(joined=False, leaves=state["leaves"] + 1))
    monkeypatch.setenv("WORLD_SIZE", "2")
    return state


def test_a_job_leaves_the_group_it_joined_when_it_ends_and_no_other(fake_group, monkeypatch):
    """A gloo group left to the interpreter's exit aborted a rank of a finished `torchrun ... patchc prune` (SIGABRT,
    "terminate called without an active exception"): the job leaves the group it joined. Not after an exception
    (another rank may be in a collective: torchrun ends them), nor a group joined before the job."""
    from patchc.job.distributed import process_group

    with process_group("cpu"):
        assert fake_group == {"joined": True, "joins": 1, "leaves": 0}
    assert fake_group == {"joined": False, "joins": 1, "leaves": 1}
    with pytest.raises(RuntimeError, match="boom"), process_group("cpu"):
        raise RuntimeError("boom")
    assert fake_group == {"joined": True, "joins": 2, "leaves": 1}
    with process_group("cpu"):  # joined before: not this job's to leave
        pass
    assert fake_group == {"joined": True, "joins": 2, "leaves": 1}
    fake_group["joined"] = False
    monkeypatch.setenv("WORLD_SIZE", "1")
    with process_group("cpu"):
        pass
    assert fake_group == {"joined": False, "joins": 2, "leaves": 1}


def test_patchc_prune_runs_inside_the_group_and_leaves_it(fake_group, monkeypatch, tmp_path):
    from patchc.job import prune
    from patchc.job.options import PruneOptions

    seen = []
    monkeypatch.setattr(prune, "_prune", lambda opts, command: seen.append(dict(fake_group)) or {"done": True})
    assert prune.run_prune(PruneOptions(out=str(tmp_path / "run"))) == {"done": True}
    assert seen == [{"joined": True, "joins": 1, "leaves": 0}] and fake_group["leaves"] == 1


def test_fsdp_in_one_process_warns_that_nothing_is_sharded(monkeypatch, tmp_path):
    """`patchc prune --fsdp` not launched by torchrun trains as one process would: said before the model loads."""
    from patchc.job import prune
    from patchc.job.options import PruneOptions

    def stop(opts):
        raise RuntimeError("stopped before loading")

    monkeypatch.setattr(prune, "load_bundle", stop)
    with pytest.warns(UserWarning, match=r"--fsdp in one process .*torchrun --nproc_per_node=N"):
        with pytest.raises(RuntimeError, match="stopped before loading"):
            prune._prune(PruneOptions(fsdp=True, out=str(tmp_path / "run")), None)
    with pytest.raises(RuntimeError, match="stopped before loading"):  # without --fsdp: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            prune._prune(PruneOptions(out=str(tmp_path / "run")), None)


def _recover_alone_worker(rank: int, out: str) -> None:
    """As `prune --recover` without --fsdp under torchrun: rank 0 recovers alone while the others wait."""
    import datetime

    import torch.distributed as dist

    import patchc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        said = ["waited"]
        if rank == 0:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
            x = torch.randn(4, 32)
            plan = patchc.harden(patchc.transform(model, patchc.PatchConfig(tile=(16, 16)), example_inputs=(x,)))
            patchc.recover(plan, model, [x] * 3, lambda m, b: m(b).pow(2).mean(), steps=12, lr=1e-3,
                           checkpoint=Path(out) / "recover.ckpt", checkpoint_every=5, progress=False)
            said = ["recovered"]
        dist.broadcast_object_list(said, src=0)  # the others wait for rank 0's result, in no other collective
        Path(f"{out}/rank{rank}.txt").write_text(said[0])
    finally:
        dist.destroy_process_group()


def test_recovery_on_rank_0_alone_takes_no_collective_the_others_miss(tmp_path):
    """The NaN check of weight recovery reduced over the ranks, but without --fsdp rank 0 recovers alone: it
    waited in that all_reduce while rank 1 waited in its broadcast (a hang until the process group's timeout)."""
    import torch.multiprocessing as mp

    from tests.test_fsdp import _join_ranks

    _join_ranks(mp.start_processes(_recover_alone_worker, args=(str(tmp_path),), nprocs=2, join=False,
                                   start_method="spawn"), timeout=120)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["recovered", "recovered"]
