"""Weight recovery sharded by FSDP2 on 2 gloo processes (CPU): equal to one process (a Llama, a BERT encoder, a
Mixtral with fused experts), half the state per rank, and a checkpoint that goes on in one process or on two
ranks, whichever wrote it.

The ranks are spawned (see test_fsdp.py for why) and rebuild the tiny Llama from a saved state dict; rank 0 reads
the plan from a file. This process runs the single-process references meanwhile and compares.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard

import patchc
from patchc.ir import TilePlan
from patchc.ir.tiles import to_tiles
from patchc.job.distributed import rank_slice
from patchc.job.fsdp_recover import recover_sharded
from patchc.job.encoder_eval import layerwise_distillation_loss
from patchc.job.losses import kd_loss
from patchc.masking.recover import RecoverConfig
from patchc.models.outputs import logits_of
from patchc.pruning.patterns import mask_24, merge_tiles
from patchc.utils.names import block_index
from tests.conftest import needs_shared
from tests.test_fsdp import WORLD, _join_ranks
from tests.test_recover import check_structure

STEPS, HALF, LR, TILE = 6, 3, 1e-2, (16, 16)
CFG = RecoverConfig(steps=STEPS, lr=LR, score_batches=2)


def _model():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   mlp_bias=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _encoder():
    """A tiny BERT as the job holds an encoder: its `layer_states` (not forward) is what recovery distils."""
    import transformers

    from patchc.models.hf import EncoderWrapper

    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    return EncoderWrapper(transformers.BertModel(cfg)).eval()


def _experts():
    """A tiny Mixtral: fused 3-D experts, one plan layer per expert slice, sharded along the experts."""
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def _hardened(model) -> TilePlan:
    """The plan of the magnitude prior at 35% (expert slices named "<param>.<e>", as the job's plans are)."""
    from patchc.models.hf_export import export_causal_lm

    prog = patchc.transform(export_causal_lm(model), patchc.PatchConfig(tile=TILE, prior="magnitude", steps=1))
    return patchc.harden(prog)


def _layerwise(teacher):
    """The job's encoder recovery loss; no padding, so each rank's token mean is half of the whole batch's."""
    def loss(model, ids):
        mask = torch.ones_like(ids)
        with torch.no_grad():
            target = teacher.layer_states(ids, mask)
        return layerwise_distillation_loss(model.layer_states(ids, mask), target, mask)

    return loss


def _plan(model) -> TilePlan:
    """Every third tile of each block projection dense, the rest 2:4 by magnitude."""
    masks = {}
    for fqn, w in model.named_parameters():
        if block_index(fqn) is not None and w.dim() == 2:
            grid = to_tiles(w.detach(), TILE).shape[:2]
            dense = (torch.arange(grid[0] * grid[1]) % 3 == 0).view(grid)
            masks[fqn] = merge_tiles(dense, mask_24(w.detach().abs(), fqn), TILE)
    return TilePlan.from_masks(model, masks, tile=TILE)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step))


class _Dies(RuntimeError):
    pass


def _kd(teacher, dies_at: int | None = None):
    """KD to `teacher`'s logits; with `dies_at`, the loss of that training call raises (a crash mid-recovery)."""
    calls = [0]

    def loss(model, ids):
        calls[0] += 1
        if calls[0] == dies_at:
            raise _Dies
        with torch.no_grad():
            target = logits_of(teacher(ids))
        return kd_loss(logits_of(model(ids)), target)

    return loss


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def _worker(rank: int, files: Path) -> None:
    torch.set_num_threads(1)  # two ranks and the reference share the cores
    dist.init_process_group("gloo", init_method=f"file://{files / 'rendezvous'}", rank=rank, world_size=WORLD)
    try:
        state = torch.load(files / "dense.pt")
        plan = TilePlan.load(files / "plan.patch") if rank == 0 else None
        batches = lambda step: rank_slice(_batch(step), rank, WORLD)  # noqa: E731
        runs = {}
        for run, resume in (("straight", False), ("resumed", True)):
            student, teacher = _model(), _model()
            student.load_state_dict(state), teacher.load_state_dict(state)
            runs[run] = recover_sharded(plan, student, teacher, batches, _kd(teacher), CFG, progress=False,
                                        checkpoint=files / f"{run}.ckpt", checkpoint_every=HALF, resume=resume)
            if run == "straight":
                placements = {n: p.placements for n, p in student.named_parameters()}
                shares = [None] * WORLD
                dist.all_gather_object(shares, {"student": _local_bytes(student.parameters()),
                                                "teacher": _local_bytes(teacher.parameters())})
        student, teacher = _encoder(), _encoder()
        encoder_plan = _plan(student) if rank == 0 else None
        runs["encoder"] = recover_sharded(encoder_plan, student, teacher, batches, _layerwise(teacher), CFG,
                                          progress=False)
        student, teacher = _experts(), _experts()
        experts_plan = TilePlan.load(files / "experts.patch") if rank == 0 else None
        runs["experts"] = recover_sharded(experts_plan, student, teacher, batches, _kd(teacher), CFG, progress=False)
        if rank == 0:
            torch.save({"placements": placements, "shares": shares}, files / "result.pt")
            for run, rec in runs.items():
                rec.save(files / f"{run}.patch")
        else:
            assert all(rec is None for rec in runs.values())
    finally:
        dist.destroy_process_group()


def _assert_same_weights(got: TilePlan, want: TilePlan, atol: float) -> None:
    for fqn, layer in want.layers.items():
        torch.testing.assert_close(got.layers[fqn].to_dense(), layer.to_dense(), rtol=0, atol=atol, msg=fqn)


def test_sharded_recovery_equals_one_process_and_resumes_either_way(tmp_path):
    pytest.importorskip("transformers")
    dense = _model()
    plan = _plan(dense)
    torch.save(dense.state_dict(), tmp_path / "dense.pt")
    plan.save(tmp_path / "plan.patch")
    # a single-process recovery that dies at step 4 leaves its step-3 checkpoint for the ranks to go on from
    with pytest.raises(_Dies):
        patchc.recover(plan, copy.deepcopy(dense), _batch, _kd(dense, dies_at=HALF + 1), progress=False,
                       steps=STEPS, lr=LR, score_batches=0, checkpoint=tmp_path / "one.ckpt", checkpoint_every=HALF)
    shutil.copy(tmp_path / "one.ckpt", tmp_path / "resumed.ckpt")
    experts = _experts()
    experts_plan = _hardened(experts)
    experts_plan.save(tmp_path / "experts.patch")

    ranks = mp.start_processes(_worker, args=(tmp_path,), nprocs=WORLD, join=False, start_method="spawn")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks use the other core meanwhile
    try:
        want = patchc.recover(plan, copy.deepcopy(dense), _batch, _kd(dense), progress=False, steps=STEPS, lr=LR,
                              score_batches=2)
        encoder = _encoder()
        want_encoder = patchc.recover(_plan(encoder), encoder, _batch, _layerwise(_encoder()), progress=False,
                                      steps=STEPS, lr=LR, score_batches=2)
        want_experts = patchc.recover(experts_plan, experts, _batch, _kd(_experts()), progress=False, steps=STEPS,
                                      lr=LR, score_batches=2)
    finally:
        torch.set_num_threads(threads)
    _join_ranks(ranks)
    got = {run: TilePlan.load(tmp_path / f"{run}.patch") for run in ("straight", "resumed", "encoder", "experts")}
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    # (a) Two ranks recover what one process does, up to float reassociation (two half-batch means against one),
    # which Adam's first steps amplify: measured max 3.2e-5 after 6 steps at lr 1e-2 (a step-3 checkpoint resumed
    # on the ranks: 1.5e-8); a rank recovering on its half of each batch alone is off by 0.066.
    _assert_same_weights(got["straight"], want, atol=2e-4)
    check_structure(got["straight"], plan)
    for key in ("loss_before", "loss_after"):
        assert got["straight"].meta["recovery"][key] == pytest.approx(want.meta["recovery"][key], rel=1e-5), key
    assert got["straight"].meta["fingerprints"] == want.meta["fingerprints"]  # still applies to the dense source
    got["straight"].apply(_model())

    # An encoder distils its layer states through `layer_states`, which FSDP2 gathers for as for forward (without
    # that, the embedding reads its shard: "got mixed torch.Tensor and DTensor"); measured max 6.9e-6.
    _assert_same_weights(got["encoder"], want_encoder, atol=2e-4)
    # Fused experts: each 3-D parameter is sharded along its experts, its masks too; measured max 2.3e-6.
    assert sum(".experts." in name for name in want_experts.layers) == 2 * 2 * 4  # gate_up, down x blocks x experts
    _assert_same_weights(got["experts"], want_experts, atol=2e-4)

    # (b) The single process's step-3 checkpoint, resumed on two ranks: the straight recovery's weights.
    _assert_same_weights(got["resumed"], want, atol=2e-4)

    # (c) The ranks' last checkpoint (one file, gathered) resumes in one process, to their weights exactly.
    again = patchc.recover(plan, copy.deepcopy(dense), _batch, _kd(dense), progress=False, steps=STEPS, lr=LR,
                           score_batches=0, checkpoint=tmp_path / "straight.ckpt", resume=True)
    _assert_same_weights(again, got["straight"], atol=0)

    # (d) Every parameter is a Shard(0) DTensor; each rank holds about half of the student and the teacher.
    assert all(places == (Shard(0),) for places in result["placements"].values()), result["placements"]
    whole = sum(p.numel() * p.element_size() for p in dense.parameters())
    for part in ("student", "teacher"):
        shares = [share[part] for share in result["shares"]]
        assert sum(shares) == whole, part
        assert all(0.4 * whole <= share <= 0.6 * whole for share in shares), (part, shares)


def _torchrun(*args: str) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found beside the Python interpreter")
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "-m", "patchc", *args], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def pruned_on_ranks(tmp_path_factory) -> tuple[Path, dict, Path, dict]:
    """`torchrun ... patchc prune --fsdp --recover` (its folder and report rows) and `patchc recover` of the same
    run in one process (its folder and recover.json), the reference the ranks are held to."""
    from patchc.job.recover import run_recover

    tmp = tmp_path_factory.mktemp("torchrun")
    pruned = tmp / "pruned"
    _torchrun("prune", "--fsdp", "--recover", "6", "--steps", "4", "--batch-size", "4", "--no-baselines",
              "--no-progress", "--threads", "1", "--train-data", "real", "--eval-tokens", "256", "--prior", "magnitude",
              "--no-plots", "--out", str(pruned))
    rows = {r["name"]: r for r in json.loads((pruned / "report.json").read_text())["results"]}
    shutil.copytree(pruned, tmp / "alone", ignore=shutil.ignore_patterns("plan-recovered.patch"))
    return pruned, rows, tmp / "alone", run_recover(tmp / "alone", steps=6, progress=False)


def _assert_recovered_as_alone(folder: Path, alone: Path) -> None:
    """`folder`'s plan-recovered.patch came from 2 ranks and has the weights one process recovers in `alone`
    (measured: within 1.15e-5 of each other)."""
    single = TilePlan.load(alone / "plan-recovered.patch")
    assert "ranks" not in single.meta["recovery"]  # one process: `patchc.recover` itself
    sharded = TilePlan.load(folder / "plan-recovered.patch")
    assert sharded.meta["recovery"]["ranks"] == 2
    _assert_same_weights(sharded, single, atol=2e-4)


@needs_shared
@pytest.mark.slow
def test_prune_with_recover_under_torchrun_recovers_on_every_rank_what_one_process_recovers(pruned_on_ranks):
    pruned, rows, alone_folder, alone = pruned_on_ranks
    assert not (pruned / "recover.ckpt").exists()  # its row is kept
    _assert_recovered_as_alone(pruned, alone_folder)
    # measured: held-out perplexity within 2.2e-8 relative
    assert rows["PATCH joint + recovery"]["perplexity"] == pytest.approx(alone["results"][2]["perplexity"], rel=1e-5)


@needs_shared
@pytest.mark.slow
@pytest.mark.full  # the same sharded recovery as above, reached through `patchc recover`'s own command
def test_patchc_recover_under_torchrun_recovers_what_one_process_recovers(pruned_on_ranks, tmp_path):
    pruned, _, alone_folder, alone = pruned_on_ranks
    shutil.copytree(pruned, tmp_path / "ranks", ignore=shutil.ignore_patterns("plan-recovered.patch"))
    _torchrun("recover", str(tmp_path / "ranks"), "--steps", "6", "--no-progress", "--threads", "1")
    ranks = json.loads((tmp_path / "ranks" / "recover.json").read_text())
    _assert_recovered_as_alone(tmp_path / "ranks", alone_folder)
    assert ranks["results"][2]["perplexity"] == pytest.approx(alone["results"][2]["perplexity"], rel=1e-5)
    assert [r["perplexity"] for r in ranks["results"][:2]] == [r["perplexity"] for r in alone["results"][:2]]
