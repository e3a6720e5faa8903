"""Which planned layers the dynamo backend has served, for one plan, over all the graphs it compiled.

Dynamo only hands the backend the frames it compiles. A frame it runs eagerly (one skipped, one past the
recompile limit, code under `torch._dynamo.disable`) never reaches the backend, so its planned weights stay
dense without a warning. `unserved(plan)` answers the question a warning cannot: after the model has run
on the shapes it will serve, which planned layers did no graph serve, and why. Without a plan (a model
pruned by another tool, its plan inferred from the zeros in every graph) ask of the model instead:
`unserved(model)` lists its weight matrices with a 2:4 tile that no graph served. `patchc.compile` swaps
modules instead and has no such gap.

Example:
    >>> cm = torch.compile(model, backend="patch", options={"plan": plan})  # doctest: +SKIP
    >>> cm(ids)                                                               # doctest: +SKIP
    >>> patchc.runtime.unserved(plan)                                         # doctest: +SKIP
    {'model.layers.3.self_attn.q_proj.weight': 'in no graph the backend compiled (a frame dynamo ran eagerly?)'}
    >>> torch.compile(pruned, backend="patch")(ids); patchc.runtime.unserved(pruned)  # doctest: +SKIP
    {}
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

NOT_SEEN = "in no graph the backend compiled (a frame dynamo ran eagerly?)"
NOT_READ = "read by no matmul form the backend rewrites"
DEFAULT_TILE = (16, 16)  # the tile the backend infers a plan with when it is given none

# plan -> (layers some graph served, {layer: why some graph left it dense}, {layer: why it may have been})
_SEEN: WeakIdKeyDictionary = WeakIdKeyDictionary()
# weight Parameter -> [served by some graph, why some graph left it dense], for graphs without a plan
_WEIGHTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def record(plan: Any, served: Iterable[str], left: dict[str, str], maybe: dict[str, str] | None = None) -> None:
    """Note what one compiled graph did with `plan`'s layers: `left` were read and left dense; `maybe` may
    have been (a weight named like them whose values none of them holds: another weight, or a plan made from
    other values), which counts only while no graph serves them. A 3-D weight's name, bare or as
    "<weight>.*", stands for all its expert slices."""
    done, why, unsure = _SEEN.setdefault(plan, (set(), {}, {}))
    done.update(layer for name in served for layer in _expand(plan, name))
    for table, reasons in ((why, left), (unsure, maybe or {})):
        for name, reason in reasons.items():
            for layer in _expand(plan, name):
                table.setdefault(layer, reason)


def record_weights(taken: Iterable[torch.Tensor], served: Iterable[torch.Tensor],
                   left: Iterable[tuple[torch.Tensor, str]]) -> None:
    """Note what one graph compiled without a plan did with the weights it `taken`: `served` went to the
    patchc ops, `left` (with why) were inferred as planned and left dense."""
    for w in taken:
        _WEIGHTS.setdefault(w, [False, None])
    for w in served:  # setdefault: whatever the backend serves counts, `taken` or not
        _WEIGHTS.setdefault(w, [False, None])[0] = True
    for w, why in left:
        entry = _WEIGHTS.setdefault(w, [False, None])
        entry[1] = entry[1] or why


def unserved(plan: Any, tile: tuple[int, int] | int = DEFAULT_TILE) -> dict[str, str]:
    """{planned layer: why} for every layer of `plan` with a 2:4 tile that runs dense in some graph the patch
    backend compiled with it, or that no such graph has served yet; {} when every one is served everywhere.

    Given a model instead of a plan (compiled without one), the same for each of its weight matrices with a
    2:4 tile at `tile` (the backend's "tile" option) that the runtime serves: `TilePlan.from_linears`'s
    layers, an expert slice named "<3-D weight>.<expert>"."""
    if isinstance(plan, torch.nn.Module):
        return _unserved_weights(plan, tile)
    done, why, unsure = _SEEN.get(plan, (set(), {}, {}))
    planned = [name for name, layer in plan.layers.items() if layer.n_sparse]
    return {name: why.get(name) or unsure.get(name, NOT_SEEN) for name in planned if name in why or name not in done}


def _unserved_weights(model: torch.nn.Module, tile: tuple[int, int] | int) -> dict[str, str]:
    from patchc.ir.from_pruned import survey_linears

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the names are the model's
    where, slots, _ = survey_linears(model, tile)
    out = {}
    for name in slots:
        served, why = _WEIGHTS.get(model.get_parameter(where[name].param), (False, NOT_SEEN))
        if why is not None or not served:
            out[name] = why or NOT_READ
    return out


class _RecompileLimit(logging.Filter):
    """Passes dynamo's log record that it hit a recompile limit, and warns what that means for planned weights:
    dynamo runs the frame eagerly from then on, where no graph serves them (`unserved` cannot see it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
            args = record.args if isinstance(record.args, tuple) else ()
            where = f" for {args[2]}" if len(args) > 2 else ""
            warnings.warn(f"patch backend: dynamo hit torch._dynamo.config.{args[0] if args else 'recompile_limit'}"
                          f"{where} and runs that frame eagerly from now on: the weights it reads run as the model "
                          "holds them, unpacked, and dense where the plan came in the backend's options. Raise "
                          "the limit, or compile the plan-applied model", stacklevel=2)
        return True


_WATCH = _RecompileLimit()


def watch_recompile_limit() -> None:
    """Warn when dynamo hits its recompile limit (once the backend is in use; adding it again is a no-op)."""
    logging.getLogger("torch._dynamo.convert_frame").addFilter(_WATCH)


def _expand(plan: Any, name: str) -> list[str]:
    """A layer name, or every planned slice "<weight>.<e>" of a 3-D weight named bare or as "<weight>.*"."""
    name = name.removesuffix(".*")
    if name in plan.layers:
        return [name]
    stem = name + "."
    return [f for f in plan.layers if f.startswith(stem) and f[len(stem):].isdigit()]


__all__ = ["DEFAULT_TILE", "NOT_READ", "NOT_SEEN", "record", "record_weights", "unserved", "watch_recompile_limit"]
