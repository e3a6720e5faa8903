"""A plain PyTorch Llama-2 that reads Karpathy's llama2.c checkpoints (e.g. stories260K), and generates.

Its tokenizer is `llama2c_tokenizer.py`; where the real checkpoints live, `shared.py`.

The module names follow Hugging Face's Llama (``layers.0.self_attn.q_proj``, ``layers.0.mlp.gate_proj``,
``embed_tokens``, ``norm``, ``lm_head``) so that patchc's passes recognise the projections, and the forward
pass exports with dynamic batch and sequence dimensions.

Example:
    >>> from patchc.models import SHARED_DIR, load_llama2c, load_tokenizer, generate
    >>> model = load_llama2c(SHARED_DIR / "models/stories260K/stories260K.bin")
    >>> tok = load_tokenizer(SHARED_DIR / "models/stories260K/tok512.bin")
    >>> ids = torch.tensor([tok.encode("Once upon a time")])
    >>> tok.decode(generate(model, ids, max_new_tokens=24)[0].tolist())
    'Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ...'
    >>> ep = export_llama(model)            # torch.export with dynamic (batch, seq)
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from patchc.models.dims import dynamic_dim

_HEADER = struct.Struct("<7i")
_V1_MAGIC = 0x616B3432  # "ak42": llama2.c's newer export formats, which this loader does not read


class CheckpointError(ValueError):
    """A llama2.c checkpoint or tokenizer file that cannot be read; the message names the file."""


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a llama2.c model (the 7-int header) plus the fixed numerics of llama2.c.

    Example:
        >>> LlamaConfig(dim=64, hidden_dim=172, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, max_seq_len=512)
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    shared_classifier: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE; change dim or n_heads")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("LlamaConfig.norm_eps and rope_theta must be > 0")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, as llama2.c's rmsnorm."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # llama2.c rotates interleaved pairs (x[2i], x[2i+1]), not the two halves as HF does.
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out0 = x0 * cos - x1 * sin
    out1 = x0 * sin + x1 * cos
    return torch.stack((out0, out1), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        causal = True
        if cache is not None:  # [k, v] of the earlier positions, extended in place
            if cache:
                if t != 1:
                    raise ValueError("Llama KV cache: after the prompt, feed one token per call")
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
                causal = False  # one new query attends to every cached position
            cache[:] = [k, v]
        if self.n_heads != self.n_kv_heads:
            # Query head h reads kv head h // (n_heads / n_kv_heads) (llama2.c). A gather, not an expand +
            # reshape: torch 2.11 cannot prove that reshape's view check for every length (export failed there).
            kv_head = torch.arange(self.n_heads, device=k.device) // (self.n_heads // self.n_kv_heads)
            k, v = k.index_select(1, kv_head), v.index_select(1, kv_head)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o_proj(y.transpose(1, 2).reshape(b, q.shape[2], self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); llama2.c w1 = gate, w3 = up, w2 = down."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama-2 causal LM: forward(input_ids (B, T) long) -> logits (B, T, vocab) float.

    A fresh model is randomly initialised (llama2.c's training init: N(0, 0.02), residual
    projections scaled by 1/sqrt(2 n_layers)); use `load_llama2c` for trained weights.

    Example:
        >>> model = Llama(LlamaConfig(64, 172, 5, 8, 4, 512, 512))
        >>> model(torch.zeros(2, 10, dtype=torch.long)).shape
        torch.Size([2, 10, 512])
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.shared_classifier:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(config)
        # Non-persistent: recomputed from the config, never saved in state_dict.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std = 0.02 / math.sqrt(2 * self.config.n_layers)
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor, cache: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        """`cache`: for generation, one empty list per layer, filled with (k, v) by the prompt's call and
        extended by each later one-token call (positions continue from the cached length)."""
        start = cache[0][0].shape[2] if cache and cache[0] else 0
        t = input_ids.shape[1]
        cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if cache is None else cache[i])
        return self.lm_head(self.norm(x)).float()

    def new_cache(self) -> list[list[torch.Tensor]]:
        """An empty KV cache for `forward(ids, cache=...)`."""
        return [[] for _ in self.layers]


def rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, head_dim / 2): angle(pos, i) = pos * theta^(-2i / head_dim)."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def _read_config(path: Path, raw: bytes) -> LlamaConfig:
    if len(raw) < _HEADER.size:
        raise CheckpointError(f"{path}: {len(raw)} bytes, too short for the 28-byte llama2.c header")
    if struct.unpack_from("<I", raw)[0] == _V1_MAGIC:
        raise CheckpointError(
            f"{path}: llama2.c version-1/2 export (magic 'ak42'); re-export with llama2.c's legacy format (version 0)"
        )
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq = _HEADER.unpack_from(raw)
    try:
        return LlamaConfig(dim, hidden, n_layers, n_heads, n_kv, abs(vocab), seq, shared_classifier=vocab > 0)
    except ValueError as e:
        raise CheckpointError(
            f"{path}: bad llama2.c header (dim={dim}, hidden_dim={hidden}, n_layers={n_layers}, n_heads={n_heads}, "
            f"n_kv_heads={n_kv}, vocab_size={vocab}, max_seq_len={seq}): {e}"
        ) from None


def _tensor_layout(cfg: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """llama2.c's fixed tensor order (legacy export), with llama2.c's shapes."""
    L, d, h, hd = cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.head_dim
    layout = [
        ("tok_embeddings", (cfg.vocab_size, d)),
        ("rms_att", (L, d)),
        ("wq", (L, cfg.n_heads * hd, d)),
        ("wk", (L, cfg.kv_dim, d)),
        ("wv", (L, cfg.kv_dim, d)),
        ("wo", (L, d, cfg.n_heads * hd)),
        ("rms_ffn", (L, d)),
        ("w1", (L, h, d)),
        ("w2", (L, d, h)),
        ("w3", (L, h, d)),
        ("rms_final", (d,)),
        ("freq_cis_real", (cfg.max_seq_len, hd // 2)),
        ("freq_cis_imag", (cfg.max_seq_len, hd // 2)),
    ]
    if not cfg.shared_classifier:
        layout.append(("wcls", (cfg.vocab_size, d)))
    return layout


def load_llama2c(path: str | os.PathLike) -> Llama:
    """Read a llama2.c (legacy, version 0) float32 checkpoint into a `Llama` in eval mode.

    Raises CheckpointError (a ValueError) naming the file when it is missing, truncated, too long, or its
    header is not a valid Llama shape.

    Example:
        >>> model = load_llama2c(STORIES260K_DIR / "stories260K.bin")
        >>> model.config.dim, model.config.n_kv_heads
        (64, 4)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"llama2.c checkpoint not found: {path}")
    raw = path.read_bytes()
    cfg = _read_config(path, raw)
    layout = _tensor_layout(cfg)
    expected = _HEADER.size + 4 * sum(math.prod(s) for _, s in layout)
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than expected"
        raise CheckpointError(
            f"{path}: {what}: {len(raw)} bytes, but the header {cfg} needs exactly {expected} "
            "(28-byte header + float32 tensors in llama2.c order)"
        )
    flat = torch.frombuffer(bytearray(raw[_HEADER.size :]), dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in layout:
        n = math.prod(shape)
        tensors[name] = flat[offset : offset + n].view(shape)
        offset += n

    model = Llama(cfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tensors["tok_embeddings"])
        for i, layer in enumerate(model.layers):
            layer.input_layernorm.weight.copy_(tensors["rms_att"][i])
            layer.self_attn.q_proj.weight.copy_(tensors["wq"][i])
            layer.self_attn.k_proj.weight.copy_(tensors["wk"][i])
            layer.self_attn.v_proj.weight.copy_(tensors["wv"][i])
            layer.self_attn.o_proj.weight.copy_(tensors["wo"][i])
            layer.post_attention_layernorm.weight.copy_(tensors["rms_ffn"][i])
            layer.mlp.gate_proj.weight.copy_(tensors["w1"][i])
            layer.mlp.down_proj.weight.copy_(tensors["w2"][i])
            layer.mlp.up_proj.weight.copy_(tensors["w3"][i])
        model.norm.weight.copy_(tensors["rms_final"])
        if not cfg.shared_classifier:
            model.lm_head.weight.copy_(tensors["wcls"])
    return model.eval()


def export_llama(model: nn.Module, batch: int = 2, seq: int = 16) -> torch.export.ExportedProgram:
    """torch.export a `Llama` with dynamic batch (1..1024) and sequence (1..max_seq_len) dimensions.

    Example:
        >>> ep = export_llama(model)
        >>> ep.module()(torch.zeros(3, 7, dtype=torch.long)).shape
        torch.Size([3, 7, 512])
    """
    max_seq = model.config.max_seq_len
    ids = torch.zeros(batch, min(seq, max_seq), dtype=torch.long, device=next(model.parameters()).device)
    dyn = {"input_ids": {0: dynamic_dim(1024), 1: dynamic_dim(max_seq)}}
    return torch.export.export(model, (ids,), dynamic_shapes=dyn)


# ----------------------------------------------------------------------------------------------- generation


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
) -> torch.Tensor:
    """Append `max_new_tokens` tokens to `ids` ((T,) or (B, T)); greedy at temperature 0, else sampled.

    Recomputes the whole (cropped to max_seq_len) context every step: fine for tiny models. Sampling uses
    a private generator seeded with `seed` (else from the global RNG), so equal seeds give equal
    continuations. Works on any callable
    returning logits (B, T, V), e.g. an exported program's module.

    Example:
        >>> out = generate(model, torch.tensor([tok.encode("Once upon a time")]), 20)
        >>> tok.decode(out[0])
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    squeeze = ids.dim() == 1
    out = ids[None] if squeeze else ids
    if out.dim() != 2 or out.shape[1] == 0:
        raise ValueError(f"ids must be (T,) or (B, T) with T >= 1, got shape {tuple(ids.shape)}")
    cfg = getattr(model, "config", None)
    max_ctx = getattr(cfg, "max_seq_len", None)
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=out.device)
        # Without a seed, draw one from the global RNG (so torch.manual_seed still governs the run).
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    for _ in range(max_new_tokens):
        ctx = out if max_ctx is None else out[:, -max_ctx:]
        logits = model(ctx)[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        out = torch.cat([out, nxt.to(out.dtype)], dim=1)
    return out[0] if squeeze else out


__all__ = [
    "CheckpointError",
    "LlamaConfig",
    "Llama",
    "RMSNorm",
    "rope_tables",
    "load_llama2c",
    "export_llama",
    "generate",
]
