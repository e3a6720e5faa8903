"""Nucleus sampling of next-token logits (`patchc.job.sampling`): the nucleus and the draw against a whole sort."""

from __future__ import annotations

import pytest
import torch

import patchc.job.sampling as sampling
import patchc.utils.chunks as chunks
from patchc.job.sampling import Histogram, draw_binned, nucleus, pick, sample_next, top_nucleus


def whole_sort(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: each row sorted whole, its nucleus summed in fp64 -> (kept (B, V) most likely first, 0
    past the nucleus, as fp64; token ids (B, V))."""
    top, order = probs.sort(dim=-1, descending=True)
    top = top.double()
    return top.masked_fill(top.cumsum(-1) - top >= top_p, 0.0), order


def sorted_draw(probs: torch.Tensor, u: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference draw: inverse CDF at `u` over the whole-sorted nucleus (where u * total rounds up to the
    total, its least likely token)."""
    kept, order = whole_sort(probs, top_p)
    cum = kept.cumsum(-1)
    at = torch.searchsorted(cum, u * cum[:, -1:], right=True)
    return order.gather(1, torch.minimum(at, (kept > 0).sum(-1, keepdim=True) - 1))


def rows(std: list[float], vocab: int, seed: int = 0) -> torch.Tensor:
    """Gaussian logits, one row per standard deviation: 0.01 clusters a row's tokens in a few bins (with many
    ties), 1 is flat (a random-initialised model), 4 and up peaked."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(std), vocab, generator=gen) * torch.tensor(std)[:, None]


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits.expand(2000, 4), 1.0, 0.75, gen)]).flatten()
    assert set(draws.tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.75; 0.15 and 0.05 never drawn
    assert abs((draws == 0).float().mean().item() - 0.5 / 0.8) < 0.04
    assert set(sample_next(logits.expand(50, 4), 1.0, 1e-6, gen).flatten().tolist()) == {0}


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_the_nucleus_equals_a_whole_sorts(monkeypatch, top_p):
    """Rows peaked enough have their nucleus in the top 8 (the first look, shrunk from 1,024), flatter ones
    are binned; either way the nucleus is a whole sort's, value for value."""
    monkeypatch.setattr(sampling, "NUCLEUS_FIRST", 8)
    probs = torch.softmax(rows(torch.linspace(0.1, 8, 12).tolist(), 101), -1)
    kept, order = whole_sort(probs, top_p)
    assert torch.equal(nucleus(probs, top_p), torch.zeros_like(probs).scatter_(-1, order, kept.float()))
    first = top_nucleus(probs, top_p)[0]
    assert 0 < len(first) and (top_p < 0.5 or len(first) < 12)  # both ways ran


def test_a_large_vocabularys_flat_rows_have_a_whole_sorts_nucleus():
    """At a real vocabulary (50,257 tokens, the first look at 1,024): flat rows hold thousands of tokens in
    their nucleus, up to 40K, and the binned cut keeps exactly a whole sort's."""
    probs = torch.softmax(rows([1.0, 1.0, 2.0, 3.0], 50257) / 1.2, -1)
    kept, order = whole_sort(probs, 0.95)
    got = nucleus(probs, 0.95)
    assert len(top_nucleus(probs, 0.95)[0]) == 0 and (got > 0).sum(-1).min() > 5000
    assert torch.equal(got, torch.zeros_like(probs).scatter_(-1, order, kept.float()))


@pytest.mark.parametrize("std", [1.0, 3.0, 0.01])
def test_the_binned_draw_is_a_whole_sorts_inverse_cdf(std):
    """`draw_binned` lands on the token a whole sort's inverse CDF gives at the same uniform (one of equal
    probability where tokens tie: clustered rows have many), at both ends of [0, 1) and between: in the bin
    where the nucleus ends and in the bins above it."""
    probs = torch.softmax(rows([std] * 6, 3000, seed=int(std * 10)), -1)
    u = torch.cat([torch.tensor([0.0, 1 - 2**-53]), torch.rand(254, generator=torch.Generator().manual_seed(1),
                                                              dtype=torch.float64)])
    for top_p in (0.5, 0.95):
        got = torch.cat([draw_binned(probs, u[i:i + 1].expand(6, 1).clone(), top_p) for i in range(len(u))], 1)
        want = torch.cat([sorted_draw(probs, u[i:i + 1].expand(6, 1).clone(), top_p) for i in range(len(u))], 1)
        assert torch.equal(probs.gather(1, got), probs.gather(1, want))
        if std == 1.0:  # no ties to choose between: the very same tokens
            assert torch.equal(got, want)
        assert torch.equal(got[:, 0], probs.argmax(-1))  # u = 0: the most likely token


def test_the_histogram_orders_its_bins_as_the_probabilities():
    probs = torch.softmax(rows([0.01, 1.0, 8.0], 5000), -1)
    hist = Histogram.of(probs)
    order = probs.argsort(-1, descending=True)
    bins = hist.bins.gather(1, order)
    assert (bins[:, :-1] >= bins[:, 1:]).all()  # a less likely token never sits in a higher bin
    assert (bins <= sampling.TOP_BIN).all() and torch.equal(hist.counts.sum(-1), torch.full((3,), 5000.0))
    torch.testing.assert_close(hist.through[:, 0], torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-6)
    assert (hist.through[:, -1] == 0).all() and (hist.through[:, :-1] >= hist.through[:, 1:]).all()
    # a bin is 1/128 of an octave [2**e, 2**(e+1)): its tokens lie within a factor 1 + 1/128 of each other;
    # bin 0 holds every probability below 2**-32 (and up to its first 1/128 octave)
    assert ((hist.bins == 0) == (probs < 2.0**-sampling.OCTAVES * (1 + 1 / 128))).all() and (hist.bins == 0).any()
    for row in range(3):
        for b in set(hist.bins[row].tolist()) - {0}:
            inside = probs[row][hist.bins[row] == b]
            assert inside.max() < inside.min() * (1 + 1 / 128)


def test_tokens_of_probability_zero_are_never_drawn():
    """Logits far below the rest underflow to probability 0 (bin 0): even a nucleus of every other token
    never keeps or draws them."""
    logits = torch.cat([torch.randn(4, 1500, generator=torch.Generator().manual_seed(0)),
                        torch.full((4, 600), -1e4)], 1)
    probs = torch.softmax(logits, -1)
    assert (probs[:, 1500:] == 0).all()
    assert (nucleus(probs, 1 - 1e-12)[:, 1500:] == 0).all()
    draws = sample_next(logits.repeat(250, 1), 1.0, 1 - 1e-12, torch.Generator().manual_seed(0))
    assert draws.max() < 1500


@pytest.mark.parametrize("top_p", [0.6, 0.95, 1.0])
def test_a_large_vocabulary_draws_from_its_nucleus_in_proportion(monkeypatch, top_p):
    """Past `NUCLEUS_FIRST` tokens the draw is an inverse CDF over the nucleus: every drawn token lies in it,
    each as often as its share of the nucleus's mass (rows that fit the top tokens and rows binned)."""
    monkeypatch.setattr(sampling, "NUCLEUS_FIRST", 8)  # a 40-token vocabulary takes the large path
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(40, generator=gen) * 5  # its nucleus lies in the top 8 for top_p < 1
    flat = torch.randn(40, generator=gen) * 0.3  # its nucleus does not
    n, batch = 20000, 2000  # batches of a few thousand rows: a histogram takes 49 KB a row
    logits = torch.cat([peaked.expand(batch, 40), flat.expand(batch, 40)])
    draws = torch.cat([sample_next(logits, 1.0, top_p, gen) for _ in range(n // batch)])
    assert draws.shape == (2 * n, 1) and draws.dtype == torch.long
    draws = draws.view(n // batch, 2, batch).transpose(0, 1).reshape(2 * n, 1)  # the peaked rows', the flat ones'
    if top_p < 1:  # both ways run: the peaked rows fit the top 8 tokens, the flat ones are binned
        assert top_nucleus(torch.softmax(logits, -1), top_p)[0].tolist() == list(range(batch))
    for row, got in ((peaked, draws[:n]), (flat, draws[n:])):
        want = nucleus(torch.softmax(row, -1)[None], top_p)[0]
        want = want / want.sum()
        counts = torch.bincount(got.flatten(), minlength=40).double() / n
        assert set(got.flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
        assert (counts - want).abs().max() < 4 * (want * (1 - want) / n).sqrt().max() + 1e-9
    for some in (logits[:50], logits[-50:], logits[batch - 25:batch + 25]):  # seeded; flat rows alone; mixed
        again = sample_next(some, 1.0, top_p, torch.Generator().manual_seed(7))
        assert torch.equal(again, sample_next(some, 1.0, top_p, torch.Generator().manual_seed(7)))


@pytest.mark.parametrize("top_p", [0.95, 1.0])
def test_a_cpu_draws_a_few_rows_at_a_time_as_it_would_all_at_once(monkeypatch, top_p):
    """On a CPU the rows are drawn a few at a time (`rows_at_once`): the same tokens as all together, for runs
    of rows that all fit the first look, all binned, and mixed; a GPU draws them all at once."""
    logits = rows([8.0] * 3 + [1.0] * 3 + [8.0, 1.0, 8.0, 1.0], 2048)
    if top_p < 1:  # the runs of three: peaked, flat, mixed
        assert top_nucleus(torch.softmax(logits / 1.2, -1), top_p)[0].tolist() == [0, 1, 2, 6, 8]
    whole = sample_next(logits, 1.2, top_p, torch.Generator().manual_seed(5))
    monkeypatch.setattr(chunks, "CPU_ROW_ELEMENTS", 3 * 2048 + 5)
    assert chunks.rows_at_once(logits) == 3 and chunks.rows_at_once(logits.to("meta")) == 10
    assert torch.equal(sample_next(logits, 1.2, top_p, torch.Generator().manual_seed(5)), whole)


def test_a_row_draws_the_same_token_in_any_batch():
    """A binned row's draw depends on its logits and its uniform alone: tied probabilities are taken in token
    order, where topk's order of ties depended on the batch's fullest bin. Clustered rows are full of ties."""
    probs = torch.softmax(rows([0.01] * 12 + [1.0] * 4, 50257), -1)
    u = torch.rand(16, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    whole = draw_binned(probs, u, 0.95)
    assert torch.equal(torch.cat([draw_binned(probs[i:i + 1], u[i:i + 1], 0.95) for i in range(16)]), whole)
    assert torch.equal(torch.cat([draw_binned(probs[i:i + 5], u[i:i + 5], 0.95) for i in range(0, 16, 5)]), whole)
    vals, ids = Histogram.of(probs).tokens(probs, torch.full((16, 1), int(Histogram.of(probs[:1]).bins[0, 0])))
    tied = (vals[:, 1:] == vals[:, :-1]) & (vals[:, 1:] > 0)
    assert tied.any() and bool((ids[:, 1:] > ids[:, :-1])[tied].all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_large_vocabulary_samples_on_the_gpu_as_on_the_cpu():
    """The nucleus draw runs on the logits' device with the CPU generator's uniforms: the same tokens from CUDA
    logits as from the same logits on the CPU, for peaked rows (the first look) and flat ones (binned), float
    rounding at a nucleus or CDF edge apart."""
    logits = torch.cat([rows([4.0] * 256, 32000), rows([1.0] * 256, 32000, seed=1)])
    cpu = sample_next(logits, 1.2, 0.95, torch.Generator().manual_seed(3))
    cuda = sample_next(logits.cuda(), 1.2, 0.95, torch.Generator().manual_seed(3))
    assert cuda.device.type == "cpu" and cuda.shape == cpu.shape == (512, 1)
    assert (cpu[:256] == cuda[:256]).float().mean() >= 0.99 and (cpu[256:] == cuda[256:]).float().mean() >= 0.99


def test_pick_never_draws_a_zero_weight():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0], [1.0, 0.0, 1.0, 0.0, 0.0]])
    edges = torch.tensor([0.0, 2 / 3 - 1e-12, 2 / 3, 1 - 2**-53], dtype=torch.float64)
    for u in edges:
        ids = pick(weights, u.expand(3, 1)).flatten()
        assert all(weights[i, j] > 0 for i, j in enumerate(ids.tolist()))
    assert pick(weights, torch.zeros(3, 1, dtype=torch.float64)).flatten().tolist() == [1, 4, 0]
    assert pick(weights, torch.full((3, 1), 0.9, dtype=torch.float64)).flatten().tolist() == [3, 4, 2]
    assert pick(weights[:0], torch.zeros(0, 1, dtype=torch.float64)).shape == (0, 1)
