"""A LLaMA-shaped decoder in plain PyTorch for the end-to-end bench (no transformers needed).

Blocks of q/k/v/o (dim x dim), gate/up (hidden x dim) and down (dim x hidden) linears, RMSNorm, rotary
embedding and a static KV cache (batch, heads, max_len, head_dim), so one decode step is a fixed-shape
graph: the cache position is a device tensor, and a CUDA graph captured once replays every step.
Random weights of the real shapes: speed depends on the shapes, not on the values.

Example:
    >>> model = Llama(LlamaShape.tiny(), batch=2, max_len=16)
    >>> model(torch.zeros(2, 3, dtype=torch.long), torch.arange(3)).shape
    torch.Size([2, 1, 96])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    """Model dimensions; `llama2_7b(layers)` has the real 7B shapes with fewer blocks."""

    dim: int
    hidden: int
    heads: int
    vocab: int
    layers: int

    def __post_init__(self) -> None:
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(f"LlamaShape: dim {self.dim} must split into {self.heads} heads of even size")

    @classmethod
    def llama2_7b(cls, layers: int = 32) -> LlamaShape:
        return cls(dim=4096, hidden=11008, heads=32, vocab=32000, layers=layers)

    @classmethod
    def tiny(cls, layers: int = 1) -> LlamaShape:
        return cls(dim=64, hidden=160, heads=4, vocab=96, layers=layers)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    """One LLaMA block with its own static KV cache."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.s = s
        for name, (n, k) in {"q": (s.dim, s.dim), "k": (s.dim, s.dim), "v": (s.dim, s.dim), "o": (s.dim, s.dim),
                             "gate": (s.hidden, s.dim), "up": (s.hidden, s.dim), "down": (s.dim, s.hidden)}.items():
            setattr(self, name, nn.Linear(k, n, bias=False))
        self.n1, self.n2 = nn.RMSNorm(s.dim), nn.RMSNorm(s.dim)

    def reset_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, self.s.heads, max_len, self.s.dim // self.s.heads)
        self.register_buffer("kc", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("vc", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.n1(x)
        q, k, v = (m(h).view(b, t, self.s.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        self.kc.index_copy_(2, pos, k)  # positions as a device tensor: no host sync, graph-safe
        self.vc.index_copy_(2, pos, v)
        a = F.scaled_dot_product_attention(q, self.kc, self.vc, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, self.s.dim))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Embedding, blocks, final norm and LM head; `forward(ids, pos)` returns the last position's logits."""

    def __init__(self, s: LlamaShape, batch: int, max_len: int) -> None:
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm, self.head = nn.RMSNorm(s.dim), nn.Linear(s.dim, s.vocab, bias=False)
        self.reset_cache(batch, max_len)

    def reset_cache(self, batch: int, max_len: int) -> None:
        """Fresh KV caches (and rotary tables) for `batch` sequences of up to `max_len` positions."""
        w = self.embed.weight
        hd = self.s.dim // self.s.heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=w.device).float() / hd))
        ang = torch.outer(torch.arange(max_len, device=w.device).float(), inv)
        self.register_buffer("cos", ang.cos().to(w.dtype), persistent=False)
        self.register_buffer("sin", ang.sin().to(w.dtype), persistent=False)
        for blk in self.blocks:
            blk.reset_cache(batch, max_len, w.dtype, w.device)
        self.max_len = max_len

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = self.cos[pos], self.sin[pos]
        keys = torch.arange(self.max_len, device=ids.device)
        mask = keys[None, :] <= pos[:, None]  # (t, max_len): causal over the filled cache
        for blk in self.blocks:
            x = blk(x, pos, cos, sin, mask)
        return self.head(self.norm(x[:, -1:]))

    def linear_names(self) -> dict[str, tuple[int, int]]:
        """{"blocks.i.q.weight": (N, K), ...} of every block linear (what a plan may cover)."""
        return {f"blocks.{i}.{name}.weight": tuple(lin.weight.shape)
                for i, blk in enumerate(self.blocks)
                for name, lin in blk.named_children() if isinstance(lin, nn.Linear)}
