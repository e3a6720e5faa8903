"""The optimizer of mask training, in two memory modes, and what it costs per masked weight.

    memory="default"  torch Adam (fused where the device has it, else foreach): fp32 m and v, every
                      gradient kept until the step, global gradient-norm clipping. ~24 B per weight
                      with 1.5 fp32 logits per weight (logits 6 + grads 6 + m, v 12).
    memory="low"      `LowMemAdam`: bf16 m and v written back with stochastic rounding, and the step of
                      each logit tensor applied inside backward as soon as its gradient is accumulated
                      (`Tensor.register_post_accumulate_grad_hook`), so no gradient outlives its layer.
                      ~12 B per weight with 6 pattern logits per 2:4 group (logits 6 + m, v 3 + 3), ~8 B
                      with 4 scores per group. Logits stay fp32: updates of ~1e-4 vanish in bf16.
    v_per_group=True  one second moment per 2:4 group, shared by its 6 logits or 4 scores (Adam-mini's
                      rule: one v per block of parameters whose gradients share a scale). ~6.5 B per
                      weight with 4 scores (logits 4 + m 2 + v 0.5).

Why stochastic rounding: v moves by (1 - beta2) = 0.1% of itself per step, below bf16's 0.4% spacing,
so round-to-nearest would freeze it; rounding up with probability equal to the dropped fraction keeps
its expectation exact. The random bits come from a generator seeded by (seed, tensor index, step), so
a resumed run draws exactly what the straight run drew.

Clipping in low mode is per tensor (a tensor's gradient norm is capped at `grad_clip`): the global norm
is only known after the whole backward, when the early layers' gradients are gone.

Example:
    >>> cfg = MaskOptimConfig(memory="low")
    >>> opt = make_mask_optimizer(prog.mask_parameters(), lr=1e-3, cfg=cfg)
    >>> state_bytes(prog.mask_parameters(), opt)["state"]   # bytes of m and v
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

MEMORY_MODES = ("default", "low")
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LOW16 = 1 << 16  # bits of an fp32 that bf16 drops


@dataclass(frozen=True)
class MaskOptimConfig:
    """How `train_masks` updates the logits. `memory` picks the preset; the other fields override it.

    Args:
        memory: "default" (fp32 Adam, global clipping) or "low" (bf16 m / v, step in backward).
        state_dtype: dtype of Adam's m and v, "float32" or "bfloat16" (default: by `memory`).
        in_backward: step each tensor inside backward so no gradient persists (default: by `memory`).
        stochastic_rounding: round bf16 m / v stochastically (keeps v's 0.1% per-step moves).
        recompute: keep no W * M for backward; redraw it there (`patchc.masking.recompute`; default: by `memory`).
        v_per_group: one Adam v per 2:4 group instead of per logit (needs the custom optimizer; the
            mean of the group's squared gradients feeds it).
        betas, eps: Adam's.

    Example:
        >>> MaskOptimConfig(memory="low").state_dtype
        'bfloat16'
    """

    memory: str = "default"
    state_dtype: str | None = None
    in_backward: bool | None = None
    stochastic_rounding: bool = True
    recompute: bool | None = None
    v_per_group: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"MaskOptimConfig.memory={self.memory!r}: choose one of {MEMORY_MODES}")
        low = self.memory == "low"
        if self.state_dtype is None:
            object.__setattr__(self, "state_dtype", "bfloat16" if low else "float32")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"MaskOptimConfig.state_dtype={self.state_dtype!r}: choose one of {tuple(STATE_DTYPES)}")
        if self.in_backward is None:
            object.__setattr__(self, "in_backward", low)
        if self.recompute is None:
            object.__setattr__(self, "recompute", low)
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"MaskOptimConfig.betas={self.betas!r}: two values in [0, 1), e.g. (0.9, 0.999)")
        object.__setattr__(self, "betas", betas)
        if not self.eps > 0:
            raise ValueError(f"MaskOptimConfig.eps={self.eps!r} must be > 0 (e.g. 1e-8)")

    @property
    def custom(self) -> bool:
        """True when torch's Adam cannot do it (bf16 state or a per-tensor step in backward)."""
        return self.state_dtype != "float32" or bool(self.in_backward) or self.v_per_group


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), else the tensor itself: the update is elementwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _seed(seed: int, index: int, step: int) -> int:
    """A well-mixed 63-bit seed per (run seed, tensor, step) (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


_CHUNK = 1 << 20  # elements per independently seeded block of a noise stream


def counter_bits(key: int, start: int, shape: tuple[int, ...], device: torch.device, total: int) -> torch.Tensor:
    """31 random bits (int32 in [0, 2^31)) for elements start, start+1, ... of stream `key`, whose whole
    tensor has `total` elements.

    The stream is cut into blocks of min(2^20, total) elements, each drawn from its own seeded
    generator, so a slice (an FSDP shard) draws only the blocks it overlaps and gets exactly what the
    whole tensor gets.

    Example:
        >>> cpu = torch.device("cpu")
        >>> torch.equal(counter_bits(7, 0, (9,), cpu, 9)[2:], counter_bits(7, 2, (7,), cpu, 9))
        True
    """
    n, size = math.prod(shape), max(1, min(_CHUNK, total))
    if start + n > total:
        raise ValueError(f"counter_bits: elements {start}..{start + n} lie outside a tensor of {total}")
    first, last = start // size, (start + n - 1) // size if n else start // size - 1
    gen = torch.Generator(device=device)
    blocks = []
    for block in range(first, last + 1):
        gen.manual_seed(_seed(key, block, 0))
        blocks.append(torch.randint(0, 2**31 - 1, (size,), generator=gen, device=device, dtype=torch.int32))
    if not blocks:
        return torch.empty(shape, dtype=torch.int32, device=device)
    flat = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    lo = start - first * size
    return flat[lo: lo + n].view(shape)


def shard_offset(t: torch.Tensor) -> int:
    """Flat index, in the whole tensor, of the first element of this rank's shard: 0 for a plain tensor,
    rank * ceil(rows / ranks) rows for FSDP2's Shard(0) DTensor (torch.chunk's split)."""
    if not hasattr(t, "to_local"):
        return 0
    from torch.distributed.tensor import Shard

    if tuple(t.placements) != (Shard(0),):
        raise NotImplementedError(f"LowMemAdam: a DTensor placed {t.placements}; only FSDP2's Shard(0) is handled")
    rows, ranks = t.shape[0], t.device_mesh.size()
    first = min(t.device_mesh.get_local_rank() * -(-rows // ranks), rows)
    if t.to_local().shape[0] != min(-(-rows // ranks), rows - first):
        raise NotImplementedError(f"LowMemAdam: a Shard(0) DTensor of {rows} rows split unevenly "
                                  f"({t.to_local().shape[0]} rows here)")
    return first * math.prod(t.shape[1:])


def round_into(dst: torch.Tensor, src: torch.Tensor, noise: torch.Tensor | None) -> None:
    """dst (bf16) <- src (fp32, clobbered). With `noise` (int32 in [0, 2^16)), stochastic rounding:
    adding it to the dropped 16 bits carries into the kept ones with probability equal to their fraction.

    Example:
        >>> dst = torch.empty(4, dtype=torch.bfloat16)
        >>> round_into(dst, torch.full((4,), 1.001), torch.randint(0, 2**16, (4,), dtype=torch.int32))
    """
    if noise is None or dst.dtype != torch.bfloat16:
        dst.copy_(src)
        return
    bits = src.view(torch.int32)
    bits.add_(noise).bitwise_and_(-_LOW16)  # -65536 == 0xFFFF0000: keep sign, exponent, 7 mantissa bits
    dst.copy_(src)  # exact: the low 16 bits are zero


class LowMemAdam(torch.optim.Optimizer):
    """Adam with m and v stored in `state_dtype` (bf16: stochastically rounded), steppable per tensor.

    `step_param(p)` updates one tensor from its `.grad` (what the in-backward hook calls); `step()`
    updates every tensor that has a gradient. State dicts keep the low-precision dtype on load.
    A param group with `v_per_group=True` keeps one v per row of the last dim (a 2:4 group's logits).

    Example:
        >>> opt = LowMemAdam(prog.mask_parameters(), lr=1e-3)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, state_dtype: torch.dtype = torch.bfloat16, stochastic_rounding: bool = True,
                 seed: int = 0) -> None:
        if not lr > 0:
            raise ValueError(f"LowMemAdam: lr={lr} must be > 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, v_per_group=False))
        self.state_dtype, self.stochastic_rounding, self.seed = state_dtype, stochastic_rounding, seed
        self._index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self._map_groups()

    def _map_groups(self) -> None:
        self._group = {p: g for g in self.param_groups for p in g["params"]}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_param(p)
        return loss

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """One Adam step of tensor `p` from `p.grad` (left in place; the caller frees it)."""
        if p.grad is None:
            return
        group, state = self._group[p], self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            like = p[..., :1] if group["v_per_group"] else p  # a view: keeps a DTensor's sharding
            state["exp_avg_sq"] = torch.zeros_like(like, dtype=self.state_dtype, memory_format=torch.contiguous_format)
        state["step"] += 1
        t = int(state["step"])  # a CPU scalar: no device sync
        (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
        g, w = _local(p.grad).float(), _local(p)
        m_store, v_store = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        m, v = m_store.float(), v_store.float()
        if m.data_ptr() == m_store.data_ptr():  # fp32 state: .float() is the state itself, update in place
            m, v = m_store, v_store
        m.lerp_(g, 1 - b1)
        if group["v_per_group"]:
            v.mul_(b2).add_(g.square().mean(-1, keepdim=True), alpha=1 - b2)
        else:
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = v.sqrt().div_(math.sqrt(1 - b2**t)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / (1 - b1**t))
        del denom
        if m is not m_store:
            noise = self._noise(p, t) if self.stochastic_rounding else None
            round_into(m_store, m, None if noise is None else noise & (_LOW16 - 1))
            round_into(v_store, v, None if noise is None else (noise >> 15)[..., : v.shape[-1]])

    def _noise(self, p: torch.Tensor, t: int) -> torch.Tensor:
        """31 random bits per element: the low 16 round m, the high 16 round v. Keyed by the element's
        index in the whole tensor, so an FSDP shard draws what one process draws for the same rows."""
        local = _local(p)
        return counter_bits(_seed(self.seed, self._index[p], t), shard_offset(p), local.shape, local.device, p.numel())

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts float state to the parameter's dtype: cast m and v back (exactly)."""
        super().load_state_dict(state_dict)
        self._map_groups()  # the loader replaces the group dicts
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)


def make_mask_optimizer(params: Sequence[torch.Tensor], lr: float, cfg: MaskOptimConfig | None = None,
                        seed: int = 0, grouped: Sequence[torch.Tensor] | None = None,
                        tiles: Sequence[torch.Tensor] = (), tile_lr: float | None = None) -> torch.optim.Optimizer:
    """Adam over the logits as `cfg` asks: torch's fused (else foreach) Adam, or `LowMemAdam`.

    `grouped`: the tensors among `params` whose last dim holds one 2:4 group's logits (they share a v
    under `cfg.v_per_group`; `patchc.masking.train.make_optimizer` finds them in a program; empty for a
    tile-only program, whose 2:4 patterns are frozen). `tiles`: the tile-logit tensors among `params`,
    stepped at `tile_lr` (default `lr`) in a param group of their own.

    Example:
        >>> opt = make_mask_optimizer(prog.mask_parameters(), 1e-3, MaskOptimConfig(memory="low"))
    """
    cfg = cfg or MaskOptimConfig()
    params = list(params)
    if tile_lr is not None and not (math.isfinite(tile_lr) and tile_lr > 0):
        raise ValueError(f"tile_lr={tile_lr} must be a positive number (or None: the logits' lr)")
    if cfg.v_per_group and grouped is None:
        raise ValueError("MaskOptimConfig(v_per_group=True) needs `grouped`, the 2:4 logit tensors "
                         "(make_optimizer(prog, ...) finds them)")
    tile_ids = {id(p) for p in tiles}
    shared_ids = {id(p) for p in grouped or ()} if cfg.v_per_group else set()
    groups = [{"params": [p for p in params if id(p) in tile_ids], "lr": lr if tile_lr is None else tile_lr},
              {"params": [p for p in params if id(p) not in tile_ids and id(p) not in shared_ids]},
              {"params": [p for p in params if id(p) in shared_ids], "v_per_group": True}]
    groups = [g for g in groups if g["params"]] or [{"params": params}]  # no tensors: torch says so by name
    if cfg.custom:
        return LowMemAdam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, state_dtype=STATE_DTYPES[cfg.state_dtype],
                          stochastic_rounding=cfg.stochastic_rounding, seed=seed)
    return torch.optim.Adam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, **_fastest(params))


def _fastest(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """fused=True where every tensor is a plain CPU / CUDA fp32 tensor (7x faster than the loop on CPU
    in our measurement), else foreach."""
    plain = all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") and p.dtype == torch.float32
                for p in params)
    return {"fused": True} if plain and params else {"foreach": True}


def clip_each_(grads: Sequence[torch.Tensor], max_norm: float) -> None:
    """Scale each gradient so its norm is at most `max_norm` (torch's clip rule, per tensor; no device sync).
    A tensor may be an FSDP2 shard: the shards' squared norms are summed across ranks in one all-reduce,
    so each whole tensor is clipped as one process would."""
    local = [_local(g) for g in grads]
    if not local:
        return
    sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in local])
    if hasattr(grads[0], "to_local"):
        import torch.distributed as dist

        dist.all_reduce(sq, group=grads[0].device_mesh.get_group())
    scale = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g, s in zip(local, scale):
        g.mul_(s)


class _GradHooks:
    """A context manager that runs `self._hook(p)` whenever a gradient of one of `self.params` is accumulated."""

    params: list[torch.Tensor]

    def _hook(self, p: torch.Tensor) -> None:
        raise NotImplementedError

    def __enter__(self):
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class StepInBackward(_GradHooks):
    """Hooks that step `optimizer` on each tensor as soon as its gradient is accumulated, then free it.

    Use as a context manager around the training loop (removes the hooks on exit).

    Example:
        >>> with StepInBackward(opt, prog.mask_parameters(), grad_clip=1.0):
        ...     loss.backward()            # every logit tensor is updated; no .grad is left
    """

    def __init__(self, optimizer: LowMemAdam, params: Sequence[torch.Tensor], grad_clip: float | None) -> None:
        if not hasattr(optimizer, "step_param"):
            raise ValueError(f"a step in backward needs an optimizer with step_param(p) (LowMemAdam), "
                             f"got {type(optimizer).__name__}")
        self.optimizer, self.params, self.grad_clip = optimizer, list(params), grad_clip
        self.handles: list = []

    def _hook(self, p: torch.Tensor) -> None:
        if self.grad_clip is not None:
            clip_each_([p.grad], self.grad_clip)
        self.optimizer.step_param(p)
        p.grad = None


class GradPeak(_GradHooks):
    """Records the most gradient bytes alive at once among `params` during backwards run inside the block.

    Enter it before `train_masks` so its hooks run before the step-in-backward ones (which free each grad).

    Example:
        >>> with GradPeak(prog.mask_parameters()) as peak:
        ...     train_masks(prog, ..., steps=2)
        >>> peak.bytes
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params, self.bytes, self.handles = list(params), 0, []

    def _hook(self, _p: torch.Tensor) -> None:
        alive = sum(_local(q.grad).numel() * _local(q.grad).element_size() for q in self.params if q.grad is not None)
        self.bytes = max(self.bytes, alive)


def state_bytes(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                grad_bytes: int = 0) -> dict[str, int]:
    """Bytes held by the logits and the optimizer state, with `grad_bytes` (e.g. `GradPeak.bytes`).

    Example:
        >>> b = state_bytes(prog.mask_parameters(), opt, peak.bytes)
        >>> sum(b.values()) / sum(m.numel for m in prog.layers.values())   # bytes per masked weight
    """
    def size(t: torch.Tensor) -> int:
        t = _local(t)
        return t.numel() * t.element_size()

    logits = sum(size(p) for p in params)
    state = sum(size(v) for p in params for v in optimizer.state.get(p, {}).values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"logits": logits, "grads": int(grad_bytes), "state": state}


__all__ = ["MaskOptimConfig", "LowMemAdam", "StepInBackward", "GradPeak", "make_mask_optimizer", "state_bytes", "round_into",
           "clip_each_", "counter_bits", "shard_offset", "MEMORY_MODES"]
