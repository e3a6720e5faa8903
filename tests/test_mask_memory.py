"""The low-memory mask optimizer: stochastic rounding, Adam's math, the step in backward, exact resume,
mode checks on resume, and the bytes per masked weight of each mode (CPU, tiny model)."""

from __future__ import annotations

import pytest
import torch

import patchc
from patchc.masking.optim import (GradPeak, LowMemAdam, MaskOptimConfig, StepInBackward, counter_bits, make_mask_optimizer,
                                  round_into, state_bytes)
from patchc.masking.hybrid_mask import HybridMask
from patchc.masking.train import CheckpointIO, make_optimizer

LOW = MaskOptimConfig(memory="low")


def _setup(tiny_mlp, steps: int = 40, **cfg):
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    return patchc.transform(tiny_mlp, patchc.PatchConfig(tile=(8, 8), steps=steps, **cfg), example_inputs=(ids,))


def _batches(step: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(step))


def _loss(prog, ids):
    return prog(ids).float().logsumexp(-1).mean()


def test_config_presets_and_errors():
    assert (LOW.state_dtype, LOW.in_backward) == ("bfloat16", True)
    assert not MaskOptimConfig().custom and MaskOptimConfig(memory="low", in_backward=False).custom
    for bad, match in (({"memory": "tiny"}, "memory"), ({"state_dtype": "float16"}, "state_dtype"),
                       ({"betas": (0.9, 1.0)}, "betas"), ({"eps": 0.0}, "eps")):
        with pytest.raises(ValueError, match=match):
            MaskOptimConfig(**bad)


def test_stochastic_rounding_keeps_a_slow_decay_that_nearest_rounding_freezes():
    # v *= 0.999 moves it by 0.1%, below bf16's spacing near 1: rounding to nearest never leaves 1.0.
    n, steps = 4096, 200
    nearest = torch.ones(n, dtype=torch.bfloat16)
    sr = torch.ones(n, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        round_into(nearest, nearest.float() * 0.999, None)
        round_into(sr, sr.float() * 0.999, torch.randint(0, 2**16, (n,), generator=gen, dtype=torch.int32))
    exact = 0.999**steps
    assert torch.all(nearest == 1.0)
    assert abs(sr.float().mean().item() - exact) < 0.005
    signed = -torch.ones(n, dtype=torch.bfloat16)  # the sign bit is left alone
    round_into(signed, signed.float() * 0.999, torch.randint(0, 2**16, (n,), generator=gen, dtype=torch.int32))
    assert torch.all(signed < 0)


def test_fp32_state_equals_torch_adam_bit_for_bit():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(64, 6)), torch.nn.Parameter(torch.randn(8, 8))
    a2, b2 = (torch.nn.Parameter(p.detach().clone()) for p in (a, b))
    ours = LowMemAdam([a, b], lr=1e-2, state_dtype=torch.float32)
    ref = torch.optim.Adam([a2, b2], lr=1e-2, foreach=False)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        for p, q in ((a, a2), (b, b2)):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    assert torch.equal(a, a2) and torch.equal(b, b2)


def test_bf16_state_tracks_fp32_adam():
    torch.manual_seed(0)
    target = torch.randn(256, 6)
    p32, p16 = torch.nn.Parameter(torch.zeros(256, 6)), torch.nn.Parameter(torch.zeros(256, 6))
    ref, low = torch.optim.Adam([p32], lr=1e-2), LowMemAdam([p16], lr=1e-2)
    for _ in range(100):
        for p, opt in ((p32, ref), (p16, low)):
            p.grad = p.detach() - target  # gradient of a quadratic
            opt.step()
    assert low.state[p16]["exp_avg"].dtype == torch.bfloat16
    assert (p16 - p32).abs().max() < 0.02 * target.abs().max()


def test_step_in_backward_frees_grads_and_matches_a_step_after_backward():
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    ws = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(3)]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in ws]

    def loss(params):
        h = x
        for w in params:
            h = torch.tanh(h @ w)
        return (h * 10).square().sum()  # large: the per-tensor clip binds

    hooked, plain = LowMemAdam(ws, lr=1e-2), LowMemAdam(copies, lr=1e-2)
    with StepInBackward(hooked, ws, grad_clip=0.5):
        loss(ws).backward()
    assert all(w.grad is None for w in ws)
    loss(copies).backward()
    for p in copies:
        assert torch.linalg.vector_norm(p.grad) > 0.5
        torch.nn.utils.clip_grad_norm_([p], 0.5)
    plain.step()
    for w, c in zip(ws, copies):
        assert torch.equal(w, c)
    loss(ws).backward()  # hooks removed on exit: the gradient stays
    assert ws[0].grad is not None


def test_low_memory_resume_equals_straight_run_exactly(tiny_mlp, tmp_path):
    straight = _setup(tiny_mlp, steps=100)
    patchc.train_masks(straight, _batches, _loss, steps=100, lr=1e-2, progress=False, optim=LOW)
    assert all(p.grad is None for p in straight.mask_parameters())

    ckpt = tmp_path / "low.ckpt"
    first = _setup(tiny_mlp, steps=100)
    patchc.train_masks(first, _batches, _loss, steps=50, lr=1e-2, checkpoint=ckpt, progress=False,
                       schedule_steps=100, optim=LOW)
    resumed = _setup(tiny_mlp, steps=100)
    seen = {}

    class Spy(CheckpointIO):  # the CheckpointIO hook still decides how the state is read
        def load(self, path, prog, optimizer):
            seen["optimizer"] = optimizer
            return super().load(path, prog, optimizer)

    patchc.train_masks(resumed, _batches, _loss, steps=100, lr=1e-2, checkpoint=ckpt, resume=True, progress=False,
                       optim=LOW, checkpoint_io=Spy())
    assert all(v.dtype == torch.bfloat16 for s in seen["optimizer"].state.values() for k, v in s.items() if k != "step")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert not any(torch.equal(a, b) for a, b in zip(straight.mask_parameters(), _setup(tiny_mlp).mask_parameters()))


def test_resume_refuses_another_memory_mode(tiny_mlp, tmp_path):
    ckpt = tmp_path / "default.ckpt"
    patchc.train_masks(_setup(tiny_mlp), _batches, _loss, steps=2, checkpoint=ckpt, progress=False)
    with pytest.raises(ValueError, match=r"default\.ckpt: .*optimizer Adam \(now LowMemAdam\(bfloat16\)\)"):
        patchc.train_masks(_setup(tiny_mlp), _batches, _loss, steps=2, checkpoint=ckpt, resume=True, progress=False,
                           optim=LOW)


def test_low_mode_halves_the_bytes_per_weight(tiny_mlp):
    per_weight, grads = {}, {}
    for cfg in (MaskOptimConfig(), LOW):
        prog = _setup(tiny_mlp)
        params = prog.mask_parameters()
        opt = make_mask_optimizer(params, 1e-3, cfg)
        with GradPeak(params) as peak:
            patchc.train_masks(prog, _batches, _loss, steps=2, progress=False, optimizer=opt, optim=cfg)
        b = state_bytes(params, opt, peak.bytes)
        weights = sum(m.numel for m in prog.layers.values())
        per_weight[cfg.memory], grads[cfg.memory] = (b["logits"] + b["state"]) / weights, b["grads"]
    logits_per_weight = sum(p.numel() for p in params) / weights
    assert per_weight["default"] == pytest.approx(12 * logits_per_weight)  # logits + m + v, fp32
    assert per_weight["low"] == pytest.approx(8 * logits_per_weight)  # fp32 logits + bf16 m, v
    assert grads["default"] == 4 * sum(p.numel() for p in params)  # every gradient alive at the step
    assert grads["low"] == 4 * max(p.numel() for p in params)  # one tensor's, freed before the next


def _adam_mini_reference(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, b1=0.9, b2=0.999, eps=1e-8):
    """Adam with one v per row (the mean of the row's squared gradients), written out step by step."""
    p, m, v = p0.clone().double(), torch.zeros_like(p0).double(), torch.zeros(p0.shape[0], 1).double()
    for t, g in enumerate(grads, 1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * (g * g).mean(-1, keepdim=True)
        p = p - lr / (1 - b1**t) * m / ((v / (1 - b2**t)).sqrt() + eps)
    return p


def test_v_per_group_is_adam_with_one_second_moment_per_group():
    torch.manual_seed(0)
    nm, tile = torch.nn.Parameter(torch.randn(50, 4)), torch.nn.Parameter(torch.randn(6, 4))
    start = {id(p): p.detach().clone() for p in (nm, tile)}
    cfg = MaskOptimConfig(memory="low", state_dtype="float32", v_per_group=True)
    opt = make_mask_optimizer([tile, nm], 1e-2, cfg, grouped=[nm])
    grads = {id(p): [torch.randn(p.shape, generator=torch.Generator().manual_seed(s + 9 * i)) * (1 + i)
                     for s in range(6)] for i, p in enumerate((nm, tile))}
    for s in range(6):
        for p in (nm, tile):
            p.grad = grads[id(p)][s].clone()
        opt.step()
    # The 2:4 logits share v per row; the tile logits (4 columns too, but not a group) keep one v each.
    assert opt.state[nm]["exp_avg_sq"].shape == (50, 1) and opt.state[tile]["exp_avg_sq"].shape == (6, 4)
    torch.testing.assert_close(nm.detach().double(), _adam_mini_reference(start[id(nm)], grads[id(nm)], 1e-2),
                               rtol=0, atol=1e-6)
    plain = torch.nn.Parameter(start[id(tile)].clone())
    ref = torch.optim.Adam([plain], lr=1e-2)
    for s in range(6):
        plain.grad = grads[id(tile)][s].clone()
        ref.step()
    torch.testing.assert_close(tile.detach(), plain.detach(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="grouped"):
        make_mask_optimizer([nm], 1e-2, cfg)
    assert isinstance(make_mask_optimizer([tile], 1e-2, cfg, grouped=[]), LowMemAdam)  # tile-only: nothing to share


def test_v_per_group_bytes_and_resume_check(tiny_mlp, tmp_path):
    cfg = MaskOptimConfig(memory="low", v_per_group=True)
    prog = _setup(tiny_mlp, nm_param="weight")
    opt = make_optimizer(prog, 1e-3, cfg)
    patchc.train_masks(prog, _batches, _loss, steps=2, progress=False, optimizer=opt, optim=cfg,
                       checkpoint=tmp_path / "v.ckpt")
    weights = sum(m.numel for m in prog.layers.values())
    tiles = sum(m.tile_logits.numel() for m in prog.modules() if isinstance(m, HybridMask))
    b = state_bytes(prog.mask_parameters(), opt)
    # 4 fp32 scores + 4 bf16 m per 4 weights, one bf16 v per group; each tile logit: fp32 + bf16 m, v.
    assert b["logits"] + b["state"] == 4 * weights + 2 * weights + weights // 2 + 8 * tiles
    with pytest.raises(ValueError, match=r"v per group\) \(now LowMemAdam\(bfloat16\)\)"):
        patchc.train_masks(_setup(tiny_mlp, nm_param="weight"), _batches, _loss, steps=2, progress=False, optim=LOW,
                           checkpoint=tmp_path / "v.ckpt", resume=True)


def test_rounding_noise_of_a_slice_is_the_whole_tensors_slice():
    # What an FSDP shard relies on: rows [a, b) draw exactly what the whole tensor draws there, also
    # across the 2^20-element blocks the stream is cut into.
    cpu, total = torch.device("cpu"), 3 * 2**20 + 5
    whole = counter_bits(11, 0, (total,), cpu, total)
    for start, n in ((0, 7), (2**20 - 3, 10), (2**21 + 17, 2**20 - 100), (total - 5, 5)):
        assert torch.equal(counter_bits(11, start, (n,), cpu, total), whole[start:start + n]), (start, n)
    assert 0 <= int(whole.min()) and int(whole.max()) < 2**31
    assert abs((whole & 0xFFFF).float().mean().item() / 2**16 - 0.5) < 0.01  # the 16 bits that round m
    assert not torch.equal(counter_bits(12, 0, (64,), cpu, 64), counter_bits(11, 0, (64,), cpu, 64))
    with pytest.raises(ValueError, match="outside"):
        counter_bits(11, total - 2, (5,), cpu, total)
