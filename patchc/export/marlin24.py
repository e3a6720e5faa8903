"""Reading compressed-tensors' ``marlin-24`` checkpoints: int4 / int8 2:4 weights in Sparse-Marlin's layout.

The "2of4-quantized.w4a16" releases (llm-compressor, for vLLM's Sparse-Marlin kernel, which vLLM dropped)
store a 2:4 weight W (N, K) quantized symmetrically to b bits (4 or 8), with one fp16 scale per output
channel or per group of G input columns, as three tensors named after the module:

    <module>.weight_packed  int32 (K/32, 16N/P), P = 32/b   the kept values q + 2^(b-1) (unsigned), as
                            (K/2, N) -- the CUTLASS-compressed (N, K/2) transposed -- cut into 16 x 16
                            tiles, each run of 1024 values permuted (`marlin_order`), P values per int32
                            (value i of a word in bits b*i .. b*i + b - 1)
    <module>.meta           int16 (K/32, 2N)      CUTLASS's metadata, (N, K/16) reordered to its interleaved
                            layout with Marlin's row swizzle (`meta_offsets`), stored flat; each nibble gives
                            a group of 4 its two kept positions (low: the first value, high: the second)
    <module>.scale_packed   fp16 (K/G or 1, N)    the scales transposed; with more than 2 groups per row each
                            run of 64 is permuted (`SCALE_ORDER`)

W = (q_unsigned - 2^(b-1)) * scale, in fp16: the dequantized weights come back dense with their zeros,
and patchc serves them as fp16 / bf16 2:4 tiles (0.56x the bytes of dense fp16, not int4's 0.14x).
Every size is read off the tensors' shapes (config.json's quantization config is not needed).

Example:
    >>> w, mask = decode_marlin24(packed, scales, meta, "model.layers.0.mlp.up_proj.weight")
"""

from __future__ import annotations

import torch

from patchc.ir import PlanError

TILE = 16  # Marlin's tiles are 16 x 16 values of the (K/2, N) matrix
SCALE_ORDER = torch.tensor([8 * i + j for i in range(8) for j in (0, 4, 1, 5, 2, 6, 3, 7)])
SUFFIXES = (".weight_packed", ".meta", ".scale_packed")


def marlin_order(bits: int) -> torch.Tensor:
    """The permutation of each run of 1024 values in ``weight_packed`` (entry i: the source position of value i),
    which lines the values up with the registers of Sparse-Marlin's tensor-core fragments."""
    i = torch.arange(32)[:, None, None, None]  # a thread of the warp
    j = torch.arange(4)[None, :, None, None]
    block = torch.arange(2)[None, None, :, None]
    row = torch.tensor([0, 1, 8, 9])[None, None, None, :] + 2 * (i % 4)
    col = i // 4
    order = (16 * row + 256 * (col // 2) + 8 * (col % 2) + 4 * block + j).reshape(-1)
    interleave = {4: [0, 2, 4, 6, 1, 3, 5, 7], 8: [0, 2, 1, 3]}[bits]  # the order the kernel unpacks a word in
    return order.reshape(-1, len(interleave))[:, interleave].reshape(-1)


def meta_offsets(n: int, ncols: int) -> torch.Tensor:
    """Where each element of the (n, ncols) int16 metadata sits in the stored (flat) tensor: CUTLASS's
    column-major layout interleaved by 2, 2 x 2 blocks transposed, rows swizzled within 64 as Marlin reads them."""
    rows = torch.arange(n)[:, None].expand(n, ncols)
    cols = torch.arange(ncols)[None, :].expand(n, ncols)
    rows = (rows // 64 * 64 + (rows % 2) * 2 + (rows % 8) // 4 + (rows % 32 % 4) // 2 * 32 + (rows % 64) // 8 * 4)
    swap = (rows % 2 == 0).long() * (cols % 2 == 1).long() - (rows % 2 == 1).long() * (cols % 2 == 0).long()
    rows, cols = rows + swap, cols - swap
    return ((cols // 2) * n * 2 + rows * 2 + cols % 2).reshape(-1)


def decode_marlin24(packed: torch.Tensor, scale: torch.Tensor, meta: torch.Tensor,
                    name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(W of shape (N, K) in the scales' dtype, its (N, K) keep mask) from one module's three tensors;
    `PlanError` naming `name` for shapes that do not fit together.

    Example:
        >>> w, mask = decode_marlin24(f["m.weight_packed"], f["m.scale_packed"], f["m.meta"], "m.weight")
    """
    n, k, bits = _dims(packed, scale, meta, name)
    q = _unpack(packed, bits)                                   # (K/32, 16N)
    order = marlin_order(bits)
    q = q.reshape(-1, order.numel())[:, torch.argsort(order)]  # undo the 1024-value permutation
    q = q.reshape(k // 32, n // TILE, TILE, TILE).transpose(1, 2).reshape(k // 2, n)  # undo the tiling
    values = (q - (1 << (bits - 1))).t()                        # (N, K/2), signed
    flat = meta.reshape(-1)[meta_offsets(n, k // 16)].reshape(n, k // 16)
    mask, dense = _scatter(values, flat.to(torch.int32) & 0xFFFF, n, k)
    groups = scale.shape[0]
    s = scale
    if groups > 2:  # per-group scales of more than 2 groups a row were permuted in runs of 64
        s = s.reshape(-1, SCALE_ORDER.numel())[:, torch.argsort(SCALE_ORDER)]
    s = s.reshape(groups, n).t().float().repeat_interleave(k // groups, 1)
    return (dense * s).to(scale.dtype), mask


def _dims(packed: torch.Tensor, scale: torch.Tensor, meta: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(N, K, bits) from the shapes, each tensor's dtype and shape checked against the others."""
    if meta.dtype != torch.int16 or meta.dim() != 2 or meta.shape[1] % 2:
        raise PlanError(f"layer {name}: meta is a {meta.dtype} tensor of shape {tuple(meta.shape)}, expected int16 "
                        "(K/32, 2N)")
    k, n = 32 * meta.shape[0], meta.shape[1] // 2
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != k // 32 or (16 * n) % packed.shape[1]:
        raise PlanError(f"layer {name}: weight_packed is a {packed.dtype} tensor of shape {tuple(packed.shape)}, "
                        f"expected int32 ({k // 32}, {2 * n}) for 4-bit or ({k // 32}, {4 * n}) for 8-bit values")
    per_word = 16 * n // packed.shape[1]
    if per_word not in (8, 4):
        raise PlanError(f"layer {name}: weight_packed holds {per_word} values per int32; 4-bit (8) or 8-bit (4) "
                        "values are read")
    groups = scale.shape[0] if scale.dim() == 2 else 0
    if (not scale.is_floating_point() or groups == 0 or scale.shape[1] != n or k % groups
            or (groups > 2 and (groups * n) % SCALE_ORDER.numel())):
        raise PlanError(f"layer {name}: scale_packed is a {scale.dtype} tensor of shape {tuple(scale.shape)}, "
                        f"expected float (groups, {n}) with groups dividing K={k}")
    if n % 64:
        raise PlanError(f"layer {name}: N={n} is not a multiple of 64, which Sparse-Marlin's layout needs")
    return n, k, 32 // per_word


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, cols * 32/bits) unsigned values: value i of each int32 word is bits b*i .. b*i + b - 1."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def _scatter(values: torch.Tensor, meta: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, dense) (N, K): each group of 4 gets its two values at the positions its metadata nibble names."""
    nibbles = (meta[..., None] >> torch.arange(0, 16, 4)) & 0xF  # (N, K/16, 4): group 4c + t is nibble t of c
    nibbles = nibbles.reshape(n, k // 4)
    first, second = nibbles & 3, nibbles >> 2
    base = torch.arange(0, k, 4)[None, :]
    dense = torch.zeros(n, k)  # fp32 holds every int4 / int8 value exactly
    mask = torch.zeros(n, k, dtype=torch.bool)
    for pos, vals in ((first, values[:, 0::2]), (second, values[:, 1::2])):
        dense.scatter_(1, base + pos, vals.float())
        mask.scatter_(1, base + pos, True)
    return mask, dense


__all__ = ["SUFFIXES", "decode_marlin24", "marlin_order", "meta_offsets"]
