"""`patchc prune` refuses up front a run whose mask state alone cannot fit (`patchc.job.memory`)."""

from __future__ import annotations

import pytest
import torch

import patchc
from patchc.job import memory
from patchc.job.memory import bytes_per_weight, check_fits, masked_weights
from patchc.job.options import PruneOptions
from patchc.masking.hybrid_mask import HybridMask
from patchc.masking.optim import GradPeak, state_bytes
from patchc.masking.train import make_optimizer
from tests.conftest import STORIES, needs_shared

MODES = [dict(), dict(low_memory=True), dict(low_memory=True, nm_param="weight"),
         dict(low_memory=True, nm_param="weight", v_per_group=True), dict(nm_param="weight")]


def _program(model, nm_param: str = "pattern"):
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    return patchc.transform(model, patchc.PatchConfig(tile=(8, 8), steps=4, nm_param=nm_param), example_inputs=(ids,))


@pytest.mark.parametrize("changes", MODES, ids=lambda c: "+".join(c) or "default")
def test_bytes_per_weight_is_what_training_holds(tiny_mlp, changes):
    """The formula against the logits, Adam state and peak gradients of a real program after two steps
    (the tile logits, one per 8 x 8 tile, measured and taken off)."""
    opts = PruneOptions(tile=(8, 8), **changes)
    cfg = opts.mask_optim()
    prog = _program(tiny_mlp, opts.nm_param)
    params = prog.mask_parameters()
    opt = make_optimizer(prog, 1e-3, cfg)
    with GradPeak(params) as peak:
        patchc.train_masks(prog, lambda s: torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(s)),
                           lambda p, ids: p(ids).float().logsumexp(-1).mean(), steps=2, progress=False,
                           optimizer=opt, optim=cfg)
    measured = state_bytes(params, opt, peak.bytes)
    weights = sum(m.numel for m in prog.layers.values())
    tiles = [m.tile_logits for m in prog.modules() if isinstance(m, HybridMask)]
    tile_bytes = sum(t.numel() * 4 + sum(v.numel() * v.element_size() for k, v in opt.state[t].items() if k != "step")
                     for t in tiles)
    grads = measured["grads"] if not cfg.in_backward else 0  # low mode: one tensor's, freed before the next
    nm_bytes = measured["logits"] + measured["state"] + grads - tile_bytes
    if not cfg.in_backward:
        nm_bytes -= 4 * sum(t.numel() for t in tiles)  # their gradients too
    assert nm_bytes / weights == pytest.approx(bytes_per_weight(cfg, memory.logits_per_weight(opts)))


def test_masked_weights_counts_what_transform_masks(tiny_mlp):
    prog = _program(tiny_mlp)
    cfg = patchc.PatchConfig(tile=(8, 8))
    assert masked_weights(tiny_mlp, cfg) == sum(m.numel for m in prog.layers.values()) > 0
    assert masked_weights(tiny_mlp, cfg.replace(exclude=("*up*",))) == \
        sum(m.numel for f, m in prog.layers.items() if "up" not in f)


def test_check_fits_refuses_with_every_leaner_mode(tiny_mlp, monkeypatch):
    cfg = patchc.PatchConfig(tile=(8, 8))
    weights = masked_weights(tiny_mlp, cfg)
    opts = PruneOptions(tile=(8, 8))
    monkeypatch.setattr(memory, "free_bytes", lambda device: 24 * weights)
    check_fits(tiny_mlp, cfg, opts)  # exactly fits
    monkeypatch.setattr(memory, "free_bytes", lambda device: 10 * weights)
    with pytest.raises(ValueError) as err:
        check_fits(tiny_mlp, cfg, opts)
    msg = str(err.value)
    assert f"{weights:,} masked weights x 24 bytes" in msg and "on cpu" in msg
    assert "--low-memory: 12 bytes per weight" in msg and "(does not fit either)" in msg
    assert "--low-memory --nm-param weight --v-per-group: 6.5 bytes per weight" in msg and "(fits)" in msg
    check_fits(tiny_mlp, cfg, PruneOptions(tile=(8, 8), low_memory=True, nm_param="weight"))
    check_fits(tiny_mlp, cfg, PruneOptions(tile=(8, 8), variant="tile"))  # tile logits only: nothing to refuse
    check_fits(tiny_mlp, cfg, PruneOptions(tile=(8, 8), fsdp=True), ranks=3)  # 24 / 3 = 8 bytes per rank
    with pytest.raises(ValueError, match="on each of 2 ranks"):
        check_fits(tiny_mlp, cfg, PruneOptions(tile=(8, 8), fsdp=True), ranks=2)
    monkeypatch.setattr(memory, "free_bytes", lambda device: None)  # unknown: no check
    check_fits(tiny_mlp, cfg, opts)


def test_check_fits_under_fsdp_on_gpus_counts_the_weights_parked_in_host_memory(tiny_mlp, monkeypatch):
    cfg = patchc.PatchConfig(tile=(8, 8))
    need = 24 * masked_weights(tiny_mlp, cfg) / 2  # the masks' state on each of 2 ranks
    dense = sum(p.numel() * p.element_size() for p in tiny_mlp.parameters())
    opts = PruneOptions(tile=(8, 8), fsdp=True, device="cuda")
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - dense / 2)  # free with the whole model loaded
    check_fits(tiny_mlp, cfg, opts, ranks=2)  # while the masks train, half of it is parked in host memory
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - dense / 2 - 64)
    with pytest.raises(ValueError, match="are free with 1/2 of the model's weights"):
        check_fits(tiny_mlp, cfg, opts, ranks=2)
    with pytest.raises(ValueError, match="are free with the model loaded"):  # on CPUs nothing moves
        check_fits(tiny_mlp, cfg, PruneOptions(tile=(8, 8), fsdp=True), ranks=2)


def test_calibration_memory_bounds_the_gpu_and_stores_on_the_host(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 10 << 30)
    assert memory.calibration_memory(PruneOptions(device="cuda")) == (5 << 30, "cpu")
    assert memory.calibration_memory(PruneOptions()) == (None, None)  # a CPU: they stay where they are


def test_free_bytes_reads_the_host():
    free = memory.free_bytes("cpu")
    assert free is None or 0 < free < 1 << 50


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_free_bytes_of_a_gpu_drops_by_what_is_allocated_there():
    before = memory.free_bytes("cuda")
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, taken from the driver
    after = memory.free_bytes("cuda")
    assert 0 < after < before <= torch.cuda.get_device_properties(0).total_memory
    del block


def test_prune_refuses_before_generating_text_or_claiming_a_folder(monkeypatch, tmp_path):
    from patchc.job import prune

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
    monkeypatch.setattr(prune, "load_data", lambda *a, **k: pytest.fail("loaded text for a run that cannot fit"))
    with pytest.raises(ValueError, match="mask training needs at least"):
        prune.run_prune(PruneOptions(out=str(tmp_path / "run"), progress=False))
    assert not (tmp_path / "run").exists()


def test_recovery_needs_a_second_model_and_adam_in_the_weights_dtype(tiny_mlp, monkeypatch):
    cfg = patchc.PatchConfig(tile=(8, 8))
    weights = masked_weights(tiny_mlp, cfg)
    model_bytes = 4 * sum(p.numel() for p in tiny_mlp.parameters())  # fp32, the tied head once
    need = model_bytes + weights * (3 * 4 + 2)
    memory.check_recovery(tiny_mlp, weights, need, "cpu")
    with pytest.raises(ValueError, match=r"weight recovery needs at least .* \(%s weights\).*later" % f"{weights:,}"):
        memory.check_recovery(tiny_mlp, weights, need - 1, "cpu", hint="later")
    half = tiny_mlp.to(torch.bfloat16)
    memory.check_recovery(half, weights, model_bytes // 2 + weights * (3 * 2 + 2), "cpu")
    # prune checks recovery only with --recover, after the masks (which need less in the leanest mode)
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - 1)
    lean = dict(tile=(8, 8), low_memory=True, nm_param="weight", v_per_group=True)
    check_fits(tiny_mlp.float(), cfg, PruneOptions(**lean))
    with pytest.raises(ValueError, match="patchc recover RUN.*--fsdp --recover"):
        check_fits(tiny_mlp.float(), cfg, PruneOptions(**lean, recover=10))


def test_sharded_recovery_needs_a_share_of_two_copies_and_the_state(tiny_mlp):
    weights = masked_weights(tiny_mlp, patchc.PatchConfig(tile=(8, 8)))
    model_bytes = 4 * sum(p.numel() for p in tiny_mlp.parameters())
    need = (2 * model_bytes + weights * (3 * 4 + 2)) / 4  # a student and a teacher, each rank 1/4 of both and the state
    parked = model_bytes  # the loaded model leaves the GPU while the shards recover
    memory.check_recovery(tiny_mlp, weights, int(need) - parked + 1, "cuda", share=4)
    with pytest.raises(ValueError, match=r"on each of 4 ranks: 1/4 of a copy of the model and of the dense teacher"):
        memory.check_recovery(tiny_mlp, weights, int(need) - parked - 1, "cuda", share=4)
    memory.check_recovery(tiny_mlp, weights, int(need) + 1, "cpu", share=4)  # host memory: nothing leaves
    with pytest.raises(ValueError, match=r"on each of 4 ranks"):
        memory.check_recovery(tiny_mlp, weights, int(need) - 1, "cpu", share=4)


def _tiny_llama_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama", model


@needs_shared
def test_weight_bytes_reads_the_size_without_loading(tmp_path):
    from patchc.models import load_model
    from patchc.models.spec import weight_bytes

    folder, model = _tiny_llama_folder(tmp_path)
    assert weight_bytes(folder, torch.bfloat16) == sum(p.numel() for p in model.parameters()) * 2  # built on meta
    assert weight_bytes(folder / "config.json", torch.float32) == sum(p.numel() for p in model.parameters()) * 4
    for spec in (str(STORIES / "stories260K.bin"), "minilm"):  # within 2% (a llama2.c file's rope tables; the pooler)
        loaded = sum(p.numel() for p in load_model(spec).model.parameters()) * 2
        assert loaded <= weight_bytes(spec, torch.bfloat16) <= 1.02 * loaded, spec
    assert weight_bytes(tmp_path / "nothing-here", torch.bfloat16) is None


def test_check_loads_refuses_a_model_larger_than_the_free_gpu_memory(tmp_path, monkeypatch):
    folder, model = _tiny_llama_folder(tmp_path)
    need = sum(p.numel() for p in model.parameters()) * 2
    opts = PruneOptions(model=str(folder), device="cuda")
    monkeypatch.setattr(memory, "free_bytes", lambda device: need)
    memory.check_loads(opts, torch.bfloat16)  # exactly fits
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - 1)
    with pytest.raises(ValueError, match=r"its weights take .* in bfloat16 and cuda has .* free\. .* must fit on one"):
        memory.check_loads(opts, torch.bfloat16)
    memory.check_loads(PruneOptions(model=str(folder)), torch.bfloat16)  # a CPU: nothing to refuse
    monkeypatch.setattr(memory, "free_bytes", lambda device: None)
    memory.check_loads(opts, torch.bfloat16)  # unknown free memory: no check


@needs_shared
def test_load_bundle_loads_in_the_weight_dtype(monkeypatch):
    """The model comes in the weights' dtype (no fp32 copy first) and equals the fp32 load cast after it."""
    import patchc.models as models
    from patchc.job.model import load_bundle

    asked = []
    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: asked.append(k.get("dtype")) or load(*a, **k))
    bundle = load_bundle(PruneOptions(model="minilm", dtype="bfloat16", progress=False), training=False)
    assert asked == [torch.bfloat16]
    cast = load("minilm").model.to(torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(bundle.model.state_dict().values(), cast.state_dict().values()))
    assert {p.dtype for p in bundle.reload().parameters()} == {torch.bfloat16}
