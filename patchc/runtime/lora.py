"""LoRA adapters on a compressed model: PEFT's LoRA over `TileLinear`, the packed base frozen.

A model that `patchc.compile` swapped or `patchc.from_pretrained` loaded holds its planned linears as
`TileLinear` (packed dense and 2:4 tiles, no dense weight), which PEFT does not know: `get_peft_model` stops
with "Target module TileLinear(...) is not supported". `register_lora(config)` registers `TileLoraLinear` for
it with the config (PEFT's custom-module dispatch), so the adapters train over the compressed base, as
QLoRA trains over a quantized one: the base runs its kernels forward and backward to the activations, the
dense low-rank deltas are added unmerged. Merging is refused: a dense delta would fill the 2:4 zeros.

Example:
    >>> fast = patchc.from_pretrained("served/")                                        # doctest: +SKIP
    >>> model = peft.get_peft_model(fast, patchc.register_lora(peft.LoraConfig(r=16, target_modules=["q_proj"])))
    >>> model = peft.PeftModel.from_pretrained(fast, "adapter/", config=patchc.register_lora(
    ...     peft.LoraConfig.from_pretrained("adapter/")))                                # loading a saved adapter
"""

from __future__ import annotations

from typing import Any

import torch

from patchc.runtime.dispatch import TileLinear

try:
    from peft.tuners.lora import Linear as _LoraLinear
except ImportError as err:  # pragma: no cover - peft is optional
    raise ImportError("patchc.register_lora needs PEFT: pip install peft") from err


class TileLoraLinear(_LoraLinear):
    """PEFT's `lora.Linear` over a `TileLinear` base: forward, adapters, dropout and scaling are PEFT's own."""

    def _get_in_out_features(self, module: Any) -> tuple[int, int]:
        # PEFT knows TileLinear's sizes from its nn.Linear-like attributes, but warns of an unknown layer type
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer: Any) -> tuple[torch.device, torch.dtype]:
        # PEFT reads `base_layer.weight` for these: on a TileLinear that unpacks and keeps a dense W * M
        return base_layer.values.device, base_layer.values.dtype

    def set_adapter(self, *args: Any, **kwargs: Any) -> None:
        super().set_adapter(*args, **kwargs)
        # PEFT calls this once the layer is swapped in, after reading `base_layer.weight` for the adapters' device
        # (LoraModel._replace_module): drop the dense W * M that read unpacked and kept
        self.get_base_layer().drop_weight_cache()

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise ValueError(f"LoRA on {self.get_base_layer().name!r}: cannot merge a dense low-rank delta into a packed "
                         "dense / 2:4 layer (it would fill the 2:4 zeros); serve the adapter unmerged, or merge it "
                         "into the dense model and prune that again")


def register_lora(config: Any) -> Any:
    """`config` (a `peft.LoraConfig`) with `TileLoraLinear` registered for `TileLinear`; returns it.

    Example:
        >>> model = peft.get_peft_model(fast, patchc.register_lora(peft.LoraConfig(target_modules=["v_proj"])))
    """
    if not hasattr(config, "_register_custom_module"):
        raise TypeError(f"register_lora: expected a peft.LoraConfig, got {type(config).__name__} (or a PEFT too old to "
                        "register custom LoRA layers: pip install -U peft)")
    config._register_custom_module({TileLinear: TileLoraLinear})
    return config


__all__ = ["TileLoraLinear", "register_lora"]
