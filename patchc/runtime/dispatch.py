"""`TileLinear`: the nn.Module that replaces a planned nn.Linear (packed buffers + tuned configs).

The packed layout lives in registered buffers (they follow `.to()`, `.cuda()`, `.half()` and appear as
real tensors to `torch.export`), the launch choices in plain ints. `forward` calls the custom op
`patchc::tile_linear`, which dispatches by M (the decode config of M's bucket for M <= threshold, prefill
above; see `patchc.runtime.tuner` for how they are found) without any host synchronisation.

For an all-2:4 layer whose tuning picked torch's semi-structured sparse kernels for prefill, the module
also holds that weight (`semi_weight`, GPU only, not a buffer: it does not follow `.to()`); M above the
threshold then goes to `F.linear(x, semi_weight)` (a shape test, no synchronisation). A layer whose
tuning found cuBLAS faster at prefill carries a prefill config of kernel "unpacked": the op unpacks W * M
on the device (`codegen.unpack_kernel`) and runs `F.linear` on it (`TileLinear.route(m)` says which).

Before capturing a CUDA graph, run every M the graph will see once (`TileLinear.warmup(ms)`, or
`warmup(model, ms)` for a whole model): a kernel's first launch compiles and loads it, which cannot
happen during capture (the launcher raises then, naming the layer).

Example:
    >>> mod = TileLinear.from_plan(plan.layers["fc.weight"])        # doctest: +SKIP
    >>> y = mod(torch.randn(4, mod.in_features))                    # doctest: +SKIP
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from patchc.codegen.configs import KernelConfig, arch_of, choose_block
from patchc.codegen.launch import warm
from patchc.codegen.layout import BUFFER_NAMES, pack
from patchc.runtime import op as _op  # registers torch.ops.patchc.tile_linear
from patchc.runtime.experts import TileBmmExperts, TileExperts
from patchc.runtime.op import encode_config, encode_tuning
from patchc.runtime.timing import compile_ahead, compile_ahead_each, packed_buffers
from patchc.runtime.tuner import LayerTuning, default_tuning


def packed_dense(module: nn.Module, shape: tuple[int, int]) -> torch.Tensor:
    """W * M (`shape`) in the module's dtype, rebuilt from its packed buffers (`BUFFER_NAMES`, `block`): on the
    kernels' path (a GPU) by the unpack kernel (`op.w_hat`)."""
    return _op.w_hat(tuple(getattr(module, n) for n in BUFFER_NAMES), shape, module.block, module.values)


class TileLinear(nn.Module):
    """Hybrid dense / 2:4 linear: y = x @ W_hat^T (+ bias) through `patchc::tile_linear`.

    Example:
        >>> mod = TileLinear.from_plan(layer, tuning=None, dtype=torch.float16, device="cuda")  # doctest: +SKIP
    """

    stored_kn = False  # replaced a Conv1D, whose weight is stored (K, N): saved back so (`patchc.runtime.saving`)

    def __init__(self, packed: Any, tuning: LayerTuning, dtype: torch.dtype | None = None, device: Any = None,
                 semi_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self._weight_cache: torch.Tensor | None = None  # `.weight`, rebuilt from the buffers on first read
        if tuple(tuning.block) != tuple(packed.block):
            raise ValueError(f"layer {packed.name!r}: tuning block {tuning.block} != packed block {packed.block}")
        dtype = dtype or packed.dtype
        device = device if device is not None else packed.device
        bufs, per_row = packed_buffers(packed, dtype, device)
        for name, buf in zip(BUFFER_NAMES, bufs):
            self.register_buffer(name, buf)
        bias = None if packed.bias is None else packed.bias.to(device=device, dtype=dtype)
        self.register_buffer("bias", bias)
        self.name = packed.name
        self.out_features, self.in_features = packed.shape
        self.block = tuple(packed.block)
        self.per_row = tuple(per_row)
        self._set_tuning(tuning)
        self.semi_weight = semi_weight

    def _set_tuning(self, tuning: LayerTuning) -> None:
        self.decode_cfg = encode_config(tuning.decode)
        self.decode_buckets, self.prefill_cfg, self.threshold = encode_tuning(tuning)
        self.tuning = tuning

    def retuned(self, tuning: LayerTuning) -> TileLinear:
        """This layer under other launch configs of the same block, its buffers shared (to time two tunings).

        Example:
            >>> other = mod.retuned(dataclasses.replace(mod.tuning, threshold=4))   # doctest: +SKIP
        """
        semi = tuning.prefill_backend == "semi_structured"
        if tuple(tuning.block) != self.block or semi != (self.semi_weight is not None):
            raise ValueError(f"layer {self.name!r}: a retuning keeps the packed block {self.block} and whether "
                             f"torch's 2:4 weight serves prefill; got block {tuple(tuning.block)}, prefill backend "
                             f"{tuning.prefill_backend!r}: build it with TileLinear.from_plan instead")
        other = copy.copy(self)  # a new attribute dict; the buffer dict (the weights) is shared
        other._set_tuning(tuning)
        return other

    @classmethod
    def from_plan(
        cls,
        layer: Any,
        tuning: LayerTuning | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: Any = None,
        batch_size: int = 16,
        prefill_len: int = 128,
    ) -> TileLinear:
        """Pack a LayerPlan at the tuned block (or the architecture's default block) and wrap it.

        Example:
            >>> mod = TileLinear.from_plan(plan.layers["layers.0.mlp.up_proj.weight"], dtype=torch.float32)  # doctest: +SKIP
        """
        device = torch.device(device) if device is not None else torch.device("cpu")
        arch = arch_of(device)
        block = tuple(tuning.block) if tuning is not None else choose_block(tuple(layer.tile), arch)
        packed = pack(layer, block=block)
        tuning = tuning or default_tuning(layer, packed, batch_size, prefill_len, arch)
        semi = None
        if tuning.prefill_backend == "semi_structured" and device.type == "cuda":
            from torch.sparse import to_sparse_semi_structured

            semi = to_sparse_semi_structured(layer.to_dense().to(device=device, dtype=dtype or layer.dtype))
        return cls(packed, tuning, dtype=dtype, device=device, semi_weight=semi)

    # -- drop-in for nn.Linear -----------------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """W * M (out_features, in_features) in the module's dtype and device, rebuilt from its own packed
        buffers on first read and cached (HF code reads `.weight.dtype`; the forward never uses it). The module
        keeps no LayerPlan: on a GPU that would be a host copy of every planned weight."""
        dtype, device = self.values.dtype, self.values.device
        cached = self._weight_cache
        if cached is None or cached.dtype != dtype or cached.device != device:
            cached = self._weight_cache = packed_dense(self, (self.out_features, self.in_features))
        return cached

    @weight.setter
    def weight(self, value: Any) -> None:
        raise AttributeError(f"TileLinear {self.name!r}: the weight is packed from a plan and cannot be assigned; "
                             "apply the new weights with plan.apply(model) before patchc.compile")

    def drop_weight_cache(self) -> None:
        """Forget the dense `.weight` a read unpacked (it is rebuilt on the next read): after a move, a load,
        or code that reads `.weight` once for its dtype and device (PEFT's adapter injection)."""
        self._weight_cache = None

    def _apply(self, fn, recurse=True):
        self.drop_weight_cache()  # dtype / device moves
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self.drop_weight_cache()  # the buffers are overwritten in place: so is W * M
        return super()._load_from_state_dict(*args, **kwargs)

    def op_args(self, bias: Any = None) -> tuple[Any, ...]:
        """Everything the op takes after x (bias: override, e.g. an FX node; default the module's own)."""
        return (
            *(getattr(self, n) for n in BUFFER_NAMES),
            self.bias if bias is None else bias,
            self.name,
            [self.out_features, self.in_features],
            list(self.block),
            list(self.per_row),
            list(self.decode_buckets),
            list(self.prefill_cfg),
            self.threshold,
        )

    def warmup(self, ms: Iterable[int]) -> TileLinear:
        """Run once per M (a zeros input in the module's dtype, on its device) so that every kernel those M
        dispatch to (decode bucket, prefill, split-K reduce) is compiled and loaded: do it before capturing
        a CUDA graph, with the M the graph will see. Returns the module.

        Example:
            >>> mod.warmup([1, 4, 16, 128])   # doctest: +SKIP
        """
        ms = _token_counts(ms, f"layer {self.name!r}")
        compile_ahead([self], ms)
        return self._run_each(ms)

    def _run_each(self, ms: list[int]) -> TileLinear:
        with torch.no_grad():
            for m in ms:
                self(torch.zeros(m, self.in_features, dtype=self.values.dtype, device=self.values.device))
        return self

    def warmers(self, ms: Iterable[int]) -> list[Callable[[], None]]:
        """One compile-only call (`launch.warm`) per M that runs our kernels: what `forward` would launch."""
        out = []
        for m in ms:
            if self.semi_weight is not None and m > self.threshold:
                continue  # torch's semi-structured kernels serve it
            x = torch.zeros(m, self.in_features, dtype=self.values.dtype, device=self.values.device)
            out.append(functools.partial(warm, x, tuple(getattr(self, n) for n in BUFFER_NAMES), self.bias,
                                         (self.out_features, self.in_features), self.block, self.per_row,
                                         self.config(m)))
        return out

    def config(self, m: int) -> KernelConfig:
        """The launch config of our kernels for M tokens: M's decode bucket, or the prefill config.

        Example:
            >>> mod.config(1).split_k, mod.config(1).reduce   # doctest: +SKIP
            (16, 'fixup')
        """
        return _op.decode_config(_op.pick_decode(self.decode_buckets, m) if m <= self.threshold else self.prefill_cfg)

    def route(self, m: int) -> str:
        """What serves M tokens on a GPU: "decode" (M's bucket), "prefill" (a hybrid kernel with the prefill
        config: the tiled GEMM, or the decode kernel where it timed faster), "unpacked" (W * M unpacked on the
        device, then cuBLAS) or "semi_structured" (torch's 2:4 kernels).

        Example:
            >>> mod.route(1), mod.route(2048)   # doctest: +SKIP
            ('decode', 'unpacked')
        """
        if m <= self.threshold:
            return "decode"
        if self.semi_weight is not None:
            return "semi_structured"
        return "unpacked" if self.config(m).kernel == "unpacked" else "prefill"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        semi = self.semi_weight
        if semi is not None and x.is_cuda and x.dtype == semi.dtype and x.numel() // self.in_features > self.threshold:
            y = F.linear(x.reshape(-1, self.in_features), semi, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        return torch.ops.patchc.tile_linear(x, *self.op_args())

    def extra_repr(self) -> str:
        return (f"{self.name!r}, in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block}, decode={self.decode_cfg} ({len(self.tuning.buckets)} M buckets), "
                f"prefill={self.prefill_cfg}, "
                f"threshold={self.threshold}, bias={self.bias is not None}")


def warmup(model: nn.Module, ms: Iterable[int], top_k: int | None = None) -> int:
    """`TileLinear.warmup(ms)` for every TileLinear in `model` (M = tokens per call: batch x sequence), and
    the grouped kernels of every fused-experts module for the rows M tokens send them: M x top_k (default: the
    config's `num_experts_per_tok`), for Llama 4's M x its block's top_k (M x experts when not known). Returns
    how many modules were warmed (0: the model holds none, e.g. it was not patchc.compile'd).

    Example:
        >>> fast = patchc.runtime.compile(model, plan)                  # doctest: +SKIP
        >>> patchc.runtime.warmup(fast, [1, 2, 4, 8, 16, 128])          # doctest: +SKIP
        14
    """
    mods = [m for m in model.modules() if isinstance(m, TileLinear)]
    ms = _token_counts(ms, f"warmup({type(model).__name__})")
    jobs: list[tuple[Any, list[int]]] = [(mod, ms) for mod in mods]
    experts = [m for m in model.modules() if isinstance(m, TileExperts) and m.kernels]
    for mod in experts:
        bmm = isinstance(mod, TileBmmExperts)
        per = mod.launched_per_token() if bmm else top_k or _experts_per_token(model, mod.path)
        jobs += [(kernels, [m * per for m in ms]) for kernels in mod.kernels.values()]
    compile_ahead_each(jobs)  # every layer's kernels at once: same-shaped layers share them
    for mod, rows in jobs:
        mod._run_each(rows)
    return len(mods) + len(experts)


def _experts_per_token(model: nn.Module, path: str) -> int:
    """The experts each token is routed to, from the model's (text) config."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: None)()
    for cfg in (config, text, getattr(config, "ffn_config", None)):  # DBRX's ffn_config: moe_top_k
        for key in ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_top_k"):
            if isinstance(getattr(cfg, key, None), int):
                return int(getattr(cfg, key))
    raise ValueError(f"warmup({type(model).__name__}): {path} routes each token to top_k experts and the model's "
                     "config does not say how many: pass warmup(model, ms, top_k=K)")


def _token_counts(ms: Iterable[int], where: str) -> list[int]:
    ms = [int(m) for m in ms]
    if any(m < 1 for m in ms):
        raise ValueError(f"{where}: warmup needs token counts M >= 1, got {ms}")
    return ms


def report_unreplaced(what: str, verdict: str, layers: dict[str, str], strict: bool, stacklevel: int = 3) -> None:
    """Warn (or raise with `strict`) naming every planned layer an entry point left dense, and why:
    "patchc.compile: 2 planned layer(s) not replaced (...): a (why); b (why)"."""
    if not layers:
        return
    msg = f"{what}: {len(layers)} planned layer(s) {verdict}: " + "; ".join(f"{f} ({why})" for f, why in layers.items())
    if strict:
        raise ValueError(msg)
    warnings.warn(msg, stacklevel=stacklevel)
