"""What a mask step keeps for backward (`patchc.job.activations`): the estimate from three short forwards of
the loaded model against what the trained program itself saves, and the warning `check_fits` gives."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch

import patchc
from patchc.job import activations, memory
from patchc.job.activations import PROBE_LENGTHS, per_sequence, probe_lengths, saved_bytes, step_bytes
from patchc.job.options import PruneOptions
from patchc.masking import fused, recompute
from patchc.models.hf_export import export_causal_lm

transformers = pytest.importorskip("transformers")


def _llama(attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = attn
    return transformers.LlamaForCausalLM(config).eval()


def _layers(model) -> list[str]:
    return memory.masked_layers(model, PruneOptions(tile=(16, 16)).patch_config())


def _program_saves(model, batch: int, length: int, low_memory: bool) -> int:
    """Bytes the trained program's forward keeps for backward: each storage once, without the model's and the
    program's parameters and buffers, the mask draw's Gumbel bank (one constant tensor) and, in the low-memory
    mode, what `recompute` swaps for a recipe."""
    opts = PruneOptions(tile=(16, 16), prior="magnitude")
    prog = patchc.transform(export_causal_lm(model, fixed_len=length), opts.patch_config())
    prog.train()
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    prog(ids)  # the first draw makes the bank
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), *prog.parameters(),
                                                    *prog.buffers(), *fused._BANKS.values())}
    kept: dict[int, int] = {}

    def pack(t):
        if low_memory and not isinstance(recompute._pack(t), torch.Tensor):
            return t  # redrawn in backward
        if t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with recompute.recompute_masked_weights() if low_memory else torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            prog(ids)
    return sum(kept.values())


@pytest.mark.parametrize("low_memory", [False, True], ids=["default", "low-memory"])
def test_the_estimate_is_what_the_trained_program_saves(low_memory):
    """Measured 5.4% (default) and 8.0% (low-memory) below the program's own: the exported graph keeps GQA's
    K / V repeated per head and an explicit (T, T) mask per attention, which the eager forward does not
    (9.5% on 4 layers of hidden 512); `warn_step` allows `STEP_MARGIN` for it."""
    model = _llama()
    opts = PruneOptions(tile=(16, 16), batch_size=4, block_len=96, low_memory=low_memory)
    step = step_bytes(model, _layers(model), opts)
    weights = sum(model.get_parameter(n).numel() * 4 for n in _layers(model))
    assert step.masked_weights == (0 if low_memory else weights)
    assert step.tokens == 4 * 96 and step.logits == 3 * 4 * 96 * 256 * 4  # student, its gradient, the teacher
    assert step_bytes(model, _layers(model), dataclasses.replace(opts, loss="lm")).logits == 2 * 4 * 96 * 256 * 4
    program = _program_saves(model, 4, 96, low_memory)
    assert program * 0.9 <= step.activations + step.masked_weights <= program


@pytest.mark.parametrize("low_memory", [False, True], ids=["default", "low-memory"])
def test_a_traced_moe_is_probed_as_its_program_runs_it(low_memory, monkeypatch):
    """DBRX's experts loop over the experts picked; the program runs every expert on every token
    (`patchc.models.traceable`), and so does the probe (`program_form`): 98.8% / 92.8% of the program's bytes,
    where the model's own loop gave 44% / 32%."""
    from tests.test_dbrx import _model

    model = _model(experts=8, ffn=128)  # experts that outweigh the attention: 8 of 128, 2 picked per token
    opts = PruneOptions(tile=(16, 16), batch_size=4, block_len=48, low_memory=low_memory)
    program = _program_saves(model, 4, 48, low_memory)
    step = step_bytes(model, _layers(model), opts)
    assert program * 0.9 <= step.activations + step.masked_weights <= program
    monkeypatch.setattr(activations, "program_form", lambda model: contextlib.nullcontext())
    looped = step_bytes(model, _layers(model), opts)
    assert looped.activations + looped.masked_weights < 0.5 * program


def test_quadratic_attention_is_carried_to_the_length():
    """Eager attention keeps (T, T) scores and probabilities: three probes at 16-64 tokens predict the bytes at
    200 tokens (quadratic), where a line through them would fall short."""
    model = _llama("eager")
    names = [model.get_parameter(n) for n in _layers(model)]
    at = saved_bytes(model, names, 200)
    assert per_sequence(model, names, 200) == pytest.approx(at, rel=0.01)
    line = saved_bytes(model, names, PROBE_LENGTHS[-1]) * 200 / PROBE_LENGTHS[-1]
    assert line < 0.95 * at


def test_a_model_of_fewer_positions_is_probed_within_them():
    model = _llama()
    model.config.max_position_embeddings = 40
    assert probe_lengths(model) == (10, 20, 40)
    names = [model.get_parameter(n) for n in _layers(model)]
    assert per_sequence(model, names, 40) == pytest.approx(saved_bytes(model, names, 40))
    model.config.max_position_embeddings = 3
    with pytest.raises(ValueError, match="3 positions is too short"):
        probe_lengths(model)


def test_a_probe_leaves_the_model_and_the_random_stream_as_they_were():
    model = _llama()
    model.requires_grad_(False)
    names = [model.get_parameter(n) for n in _layers(model)]
    names[0].requires_grad_(True)
    state = torch.get_rng_state()
    assert saved_bytes(model, names, 16) > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert names[0].requires_grad and not any(p.requires_grad for p in names[1:])


def test_ranks_split_the_batch_and_the_low_memory_mode_keeps_no_w_times_m():
    model = _llama()
    layers = _layers(model)
    alone = step_bytes(model, layers, PruneOptions(tile=(16, 16), batch_size=8))
    two = step_bytes(model, layers, PruneOptions(tile=(16, 16), batch_size=8, low_memory=True, fsdp=True), ranks=2)
    assert two.tokens == alone.tokens // 2 and two.activations == pytest.approx(alone.activations / 2)
    assert alone.masked_weights > 0 and two.masked_weights == 0  # FSDP2 ranks redraw it too (`tests/test_fsdp.py`)


def test_check_fits_warns_when_masks_and_a_step_exceed_the_free_memory(monkeypatch):
    model = _llama()
    opts = PruneOptions(tile=(16, 16), batch_size=8, block_len=128)
    cfg = opts.patch_config()
    floor = memory.masked_weights(model, cfg) * memory.bytes_per_weight(opts.mask_optim(), 6 / 4)
    step = step_bytes(model, _layers(model), opts)
    # room for the measured step but not for the program's extra (`STEP_MARGIN`): warned
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(floor + step.total * 1.05))
    with pytest.warns(UserWarning, match=r"will likely run out of memory on cpu: the masks need .* a step of 1,024 "
                      r"tokens keeps about .* W \* M .*--block-len, --low-memory"):
        memory.check_fits(model, cfg, opts, probe=True)
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(floor + step.total * 1.15))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memory.check_fits(model, cfg, opts, probe=True)
        memory.check_fits(model, cfg, opts)  # no probe (an encoder): nothing measured, nothing said
        monkeypatch.setattr(memory, "free_bytes", lambda device: int(floor))
        monkeypatch.setattr(model, "forward", lambda *a, **k: 1 / 0)  # a model the probe cannot run still trains
        memory.check_fits(model, cfg, opts, probe=True)
