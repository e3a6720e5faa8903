"""torch.export of Hugging Face models for patchc: causal LMs (dynamic batch and sequence, else one graph
per length) and `EncoderWrapper`s; a model torch.export cannot trace gets a one-line error naming the layer.

Example:
    >>> from patchc.models.hf import load_hf_causal
    >>> model, _ = load_hf_causal("path/to/model")
    >>> ep = export_causal_lm(model)                        # dynamic (batch, seq), use_cache=False
    >>> ep.module()(ids, use_cache=False).logits
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patchc.models.dims import dynamic_dim
from patchc.models.hf import HFLoadError, _first_line, _transformers, max_positions, transformers_major
from patchc.models.outputs import device_of
from patchc.models.per_length import PerLengthExport
from patchc.models.traceable import traceable_layers

log = logging.getLogger(__name__)

# Export example sizes: small, and > 1 so export does not specialise a dimension to 1.
_EXAMPLE_BATCH, _EXAMPLE_SEQ = 2, 16
_MAX_BATCH = 1 << 16
# Layers that loop in Python over ceil(T / chunk) sequence chunks, so an export fixes T: exported per
# length at once rather than after a failed dynamic export (which costs as long as an export). Others
# that fail dynamically fall back the same way.
_CHUNKED_MIXERS = ("GatedDeltaNet", "Mamba2Mixer", "FalconH1Mixer", "BambaMixer", "MambaLayer", "xLSTMBackend")


def export_causal_lm(model: nn.Module, batch: int = _EXAMPLE_BATCH, seq: int = _EXAMPLE_SEQ,
                     fixed_len: int | None = None) -> torch.export.ExportedProgram | PerLengthExport:
    """torch.export an HF causal LM with dynamic batch and sequence, ``kwargs={"use_cache": False}``.

    The exported module must then be called as ``m(ids, use_cache=False)`` (the kwarg is part of its
    signature); `patchc.models.bundle.ModelBundle.logits` does that. A model whose sequence length
    cannot be symbolic (chunked linear attention or state-space layers loop over the chunks in
    Python: Qwen3.5, Qwen3-Next, Mamba-2 hybrids) is exported at length `fixed_len` (default `seq`; pass
    the length it will train at, so no graph is built for the example alone) with a dynamic batch and
    returned as a `PerLengthExport`, which `patchc.transform` turns into one graph per length.

    Example:
        >>> ep = export_causal_lm(model)
        >>> ep.module()(torch.zeros(3, 5, dtype=torch.long), use_cache=False).logits.shape
    """
    limit = max_positions(model.config)
    seq, fixed_len = min(seq, limit), min(fixed_len or seq, limit)
    device = device_of(model)
    batch_dim = {0: dynamic_dim(_MAX_BATCH)}

    def example(length: int) -> torch.Tensor:
        return torch.zeros(batch, length, dtype=torch.long, device=device)

    def at_length(length: int) -> torch.export.ExportedProgram:
        return _export_ids(model, example(length), batch_dim)

    chunked = next((type(m).__name__ for m in model.modules() if type(m).__name__.endswith(_CHUNKED_MIXERS)), None)
    if chunked is not None:
        reason = f"{chunked} loops over sequence chunks"
        try:
            first = at_length(fixed_len)
        except Exception as error:  # noqa: BLE001 - named in one line where it can be
            explain_export_failure(model, error)
            raise
    else:
        try:
            ep = _export_ids(model, example(seq), {**batch_dim, 1: dynamic_dim(limit)})
        except Exception as dynamic_error:  # noqa: BLE001 - any failure: try the fixed-length export below
            reason = f"{type(dynamic_error).__name__}: {_first_line(dynamic_error)}"[:200]
            try:
                first = at_length(fixed_len)
            except Exception:  # noqa: BLE001 - the fixed length fails too: the dynamic export's error is the one to show
                explain_export_failure(model, dynamic_error)
                raise dynamic_error from None
        else:
            low, high = _length_range(ep)
            if low <= 2 and high >= limit:  # 0 and 1 are always specialised away
                return ep
            # a branch on the length (DeepSeek-V4's compressed attention: 12..127 when traced at 16)
            reason = f"the graph traced at length {seq} holds only for lengths {low}..{high} of 1..{limit}"
            # traced at the training length, it holds there (guards beyond the range, as a length divisible by 4,
            # too): the first graph, with no second export of the model
            first = ep if fixed_len == seq else at_length(fixed_len)
    log.info("%s: torch.export cannot keep the sequence length symbolic (%s); one graph per length",
             type(model).__name__, reason)
    return PerLengthExport(first, at_length, fixed_len, reason)


def _length_range(ep: torch.export.ExportedProgram) -> tuple[int, int]:
    """The sequence lengths a dynamic export's graph is valid for (its guards on ids' dim 1)."""
    ids = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == ep.graph_signature.user_inputs[0])
    length = ids.meta["val"].shape[1]
    if not isinstance(length, torch.SymInt):
        return int(length), int(length)
    bounds = ep.range_constraints.get(length.node.expr)
    return (int(bounds.lower), int(bounds.upper)) if bounds is not None else (0, sys.maxsize)


def explain_export_failure(model: nn.Module, error: Exception) -> None:
    """Raise a one-line HFLoadError naming the layer when torch.export failed on data-dependent control flow
    in a layer's forward: most MoE families of transformers 4.x loop in Python over the experts the router
    picked, which transformers 5 runs as one grouped op."""
    if "data-dependent" not in str(error):
        return
    found = _failing_layer(model, str(error))
    if found is None:
        return
    path, layer, where = found
    version = getattr(_transformers(), "__version__", "?")
    what = f"{type(model).__name__}: torch.export cannot trace {path} ({type(layer).__name__}){where}"
    if hasattr(layer, "experts") or "expert" in type(layer).__name__.lower():
        fix = ("transformers >= 5 runs MoE experts as one grouped op, which exports and which patchc prunes slice "
               "by slice: pip install -U 'transformers>=5'" if transformers_major() < 5 else
               "patchc exports MoE layers that run their experts as one grouped or batched op, as transformers 5's "
               "own MoE families do by default (model.set_experts_implementation('grouped_mm') if it was changed)")
        raise HFLoadError(f"{what}: it runs the experts the router picked in a Python loop, whose length depends "
                          f"on the routing (transformers {version}; {type(error).__name__}). {fix}") from error
    raise HFLoadError(f"{what}: its control flow depends on tensor values ({type(error).__name__}; "
                      "`patchc --debug ...` shows torch's message)") from error


def _failing_layer(model: nn.Module, message: str) -> tuple[str, nn.Module, str] | None:
    """(path, module, " at file:line") of the first module whose class's method holds a line torch's message
    points at ("File ..., line N, in forward", or "Caused by: (transformers/.../x.py:752 in forward)" with
    a path relative to site-packages); without one, the first layer that loops over a ModuleList of experts
    (transformers 4's MoE layers; a message without frames is DeepSeek-V3's there)."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', message)
    frames += re.findall(r"\(([^()\s]+\.py):(\d+) in (\w+)\)", message)
    for filename, line, func in frames:
        for path, module in model.named_modules():
            method = getattr(type(module), func, None)  # transformers wraps some (@deprecate_kwarg)
            code = getattr(inspect.unwrap(method) if callable(method) else None, "__code__", None)
            if (code is not None and (code.co_filename == filename or code.co_filename.endswith("/" + filename))
                    and int(line) in {n for *_, n in code.co_lines()}):
                return path, module, f" at {Path(filename).name}:{line}"
    return next(((path, m, "") for path, m in model.named_modules()
                 if isinstance(getattr(m, "experts", None), nn.ModuleList)), None)


def _export_ids(model: nn.Module, ids: torch.Tensor, dims: dict) -> torch.export.ExportedProgram:
    """torch.export `model(ids, use_cache=False)` with `dims` of ids dynamic.

    A forward that takes ``use_cache`` only through ``**kwargs`` (GraniteMoE) is exported without it and
    with ``config.use_cache`` off for the export (torch.export cannot map dynamic shapes through
    ``**kwargs``); its program is then called as ``m(ids)``. Layers with a traceable form
    (`patchc.models.traceable`: Qwen4-Exp's QSA indexer, DBRX's experts) are traced in that form.
    """
    with program_form(model):
        return _export_ids_as_is(model, ids, dims)


@contextlib.contextmanager
def program_form(model: nn.Module) -> Iterator[None]:
    """Run `model` inside the block as its export traces it: fused experts as one grouped mm, layers with a
    traceable form (`patchc.models.traceable`) in that form. What the exported program computes, and keeps
    for backward, is then what the model computes eagerly (`patchc.job.activations` probes it so: DBRX's
    traced experts run every expert on every token).

    Example:
        >>> with program_form(model):   # doctest: +SKIP
        ...     logits = model(ids).logits
    """
    with _grouped_experts(model), traceable_layers(model):
        yield


@contextlib.contextmanager
def _grouped_experts(model: nn.Module):
    """Fused experts run as one grouped mm while exporting: the form `patchc.transform` masks slice by slice.
    A model set to `batched_mm` (a weight gathered per token) or `eager` (a Python loop over the experts hit)
    would otherwise export its experts unmasked or not at all; its own setting is restored after."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    before = model.get_experts_implementation() if callable(can_set) and can_set() else {}
    if all(v in (None, "grouped_mm") for v in before.values()):
        yield
        return
    model.set_experts_implementation("grouped_mm")
    try:
        yield
    finally:
        model.set_experts_implementation(before)


def _export_ids_as_is(model: nn.Module, ids: torch.Tensor, dims: dict) -> torch.export.ExportedProgram:
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params or not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return _export(model, (ids,), kwargs={"use_cache": False},
                       dynamic_shapes={next(iter(params)): dims, "use_cache": None})
    config = getattr(model, "config", None)
    configs = {id(c): c for c in (config, getattr(config, "get_text_config", lambda: None)()) if c is not None}
    was = {key: getattr(c, "use_cache", None) for key, c in configs.items()}
    try:
        for c in configs.values():  # a multimodal model reads its text config's flag
            c.use_cache = False
        return _export(model, (ids,), dynamic_shapes=(dims,))
    finally:
        for key, c in configs.items():
            c.use_cache = was[key]


def _export(model: nn.Module, args: tuple, **kwargs: Any) -> torch.export.ExportedProgram:
    """torch.export.export, but the partial graph torch prints to stderr when a trace fails (thousands of
    lines for an LLM) goes to the debug log: the callers here retry at a fixed length or explain the error."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            ep = torch.export.export(model, args, **kwargs)
    except Exception:
        log.debug("torch.export failed; what it printed:\n%s", captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())  # the warnings of an export that worked are the user's to see
    return ep


def export_encoder(wrapper: nn.Module, batch: int = _EXAMPLE_BATCH, seq: int = _EXAMPLE_SEQ) -> torch.export.ExportedProgram:
    """torch.export an `EncoderWrapper` with dynamic batch and sequence; call it as ``m(input_ids, attention_mask)``.

    The example mask has padding in one row, so the traced attention path is the general (padded)
    one rather than an all-ones special case.

    Example:
        >>> ep = export_encoder(wrapper)
        >>> torch.equal(ep.module()(ids, mask), wrapper(ids, mask))
        True
    """
    limit = max_positions(wrapper.config, default=512)
    seq = min(seq, limit)
    device = device_of(wrapper)
    ids = torch.ones(batch, seq, dtype=torch.long, device=device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    mask[-1, seq // 2 :] = 0
    dims = {0: dynamic_dim(_MAX_BATCH), 1: dynamic_dim(limit)}
    return torch.export.export(wrapper, (ids, mask), dynamic_shapes={"input_ids": dims, "attention_mask": dims})


__all__ = ["export_causal_lm", "export_encoder", "program_form"]
