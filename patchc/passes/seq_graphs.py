"""Models whose sequence length torch.export cannot keep symbolic: one graph per length, one set of masks.

Chunked linear-attention and state-space layers loop in Python over the sequence's chunks, so an
export fixes its length; `patchc.models.hf_export.export_causal_lm` then returns a
`patchc.models.per_length.PerLengthExport`: the export at one length and a way to export another
(batch stays dynamic). `patchc.transform` builds the program on the first graph; `SeqGraphs`
exports each further length on first use and splices in the program's own frozen parameters and mask
modules, so every graph reads the same weights and trains the same logits. A job uses few lengths
(its training blocks, its evaluation windows), each exported once.

Example:
    >>> pe = export_causal_lm(qwen35)               # a PerLengthExport
    >>> prog = patchc.transform(pe, PatchConfig(tile=(16, 16)))
    >>> prog(ids_of_length_128)                     # exports length 128 once, then reuses it
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import fx, nn

from patchc.config import PatchConfig
from patchc.models.per_length import PerLengthExport
from patchc.passes.find_linears import LinearSite, find_linear_sites
from patchc.passes.insert_masks import InsertMasks, InsertObservers, RemoveObservers

log = logging.getLogger(__name__)


def sequence_length(args: tuple, kwargs: Mapping) -> int:
    """The length T of a call's (B, T) token ids: the first positional tensor, else `input_ids`."""
    ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        raise ValueError("this program has one graph per sequence length and needs (B, T) token ids as its first "
                         f"argument or input_ids=; got {type(ids).__name__}")
    return int(ids.shape[1])


class SeqGraphs:
    """The program's graphs by sequence length; a missing length is exported, masked and kept.

    Example:
        >>> gm, sites = graphs.graph(128)
    """

    def __init__(self, source: PerLengthExport, gm: fx.GraphModule, sites: list[LinearSite],
                 masks: Mapping[str, nn.Module], cfg: PatchConfig) -> None:
        self.source, self.cfg, self.masks = source, cfg, dict(masks)
        self.graphs: dict[int, tuple[fx.GraphModule, list[LinearSite]]] = {source.length: (gm, sites)}
        self.observer: Callable[[str, torch.Tensor], None] | None = None
        self.fixed: str | None = None  # why no other length may be built (`fix_length`)

    def graph(self, length: int) -> tuple[fx.GraphModule, list[LinearSite]]:
        if length not in self.graphs:
            if self.fixed is not None:
                raise ValueError(f"this program runs at sequence length {self.source.length} only, got {length}: "
                                 f"{self.fixed}")
            self.graphs[length] = self._build(length)
        return self.graphs[length]

    def fix_length(self, why: str) -> None:
        """Build no graph for another length from now on (a rewrite moved the weights out of the first graph,
        where a new one would find them); `why` ends the error a call at another length raises."""
        if len(self.graphs) > 1:
            raise ValueError(f"this program already has graphs for sequence lengths {sorted(self.graphs)}: "
                             f"{why}, before running it at any other length")
        self.fixed = why

    def _build(self, length: int) -> tuple[fx.GraphModule, list[LinearSite]]:
        log.info("patchc: exporting the model again for sequence length %d (it exports one graph per length: %s)",
                 length, self.source.reason)
        gm = self.source.export(length).module()
        first, first_sites = self.graphs[self.source.length]
        share_parameters(gm, first)
        sites, _ = find_linear_sites(gm, self.cfg)
        fqns, expected = {s.fqn for s in sites}, {s.fqn for s in first_sites}
        if fqns != expected:
            missing, extra = sorted(expected - fqns), sorted(fqns - expected)
            raise RuntimeError(f"patchc: the graph exported for sequence length {length} masks other weights than the "
                               f"length-{self.source.length} graph (missing {missing[:3]}, new {extra[:3]}); "
                               "train at one sequence length")
        InsertMasks(sites, self.masks)(gm)
        if self.observer is not None:
            InsertObservers(sites, self.observer)(gm)
        return gm, sites

    def observe(self, callback: Callable[[str, torch.Tensor], None] | None) -> None:
        """Route every masked matmul's input to `callback` in each graph, now and in graphs built later
        (None removes the observers)."""
        self.observer = callback
        for gm, sites in self.graphs.values():
            if callback is None:
                RemoveObservers()(gm)
            else:
                InsertObservers(sites, callback)(gm)

    def apply(self, fn: Callable, recurse: bool = True) -> None:
        """`nn.Module._apply` on the graphs built after the first (the program applies it to the first,
        whose parameters they share)."""
        for length, (gm, _) in self.graphs.items():
            if length != self.source.length:
                gm._apply(fn, recurse)


def share_parameters(gm: fx.GraphModule, source: fx.GraphModule) -> None:
    """Point `gm`'s parameters at `source`'s Parameter objects of the same name (frozen, one copy), and
    move its buffers to their device."""
    params = dict(source.named_parameters(remove_duplicate=False))
    device = next(iter(params.values())).device if params else None
    for name, param in list(gm.named_parameters(remove_duplicate=False)):
        owner_name, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        shared = params.get(name)
        if shared is None or shared.shape != param.shape:
            shared = nn.Parameter(param.detach(), requires_grad=False)
        owner._parameters[leaf] = shared
    if device is not None:
        gm.to(device)


__all__ = ["SeqGraphs", "sequence_length", "share_parameters"]
