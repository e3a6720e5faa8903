"""`TilePlan`: the tile plans of a model's weights, keyed by weight FQN, with skipped layers and metadata.

The whole-model view of the IR: global density and bytes, a summary table, writing W * M into a model
(`apply`), building plans from pruned weights or masks (`from_pruned.py`) and the plan file
(`file_format.py`).

Example:
    >>> layer = LayerPlan.from_mask("fc.weight", w, kinds, mask, tile=(16, 16))   # see `LayerPlan`
    >>> plan = TilePlan(layers={"fc.weight": layer}, skipped={"head.weight": "excluded"})
    >>> plan.save("/tmp/fc.patch"); TilePlan.load("/tmp/fc.patch").density == plan.density
    True
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from patchc.ir import file_format, targets
from patchc.ir.errors import PlanError
from patchc.ir.from_pruned import infer_tile, layers_from_linears, layers_from_masks, layers_from_weights
from patchc.ir.layer_plan import LayerPlan
from patchc.ir.provenance import check_weights, fingerprints, model_bias


@dataclass(eq=False)
class TilePlan:
    """Tile plans of a model's weights, keyed by weight FQN, plus skipped layers and metadata.

    Example::

        plan = TilePlan.from_weights(model.state_dict(), tile=(16, 16))
        plan.save("model.patch"); plan = TilePlan.load("model.patch")
        print(plan.summary()); plan.apply(model)
    """

    layers: dict[str, LayerPlan] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = dict(self.layers)
        self.skipped = {str(k): str(v) for k, v in dict(self.skipped).items()}
        self.meta = dict(self.meta)
        self.verify(deep=False)

    # -- validation ------------------------------------------------------------------------------

    def verify(self, deep: bool = True) -> None:
        """Raise `PlanError` if any layer is inconsistent (`deep=False`: only the structure)."""
        for fqn, layer in self.layers.items():
            if not isinstance(layer, LayerPlan):
                raise PlanError(f"layer {fqn}: expected a LayerPlan, got {type(layer).__name__}")
            if layer.name != fqn:
                raise PlanError(
                    f"layer {fqn}: keyed as {fqn!r} but named {layer.name!r}; key layers by their weight FQN"
                )
            if "::" in fqn:
                raise PlanError(f"layer {fqn}: '::' is reserved as the tensor-name separator in plan files")
            if deep:
                layer.verify()
        both = sorted(set(self.layers) & set(self.skipped))
        if both:
            raise PlanError(f"layer {both[0]}: both planned and skipped; keep it in one of layers / skipped")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as e:
            raise PlanError(f"plan meta must be JSON-serialisable (it is saved in the file header): {e}") from None

    # -- measures --------------------------------------------------------------------------------

    @property
    def density(self) -> float:
        """Global kept / total over planned layers (parameter weighted); 1.0 for an empty plan."""
        total = sum(layer.numel for layer in self.layers.values())
        return sum(layer.n_kept for layer in self.layers.values()) / total if total else 1.0

    @property
    def sparsity(self) -> float:
        """1 - density."""
        return 1.0 - self.density

    def nbytes(self) -> int:
        """Actual bytes of all stored buffers (per layer: `plan.layers[fqn].nbytes()`)."""
        return sum(layer.nbytes() for layer in self.layers.values())

    def summary(self) -> str:
        """A table: per layer shape, tile, dense / 2:4 tiles, density, bytes; skipped layers; totals."""
        head = ("layer", "shape", "tile", "dense / 2:4 tiles", "density", "bytes")
        rows = [
            (
                fqn,
                f"{layer.shape[0]}x{layer.shape[1]}",
                f"{layer.tile[0]}x{layer.tile[1]}",
                f"{layer.n_dense} / {layer.n_sparse}",
                f"{layer.density:.4f}",
                f"{layer.nbytes():,}",
            )
            for fqn, layer in self.layers.items()
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        def fmt(row: tuple[str, ...]) -> str:  # layer names left aligned, numbers right aligned
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

        lines = [fmt(head), "  ".join("-" * w for w in widths), *map(fmt, rows)]
        if self.skipped:
            lines += ["", f"skipped ({len(self.skipped)}):"]
            lines += [f"  {fqn}: {why}" for fqn, why in self.skipped.items()]
        kept = sum(layer.n_kept for layer in self.layers.values())
        total = sum(layer.numel for layer in self.layers.values())
        lines += [
            "",
            f"global (parameter weighted over {len(self.layers)} planned layers): {kept:,} / {total:,} weights kept, "
            f"density {self.density:.4f}, sparsity {self.sparsity:.4f}; stored {self.nbytes():,} bytes",
        ]
        return "\n".join(lines)

    # -- apply -----------------------------------------------------------------------------------

    def apply(self, model: nn.Module, force: bool = False) -> nn.Module:
        """Write each layer's W * M (and its bias, if the plan has one and the model a matching
        `<module>.bias`) into `model`'s parameters in place; returns `model`.

        Every target is checked before anything is written, also that the model's weights are the plan's
        source (`patchc.ir.provenance`; `force=True` skips that). Example: `plan.apply(copy.deepcopy(model))`.
        """
        where = targets.resolve_layers(self, model)  # every target checked before anything is written
        if not force:
            check_weights(self, model)
        with torch.no_grad():
            for fqn, target in where.items():  # one layer's W * M at a time, not a dense copy of the plan
                layer = self.layers[fqn]
                targets.read(model, target).copy_(layer.to_dense())
                bias = model_bias(model, target, layer)
                if bias is not None:
                    bias.copy_(layer.bias)
        return model

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_weights(
        cls,
        state_dict: Mapping[str, torch.Tensor] | nn.Module,
        tile: tuple[int, int] | int = (128, 128),
        include: Callable[[str], bool] | None = None,
        meta: dict | None = None,
    ) -> TilePlan:
        """Infer a plan from already-pruned weights: a tile is 2:4 iff every group has <= 2 nonzeros.

        Only 2-D float tensors named `*.weight` with K % 4 == 0 (and `include(fqn)` true, if given)
        are planned; other `*.weight` entries go to `skipped` with the reason. Positions of a 2:4
        group cover its nonzeros, filled with the lowest free positions. `<module>.bias` is carried.

        Example::

            plan = TilePlan.from_weights(pruned.state_dict(), tile=(16, 16), include=lambda f: "embed" not in f)
        """
        layers, skipped, tile = layers_from_weights(state_dict, tile, include)
        return cls(layers=layers, skipped=skipped, meta=dict(meta or {"source": "from_weights", "tile": list(tile)}))

    @classmethod
    def from_linears(cls, model: nn.Module, tile: tuple[int, int] | int | None = None) -> TilePlan:
        """Plan the weight matrices of a pruned `model` that hold a 2:4 tile, read off their zeros: `nn.Linear`
        and GPT-2 `Conv1D` weights, and each expert of fused MoE experts ("<param>.<expert>"); the LM head is
        left out, the others in `skipped` with the reason. Used by `patchc import` and `patchc.compile(model)`.
        `tile` None: the widest square that keeps the model's 2:4 tiles (`from_pruned.infer_tile`).

        Example: ``plan = TilePlan.from_linears(wanda_pruned_model)   # all 2:4: 128 x 128 tiles``
        """
        layers, left, tile, where = layers_from_linears(model, tile if tile is not None else infer_tile(model))
        return cls(layers=layers, skipped=left, meta={"source": "from_linears", "tile": list(tile), **where})

    @classmethod
    def from_masks(cls, model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor],
                   tile: tuple[int, int] | int = (128, 128), allow_lossy: bool = False, meta: dict | None = None,
                   ) -> TilePlan:
        """Build a plan from hard masks (N, K) bool per weight FQN.

        Given the model, masks are named and shaped as `patchc.oneshot` gives them: a Conv1D weight's (N, K),
        its transpose; a fused expert weight's "<param>.<e>" per expert (the plan records where they live).
        A tile whose mask keeps exactly 2 of 4 in every group becomes 2:4, an all-true tile dense.
        Anything else (e.g. an unstructured mask) raises `PlanError` naming the layer and tile,
        unless `allow_lossy=True`, where such a tile becomes dense (keeping weights the mask drops).

        Example::

            masks = patchc.oneshot(model, method="wanda", pattern="2:4", calib=calib)
            plan = TilePlan.from_masks(model, masks, tile=(16, 16))
        """
        layers, skipped, tile, where = layers_from_masks(model_or_state_dict, masks, tile, allow_lossy)
        base = {"source": "from_masks", "tile": list(tile), "allow_lossy": allow_lossy}
        state = getattr(model_or_state_dict, "state_dict", lambda: model_or_state_dict)()
        weights = {fqn: targets.read(model_or_state_dict, where[fqn]) if fqn in where else state[fqn] for fqn in layers}
        meta = dict(meta or base) | {"fingerprints": fingerprints(weights)} | targets.recorded_meta(where)
        return cls(layers=layers, skipped=skipped, meta=meta)

    # -- files -----------------------------------------------------------------------------------

    def header(self) -> dict:
        """The JSON header stored in the file's metadata under "patchc" (see `patchc.ir.file_format`)."""
        return file_format.header(self)

    def save(self, path: str | os.PathLike) -> None:
        """Verify, then write one safetensors file atomically (temp file in the same dir + os.replace).

        Example: `plan.save("model.patch")`.
        """
        self.verify()
        file_format.write_plan(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TilePlan:
        """Read and verify a plan written by `save` (safetensors only: nothing is ever unpickled).

        Example: `plan = TilePlan.load("model.patch")`.
        """
        layers, skipped, meta = file_format.read_plan(path)
        try:
            return cls(layers=layers, skipped=skipped, meta=meta)
        except PlanError as e:
            raise PlanError(f"{Path(path)}: {e}") from None
