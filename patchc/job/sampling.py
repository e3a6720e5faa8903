"""Nucleus (top-p) sampling of a batch of next-token logits: how the dense model writes its own training text.

A row keeps its most likely tokens while the mass of the tokens before each is below top_p, and draws one of
them in proportion to its probability. Vocabularies of up to `NUCLEUS_FIRST` tokens (stories260K's 512) are
drawn by `torch.multinomial` on the CPU, as they always were. A larger one is drawn on the logits' device by
inverse CDF, one uniform per row from the seeded CPU generator:

1. `top_nucleus`: rows whose nucleus lies in their top `NUCLEUS_FIRST` tokens (a peaked row) draw there;
2. `draw_binned`: the others (a flat row holds most of the vocabulary: any row of a random-init model) bin
   the vocabulary by probability, find the bin where the nucleus ends and the bin the draw lands in, and
   sort only those two bins' tokens. Every step reads the row a fixed number of times; a whole sort of 64
   rows of 152K tokens took 0.9 s on 2 cores, and most of a tiny random model's `patchc prune`.

Both draw from the nucleus in order of probability, most likely first, so they give the token a whole sort
would (float rounding at an edge and the order of tied tokens apart). A binned row takes its tied tokens in
token order, so it draws the same token in any batch, and a CPU draws its rows a few at a time
(`patchc.utils.chunks.rows_at_once`).

Example:
    >>> sample_next(torch.randn(64, 50257), temperature=1.2, top_p=0.95, gen=torch.Generator().manual_seed(0))
    tensor([[...]])  # (64, 1) token ids on the CPU
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from patchc.utils.chunks import rows_at_once

# Tokens looked at first for the nucleus: the top 1,024 of 152K cost ~25 ms for 64 rows on 2 cores, binning
# the rows 80-100 ms
NUCLEUS_FIRST = 1024
# A non-negative float32's high 16 bits (its exponent and 7 mantissa bits) order it as the float does: they
# bin probabilities 128 to an octave. Bins start at 2**-OCTAVES and end at 1.0 in bin TOP_BIN; bin 0 holds
# every smaller probability (together under 7e-5 even at 262K tokens: a nucleus below top_p 0.9999 ends above
# it), one column past TOP_BIN the 0 mass above 1.0.
OCTAVES = 32
_ONE_HIGH, _LOW_HIGH = 0x3F80, 0x3F80 - 128 * OCTAVES
TOP_BIN = _ONE_HIGH - _LOW_HIGH
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """(B, V) finite logits (any device) -> (B, 1) token ids on the CPU, sampled at `temperature` from the
    smallest set of tokens whose probability reaches `top_p` (nucleus sampling), with `gen` (a CPU generator).

    Past `NUCLEUS_FIRST` tokens the draw runs on the logits' device: `torch.multinomial` draws an exponential
    for every token of every row, and a GPU's logits would cross to the CPU every step (39 MB for 64 rows of
    152K tokens).
    """
    if logits.shape[-1] <= NUCLEUS_FIRST:
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        return torch.multinomial(nucleus(probs, top_p) if top_p < 1.0 else probs, 1, generator=gen)
    # one uniform per row, whichever way the row is drawn: the text depends on the seed, not on the split
    u = torch.rand(logits.shape[0], 1, generator=gen, dtype=torch.float64).to(logits.device)
    # on a CPU a few rows at a time (64 rows of 152K tokens: 205-220 ms at once, 81-97 ms 6 at a time)
    n = rows_at_once(logits)
    return torch.cat([draw(logits[i:i + n], u[i:i + n], temperature, top_p) for i in range(0, len(u), n)]).cpu()


def draw(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(B, 1) token ids on the logits' device, one per row of (B, V) logits, by inverse CDF at `u` (B, 1)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return pick(probs, u)
    rows, kept, tokens = top_nucleus(probs, top_p)
    ids = torch.empty(probs.shape[0], 1, dtype=torch.long, device=probs.device)
    if len(rows):
        ids[rows] = tokens.gather(-1, pick(kept, u[rows]))
    rest = others(rows, probs.shape[0])
    if len(rest) == len(ids):  # no copy of a batch of flat rows
        return draw_binned(probs, u, top_p)
    if len(rest):
        ids[rest] = draw_binned(probs[rest], u[rest], top_p)
    return ids


def pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, 1) indices drawn from each row of (B, V) non-negative `weights` (not normalised) by inverse CDF at
    `u` (B, 1) uniforms in [0, 1): the first index whose cumulative weight exceeds u * the row's total, so a
    zero weight is never drawn."""
    cum = weights.double().cumsum(-1)
    ids = torch.searchsorted(cum, u * cum[:, -1:], right=True)
    # u * total can round up to the total itself: that row takes its most likely token
    return torch.where(ids < weights.shape[-1], ids, weights.argmax(-1, keepdim=True))


def top_nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows (R,), kept (R, W), their token ids (R, W)): the rows of (B, V) probabilities whose nucleus lies in
    their top `NUCLEUS_FIRST` tokens, and their nucleus, most likely first, 0 past it; W is the longest. Exact:
    the mass before every later token is at least the top's. A row whose most likely token times
    `NUCLEUS_FIRST` falls short of top_p cannot fit (a flat row): its top-k is skipped (~10 ms of 64 rows of 50K).

    The cumulative mass is summed in fp32, as it always was (a vocabulary this short is wholly inside, and
    stories260K's text must not change); a top-k even of a whole short vocabulary, since a sort could order
    tied tokens otherwise and change which of them a nucleus keeps.
    """
    width = min(NUCLEUS_FIRST, probs.shape[-1])
    rows = (probs.amax(-1) * width >= top_p).nonzero().flatten()
    part = probs if len(rows) == probs.shape[0] else probs[rows]
    top, order = part.topk(width, dim=-1)
    mass = top.cumsum(-1)
    fits = (mass[:, -1] >= top_p).nonzero().flatten()
    kept = top[fits].masked_fill((mass - top)[fits] >= top_p, 0.0)
    width = int((kept > 0).sum(-1).max()) if len(fits) else 1  # the kept tokens lead each row
    return rows[fits], kept[:, :width], order[fits][:, :width]


def others(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The indices in range(n) that are not in `rows`."""
    rest = torch.ones(n, dtype=torch.bool, device=rows.device)
    rest[rows] = False
    return rest.nonzero().flatten()


def draw_binned(probs: torch.Tensor, u: torch.Tensor, top_p: float) -> torch.Tensor:
    """(B, 1) token ids drawn from each row's nucleus of (B, V) probabilities by inverse CDF at `u`, most
    likely token first, without sorting the row: the draw's target mass picks the bin it falls in, and only
    that bin is sorted."""
    hist = Histogram.of(probs)
    cut, kept, kept_ids = binned_cut(probs, hist, top_p)
    above = hist.through.gather(1, cut + 1)
    target = u * (above + kept.sum(-1, keepdim=True))
    # the bin the target falls in: the last one whose mass at or above it exceeds the target
    land = torch.where(target < above, (hist.through > target).sum(-1, keepdim=True) - 1, cut)
    vals, ids = hist.tokens(probs, land)
    width = max(vals.shape[1], kept.shape[1])
    at_cut = land == cut  # those rows draw from the cut bin's kept tokens
    vals = torch.where(at_cut, pad(kept, width), pad(vals, width))
    ids = torch.where(at_cut, pad(kept_ids, width), pad(ids, width))
    at = torch.searchsorted(vals.cumsum(-1), target - hist.through.gather(1, land + 1), right=True)
    # rounding can put the target at the bin's total: its least likely token (never a zero weight)
    return ids.gather(1, torch.minimum(at, (vals > 0).sum(-1, keepdim=True) - 1))


class Histogram(NamedTuple):
    """(B, V) probabilities binned by their high 16 bits: bins (B, V) int64; through (B, TOP_BIN + 2): the
    fp64 mass at or above each bin (exact sums: a whole sort's nucleus, to rounding); counts (B, TOP_BIN + 2)
    tokens per bin (fp32, exact below 2**24)."""

    bins: torch.Tensor
    through: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, probs: torch.Tensor) -> Histogram:
        high = probs.view(torch.int16)[..., _HIGH_HALF::2]
        bins = torch.sub(high.clamp(min=_LOW_HIGH), _LOW_HIGH, out=torch.empty_like(probs, dtype=torch.long))
        shape = (probs.shape[0], TOP_BIN + 2)
        mass = torch.zeros(shape, dtype=torch.float64, device=probs.device).scatter_add_(1, bins, probs.double())
        ones = torch.ones(1, device=probs.device).expand_as(probs)
        counts = torch.zeros(shape, device=probs.device).scatter_add_(1, bins, ones)
        return cls(bins, mass.flip(-1).cumsum(-1).flip(-1), counts)

    def tokens(self, probs: torch.Tensor, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of bin `which` (B, 1) of each row, most likely first, ties by token id: (probabilities as
        fp64 (B, n), 0 past the row's last, ids (B, n)); n is the fullest row's count."""
        n = max(int(self.counts.gather(1, which).max()), 1)
        vals, ids = torch.where(self.bins == which, probs, -1.0).topk(n, dim=-1)
        # tied probabilities in token order: topk's order of ties depends on n, the fullest row's count, so a
        # row would draw another of its tied tokens in another batch
        ids, by_id = ids.sort(dim=-1)
        vals, order = vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        return vals.double().clamp_(min=0.0), ids.gather(1, order)


def binned_cut(probs: torch.Tensor, hist: Histogram, top_p: float) -> tuple[torch.Tensor, ...]:
    """Where each row's nucleus of (B, V) probabilities ends: (cut (B, 1): the bin it ends in, kept (B, n):
    the cut bin's tokens it keeps, fp64, most likely first and 0 past them, their ids (B, n)). Every bin above
    the cut is kept whole, every bin below dropped."""
    # the highest bin whose mass at or above it reaches top_p (bin 0 when rounding leaves the row short of it)
    cut = ((hist.through >= top_p).sum(-1, keepdim=True) - 1).clamp_(min=0)
    vals, ids = hist.tokens(probs, cut)
    kept = torch.where(hist.through.gather(1, cut + 1) + vals.cumsum(-1) - vals < top_p, vals, 0.0)
    return cut, kept, ids


def pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """(B, n) -> (B, width) with zeros on the right."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(B, V) probabilities with every token outside the top-p nucleus set to 0 (the rest unnormalised)."""
    rows, kept, tokens = top_nucleus(probs, top_p)
    out = torch.zeros_like(probs)
    out[rows] = probs.new_zeros((len(rows), probs.shape[-1])).scatter_(-1, tokens, kept)
    rest = others(rows, probs.shape[0])
    if len(rest):
        part = probs[rest]
        hist = Histogram.of(part)
        cut, kept, ids = binned_cut(part, hist, top_p)
        # a short row's padding points at tokens outside the cut bin: adding its 0 leaves them as they are
        out[rest] = torch.where(hist.bins > cut, part, 0.0).scatter_add_(-1, ids, kept.to(probs.dtype))
    return out


__all__ = ["NUCLEUS_FIRST", "sample_next", "pick", "top_nucleus", "draw_binned", "Histogram", "binned_cut", "nucleus"]
