"""The task loss taken a few positions at a time (`patchc.utils.chunks.piecewise`): the gradient of the whole
batch's loss, bit for bit, without the whole batch's (tokens, vocab) temporaries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import patchc
from patchc.job.losses import LossSpec, _task_share, make_lm_loss, task_loss
from patchc.utils import chunks
from patchc.utils.chunks import GPU_LOSS_ELEMENTS, piecewise, rows_at_once

V = 301  # odd, so that no piece is a power of two


def whole_batch_loss(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor, spec: LossSpec):
    """The loss as one expression over the whole batch: F.cross_entropy and F.kl_div's batchmean."""
    s, t = logits.float().flatten(0, 1), teacher.float().flatten(0, 1)
    total = s.new_zeros(())
    if spec.kind in ("lm", "lm+kd"):
        total = total + F.cross_entropy(s, targets.flatten())
    if spec.kind in ("kd", "lm+kd"):
        if spec.temperature != 1.0:
            s, t = s / spec.temperature, t / spec.temperature
        kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
        total = total + spec.kd_weight * (kl * spec.temperature**2)  # as the job's kd_loss, then its weight
    return total


def draw(dtype: torch.dtype, b: int = 3, t: int = 7):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(b, t, V, generator=gen) * 3).to(dtype)
    teacher = (torch.randn(b, t, V, generator=gen) * 3).to(dtype)
    return logits, torch.randint(0, V, (b, t), generator=gen), teacher


@pytest.mark.parametrize("rows", [1, 4, 1000])  # a row a piece, pieces of 4 with a tail of 1, one piece
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [LossSpec("lm"), LossSpec("kd"), LossSpec("lm+kd", 2.0, kd_weight=0.5),
                                  LossSpec("lm+kd", 3.0, kd_weight=0.3)], ids=["lm", "kd", "lm+kd-T2", "lm+kd-T3"])
def test_each_position_gets_the_whole_batchs_gradient_bit_for_bit(monkeypatch, rows, dtype, spec):
    monkeypatch.setattr(chunks, "CPU_ROW_ELEMENTS", rows * V)
    logits, targets, teacher = draw(dtype)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = task_loss(a, targets, teacher, spec)
    want = whole_batch_loss(b, targets, teacher, spec)
    got.backward()
    want.backward()
    assert got.dtype == torch.float32 and a.grad.dtype == dtype
    assert torch.equal(a.grad, b.grad)
    # a sum of piece sums: its last bits may differ (1.7 fp32 ulps on AVX-512 for bf16's kd: allow 4)
    torch.testing.assert_close(got, want, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    if rows == 1000:
        assert got.item() == want.item()


def test_a_scaled_loss_scales_the_gradient(monkeypatch):
    monkeypatch.setattr(chunks, "CPU_ROW_ELEMENTS", 4 * V)
    logits, targets, teacher = draw(torch.float32)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    (0.25 * task_loss(a, targets, teacher, LossSpec("lm+kd"))).backward()
    (0.25 * whole_batch_loss(b, targets, teacher, LossSpec("lm+kd"))).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-9)


class WholeSizeTensors(TorchDispatchMode):
    """The distinct storages of `numel` elements or more that operations produce while it is on."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.storages = numel, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and o.numel() >= self.numel:
                self.storages.add(o.untyped_storage().data_ptr())
        return out


def test_mask_trainings_loss_builds_no_temporary_of_the_whole_batch(monkeypatch):
    """Forward and backward of LM + KD hold three (tokens, vocab) tensors: the student's logits, the teacher's,
    and the logits' gradient. The whole batch's loss builds a dozen (log-softmaxes, KL terms, gradients)."""
    monkeypatch.setattr(chunks, "CPU_ROW_ELEMENTS", 4 * V)
    torch.manual_seed(0)
    student, teacher, hidden = torch.nn.Linear(8, V), torch.nn.Linear(8, V), torch.randn(2, 9, 8)
    bundle = SimpleNamespace(logits=lambda model, inputs: model(hidden))
    ids = torch.randint(0, V, (2, 10))
    seen = WholeSizeTensors(2 * 9 * V)
    with seen:
        make_lm_loss(bundle, teacher, LossSpec("lm+kd"))(student, ids).backward()
    assert len(seen.storages) == 3
    with WholeSizeTensors(2 * 9 * V) as before:
        logits = student(hidden)
        whole_batch_loss(logits, ids[:, 1:], teacher(hidden).detach(), LossSpec("lm+kd")).backward()
    assert len(before.storages) > 5  # what the check would catch (fewer addresses than tensors: some reuse one)


def test_without_grad_the_loss_is_its_value_alone(monkeypatch):
    monkeypatch.setattr(chunks, "CPU_ROW_ELEMENTS", 4 * V)
    logits, targets, teacher = draw(torch.float32)
    logits.requires_grad_()
    with torch.no_grad(), WholeSizeTensors(logits.numel()) as seen:
        value = task_loss(logits, targets, teacher, LossSpec("lm+kd"))
    inputs = {logits.untyped_storage().data_ptr(), teacher.untyped_storage().data_ptr()}  # and their views
    assert value.grad_fn is None and seen.storages == inputs  # no gradient was taken
    torch.testing.assert_close(value, whole_batch_loss(logits, targets, teacher, LossSpec("lm+kd")).detach())


def test_a_second_backward_through_one_loss_is_refused():
    logits, targets, teacher = draw(torch.float32)
    loss = task_loss(logits.requires_grad_(), targets, teacher, LossSpec("kd"))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_bad_inputs_are_named():
    logits, targets, teacher = draw(torch.float32)
    with pytest.raises(ValueError, match=r"needs teacher logits of the student's shape \(3, 7, 301\), got None"):
        task_loss(logits, targets, None, LossSpec("kd"))
    with pytest.raises(ValueError, match=r"got \(3, 6, 301\)"):
        task_loss(logits, targets, teacher[:, :6], LossSpec("lm+kd"))
    with pytest.raises(ValueError, match="logits must be"):
        piecewise(lambda x: x.sum(), logits)  # not (rows, V)
    with pytest.raises(ValueError, match=r"\(21, 301\) and \[\(20,\)\]"):
        piecewise(lambda x, t: x.sum(), logits.flatten(0, 1), targets.flatten()[:20])
    with pytest.raises(ValueError, match="rows > 0"):
        piecewise(lambda x: x.sum(), logits.flatten(0, 1)[:0])


def test_lm_loss_takes_the_gradient_of_one_cross_entropy(monkeypatch):
    """`patchc.lm_loss`, the public next-token loss, in pieces of 4 positions: one F.cross_entropy's gradient."""
    monkeypatch.setattr(chunks, "CPU_ROW_ELEMENTS", 4 * V)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Linear(8, V))
    ids = torch.randint(0, V, (3, 8))
    patchc.lm_loss(model, ids).backward()
    got = model[1].weight.grad.clone()
    model.zero_grad()
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert torch.equal(got, model[1].weight.grad)


def test_a_gpu_takes_the_loss_in_pieces_of_gpu_loss_elements():
    logits = torch.empty(8 * 255, 151936, device="meta")  # the device decides; meta is not a CPU
    assert rows_at_once(logits, GPU_LOSS_ELEMENTS) == GPU_LOSS_ELEMENTS // 151936 == 441
    assert rows_at_once(logits) == 8 * 255  # a loop that only reads takes all the rows
    assert rows_at_once(torch.empty(5, 10**9, device="meta"), GPU_LOSS_ELEMENTS) == 1


def test_off_the_cpu_the_loss_runs_in_pieces_with_a_whole_gradient():
    """The path a GPU takes, on meta tensors: 8 x 255 positions of a 152K vocabulary in pieces of 441 rows
    (4 and a tail of 276), bf16 teacher logits, a gradient of the logits' shape."""
    seen = []

    def share(x, t, teacher):
        seen.append(len(x))
        return _task_share(x, t, teacher, spec=LossSpec("lm+kd"), count=8 * 255)

    logits = torch.empty(8 * 255, 151936, device="meta", requires_grad=True)
    teacher = torch.empty(8 * 255, 151936, device="meta", dtype=torch.bfloat16)
    loss = piecewise(share, logits, torch.zeros(8 * 255, dtype=torch.long, device="meta"), teacher)
    loss.backward()
    assert seen == [441] * 4 + [276] and loss.shape == () and logits.grad.shape == logits.shape
