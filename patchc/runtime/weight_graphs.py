"""One rewritten graph per set of weights that dynamo passes to a graph.

With `inline_inbuilt_nn_modules` (the default since torch 2.5) a module's parameters are graph inputs and
dynamo does not guard on which module they come from: a graph that starts inside a submodule's forward
(after a graph break there) is reused for every sibling of the same class, each decoder layer passing its
own weights. The backend packs the weights of the call it compiled into the graph (trailing inputs and
constants sized for their tiles), so another layer's weights need a graph of their own. `PerWeights` checks,
on every call, that the weights passed are the ones packed (identity, a few microseconds), and otherwise
rewrites and compiles dynamo's graph again for the weights passed (their plan layers, or the plan read off
their own zeros), kept per set of weights while they live.

Example:
    >>> run = PerWeights(lambda inputs: compile_for(inputs), positions=[0, 3], first=(inputs, compiled))  # doctest: +SKIP
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
        self.build, self.positions = build, tuple(positions)
        self.entries: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], Callable[..., Any]]] = {}
        self.last = self._add(*first)

    def _weights(self, args: Sequence[Any]) -> list[Any]:
        return [args[i] for i in self.positions]

    def _add(self, args: Sequence[Any], compiled: Callable[..., Any]) -> tuple[list[Any], Callable[..., Any]]:
        for key in [k for k, (refs, _) in self.entries.items() if any(r() is None for r in refs)]:
            del self.entries[key]  # weights that are gone
        weights = self._weights(args)
        self.entries[tuple(map(id, weights))] = (tuple(weakref.ref(w) for w in weights), compiled)
        return [weakref.ref(w) for w in weights], compiled

    def __call__(self, *args: Any) -> Any:
        refs, compiled = self.last
        weights = self._weights(args)
        if all(map(operator.is_, (r() for r in refs), weights)):
            return compiled(*args)
        hit = self.entries.get(tuple(map(id, weights)))
        if hit is not None and all(map(operator.is_, (r() for r in hit[0]), weights)):
            self.last = list(hit[0]), hit[1]
        else:
            self.last = self._add(args, self.build(list(args)))
        return self.last[1](*args)


__all__ = ["PerWeights"]
