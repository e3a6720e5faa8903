"""One rewritten graph per set of weights that dynamo passes to a graph.

With `inline_inbuilt_nn_modules` (the default since torch 2.5) a module's parameters are graph inputs and
dynamo does not guard on which module they come from: a graph that starts inside a submodule's forward
(after a graph break there) is reused for every sibling of the same class, each decoder layer passing its
own weights. The backend packs the weights of the call it compiled into the graph (trailing inputs and
constants sized for their tiles), so another layer's weights need a graph of their own. `PerWeights` checks,
on every call, that the weights passed are the ones packed, and otherwise rewrites and compiles dynamo's
graph again for the weights passed (their plan layers, or the plan read off their own zeros), kept per set
of weights while they live.

The check compares ids of the weights at `positions` (the backend passes the first packed weight of each
frame local the weights come from: a sibling passes all of its own). One weight adds ~2 us a call on a
2-core Xeon VM; all 224 of a 7B Llama's graph would add ~20 us. An entry is dropped as soon as one of its
weights is freed, so a live entry's ids are its own weights'.

Example:
    >>> run = PerWeights(compile_for, positions=[0, 3], first=(inputs, compiled))  # doctest: +SKIP
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Sequence


class PerWeights:
    """Calls the graph compiled for the weights at `positions` of the call's inputs; compiles one with
    `build(inputs)` for weights not seen before."""

    def __init__(self, build: Callable[[list[Any]], Callable[..., Any]], positions: Sequence[int],
                 first: tuple[Sequence[Any], Callable[..., Any]]) -> None:
        self.build = build
        pick = operator.itemgetter(*positions)
        self._pick = pick if len(positions) > 1 else lambda args: (pick(args),)
        # ids of the weights -> (weak refs whose callbacks drop the entry, compiled graph)
        self.entries: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], Callable[..., Any]]] = {}
        self.last_ids, self.last = self._add(first[0], first[1])

    def _add(self, args: Sequence[Any], compiled: Callable[..., Any]) -> tuple[tuple[int, ...], Callable[..., Any]]:
        weights = self._pick(args)
        ids = tuple(map(id, weights))
        this = weakref.ref(self)

        def drop(_: weakref.ref) -> None:  # a weight was freed: its id may be reused
            owner = this()
            if owner is not None:
                owner.entries.pop(ids, None)
                if owner.last_ids == ids:
                    owner.last_ids, owner.last = (), None  # and let its packed weights go

        self.entries[ids] = (tuple(weakref.ref(w, drop) for w in weights), compiled)
        return ids, compiled

    def __call__(self, *args: Any) -> Any:
        ids = tuple(map(id, self._pick(args)))
        if ids != self.last_ids:
            hit = self.entries.get(ids)
            self.last_ids, self.last = (ids, hit[1]) if hit is not None else self._add(args, self.build(list(args)))
        return self.last(*args)


__all__ = ["PerWeights"]
