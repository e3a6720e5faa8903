"""The CPU mask step in C (`patchc.masking.native`) against the torch ops of `patchc.masking.fused`: the
same draw (same Gumbel window), every variant and layout, tail shapes, bf16 weights, and its build cache."""

from __future__ import annotations

import copy

import pytest
import torch

from patchc.ir.patterns import PATTERNS
from patchc.masking import native
from patchc.masking.hybrid_mask import HybridMask

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler with OpenMP: the torch path runs instead")

# (shape, tile): 8 groups per vector, so rows of 6, 25 and 48 groups cover all-tail, blocks + tail, whole
# blocks; (20, 24) with (8, 16) tiles has a padded tile grid.
SHAPES = [((20, 24), (8, 16)), ((48, 100), (16, 20)), ((32, 192), (16, 16))]


def _mask(shape, tile, variant, hard, nm_param) -> HybridMask:
    m = HybridMask("w", shape, tile, variant=variant, index=2, seed=9, hard=hard, nm_param=nm_param)
    m.init_logits(0.7, torch.Generator().manual_seed(1))
    m.tau_tile, m.tau_nm, m.kappa_tile, m.kappa_nm = 0.7, 1.3, 2.0, 3.0
    return m


def _step(m: HybridMask, w: torch.Tensor, torch_path: bool, monkeypatch) -> tuple:
    with monkeypatch.context() as mp:
        if torch_path:
            mp.setattr(native, "supports", lambda *a: False)
        out = m(w)
        r = torch.linspace(-1, 1, out.numel()).view(out.shape)
        ((out.float() * r).sum() + 0.3 * m.last_sq_norm).backward()
    return out.detach(), m.last_sq_norm.detach(), [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("shape,tile", SHAPES)
@pytest.mark.parametrize("variant", ["joint", "nm", "tile"])
@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("nm_param", ["pattern", "weight"])
def test_native_equals_the_torch_ops_on_the_same_draw(shape, tile, variant, hard, nm_param, monkeypatch):
    m = _mask(shape, tile, variant, hard, nm_param)
    ref = copy.deepcopy(m)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    out, sq, grads = _step(m, w, False, monkeypatch)
    ref_out, ref_sq, ref_grads = _step(ref, w, True, monkeypatch)
    # fp32: a polynomial exp (~2 ulp) and another summation order; a wrong index or pattern is O(1)
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(sq, ref_sq, rtol=1e-5, atol=0)
    assert len(grads) == len(ref_grads) > 0
    for g, r in zip(grads, ref_grads):
        scale = float(r.abs().max())
        assert scale > 0
        torch.testing.assert_close(g, r, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("variant", ["joint", "tile"])
def test_native_bf16_weight_rounds_like_torch(variant, monkeypatch):
    m = _mask((32, 72), (16, 16), variant, False, "pattern")
    ref = copy.deepcopy(m)
    w = torch.randn(32, 72, generator=torch.Generator().manual_seed(4)).bfloat16()
    out, sq, grads = _step(m, w, False, monkeypatch)
    ref_out, ref_sq, ref_grads = _step(ref, w, True, monkeypatch)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=8e-3, atol=1e-6)  # 1 bf16 ulp where M differs by ~1 fp32 ulp
    assert float((out != ref_out).float().mean()) < 0.01
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=2e-5 * float(r.abs().max()))


def test_native_hard_draw_is_a_valid_hybrid_mask():
    m = _mask((48, 100), (16, 20), "joint", True, "pattern")
    ones = torch.ones(48, 100)
    mask = m(ones).detach()
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    tiles = mask.view(3, 16, 5, 20).sum((1, 3))
    dense = tiles == 16 * 20
    assert bool(((tiles == 16 * 10) | dense).all())  # every tile dense or exactly half kept
    groups = mask.view(3, 16, 5, 5, 4).permute(0, 2, 1, 3, 4)[~dense].reshape(-1, 4)
    assert bool((groups.sum(-1) == 2).all())
    codes = (groups.long() * torch.tensor([1, 2, 4, 8])).sum(-1)
    assert set(codes.tolist()) <= set((PATTERNS.long() * torch.tensor([1, 2, 4, 8])).sum(-1).tolist())


def test_native_library_is_built_once_and_reused(tmp_path, monkeypatch):
    src = tmp_path / "tiny.c"
    src.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(native, "SOURCE", src)
    monkeypatch.setenv("PATCHC_CACHE_DIR", str(tmp_path / "cache"))
    cc = native._compiler()
    first = native._build(cc)
    stamp = first.stat().st_mtime_ns
    assert native._build(cc) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp file left behind
    src.write_text("int answer(void) { return 43; }\n")
    assert native._build(cc) != first  # a new source gets its own library
    src.write_text("int answer(void) { return }\n")
    with pytest.raises(OSError, match="could not build tiny.c"):
        native._build(cc)
    assert len(list(first.parent.iterdir())) == 2  # the failed build left nothing


@pytest.mark.parametrize("torch_path", [False, True])
def test_recompute_gives_the_same_gradients_and_saves_no_masked_weight(torch_path, monkeypatch):
    import contextlib

    from patchc.masking import recompute

    if torch_path:
        monkeypatch.setattr(native, "supports", lambda *a: False)
    m = _mask((48, 100), (16, 20), "joint", False, "pattern")
    ref = copy.deepcopy(m)
    w = torch.randn(48, 100, generator=torch.Generator().manual_seed(5))
    x = torch.randn(7, 100, generator=torch.Generator().manual_seed(6), requires_grad=True)  # dX needs W * M
    kept: list = []
    pack = recompute._pack
    monkeypatch.setattr(recompute, "_pack", lambda t: kept.append(pack(t)) or kept[-1])

    def run(mask, ctx):
        with ctx:
            y = torch.nn.functional.linear(x, mask(w))  # mm saves W * M, transposed, for dX
            (y.square().sum() + 0.3 * mask.last_sq_norm).backward()
        return [p.grad.clone() for p in mask.parameters()]

    grads = run(ref, contextlib.nullcontext())
    got = run(m, recompute.recompute_masked_weights())
    recipes = [k for k in kept if isinstance(k, recompute._Recipe)]
    assert len(recipes) == 1 and tuple(recipes[0].size) == (100, 48)
    assert not any(isinstance(k, torch.Tensor) and k.numel() == 4800 and k.data_ptr() != w.data_ptr() for k in kept)
    for g, r in zip(got, grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)  # the redraw is bit-identical

    with recompute.recompute_masked_weights():  # logits stepped between forward and backward: refused by name
        y = torch.nn.functional.linear(x, m(w)).sum()
        with torch.no_grad():
            m.nm_logits.add_(1.0)
        with pytest.raises(RuntimeError, match="w: its 2:4 logits changed"):
            y.backward()
