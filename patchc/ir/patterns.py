"""2:4 pattern codes and the metadata nibble format shared by the masks, the IR, the kernels and the files.

A group is 4 consecutive weights of a row along K; a 2:4 group keeps exactly 2. The 6 candidate
patterns, in this order everywhere (`PATTERNS`, index p <-> kept positions (i0, i1)):
1100 (0,1), 1010 (0,2), 1001 (0,3), 0110 (1,2), 0101 (1,3), 0011 (2,3).

A group's positions are stored as the nibble i0 | (i1 << 2); byte j of a tile row holds group 2j in
its low and group 2j+1 in its high nibble (`pack_meta` / `unpack_meta`)::

    W row        [ 0  a  0  b | c  d  0  0 ]
    nibbles      g0 = 1 | 3 << 2 = 0b1101 = 0xD      g1 = 0 | 1 << 2 = 0b0100 = 0x4
    meta row     [ 0x4D ]

Example:
    >>> pattern_index(torch.tensor([[True, False, True, False]]))
    tensor([1])
    >>> pack_meta(torch.tensor([[1, 3], [0, 1]]))
    tensor([77], dtype=torch.uint8)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# The 6 ways to keep 2 of 4, fixed order (shared with the masks, the kernels and the files).
PATTERNS = torch.tensor(
    [[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.bool
)
POSITIONS = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]], dtype=torch.int64)


def _code_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Lookup tables over the 16 bit codes of a group (bit i = position i kept).

    exact[code]: pattern index of a code with exactly 2 bits, else -1.
    cover[code]: pattern that keeps every set bit of a code with at most 2 bits, filling with the
        lowest free positions (used to infer positions from already-pruned weights), else -1.
    """
    exact = torch.full((16,), -1, dtype=torch.int64)
    cover = torch.full((16,), -1, dtype=torch.int64)
    for p, (i0, i1) in enumerate(POSITIONS.tolist()):
        exact[(1 << i0) | (1 << i1)] = p
    for code in range(16):
        kept = [i for i in range(4) if code >> i & 1]
        if len(kept) <= 2:
            free = [i for i in range(4) if i not in kept]
            pair = tuple(sorted(kept + free[: 2 - len(kept)]))
            cover[code] = POSITIONS.tolist().index(list(pair))
    return exact, cover


# group code -> pattern index (-1: not exactly 2 kept) / covering pattern (-1: more than 2 kept)
EXACT_PATTERN, COVER_PATTERN = _code_tables()
PATTERN_NIBBLES = (POSITIONS[:, 0] | (POSITIONS[:, 1] << 2)).to(torch.uint8)  # pattern index -> meta nibble

def group_codes(mask4: torch.Tensor) -> torch.Tensor:
    """Bit code (0..15) of each group of 4 in `mask4` (..., 4): bit i set iff position i is kept."""
    m = mask4.to(torch.uint8)  # uint8 shifts: ~40x faster than an int64 weighted sum on CPU
    return (m[..., 0] | (m[..., 1] << 1) | (m[..., 2] << 2) | (m[..., 3] << 3)).long()


def pattern_index(mask4: torch.Tensor) -> torch.Tensor:
    """Index into `PATTERNS` of each (..., 4) bool group; -1 where the group does not keep exactly 2.

    Example:
        >>> pattern_index(torch.tensor([[True, False, True, False], [True, True, True, False]]))
        tensor([ 1, -1])
    """
    if mask4.shape[-1:] != (4,):
        raise ValueError(f"pattern_index expects groups of 4 in the last dim, got shape {tuple(mask4.shape)}")
    return EXACT_PATTERN.to(mask4.device)[group_codes(mask4)]


def pattern_to_positions(index: torch.Tensor) -> torch.Tensor:
    """Kept positions (..., 2) int64, i0 < i1, of pattern indices (...) in 0..5.

    Example:
        >>> pattern_to_positions(torch.tensor([0, 4]))
        tensor([[0, 1],
                [1, 3]])
    """
    if index.numel() and (int(index.min()) < 0 or int(index.max()) > 5):
        raise ValueError("pattern indices must lie in 0..5 (see PATTERNS)")
    return POSITIONS.to(index.device)[index.long()]


def pack_meta(positions: torch.Tensor) -> torch.Tensor:
    """Pack kept positions (..., G, 2) (i0 < i1, in 0..3) into nibbles: uint8 (..., ceil(G / 2)).

    nibble(g) = i0 | (i1 << 2); byte j holds group 2j in its low and group 2j+1 in its high nibble;
    an odd G leaves the last high nibble 0.

    Example:
        >>> pack_meta(torch.tensor([[1, 3], [0, 1]]))
        tensor([77], dtype=torch.uint8)
    """
    if positions.shape[-1:] != (2,) or positions.dim() < 2:
        raise ValueError(f"pack_meta expects positions of shape (..., G, 2), got {tuple(positions.shape)}")
    pos = positions.to(torch.uint8)
    return pack_nibbles(pos[..., 0] | (pos[..., 1] << 2))


def pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """Nibbles (..., G) -> uint8 bytes (..., ceil(G / 2)), group 2j low, 2j+1 high (the IR and kernel format)."""
    nib = nib.to(torch.uint8)
    if nib.shape[-1] % 2:
        nib = F.pad(nib, (0, 1))
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous()


def unpack_nibbles(meta: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 (..., ceil(G / 2)) -> uint8 nibbles (..., G)."""
    both = torch.stack([meta & 0xF, meta >> 4], dim=-1).flatten(-2)
    return both[..., :groups].contiguous()


def unpack_meta(meta: torch.Tensor, b2: int) -> torch.Tensor:
    """Inverse of `pack_meta`: uint8 (..., ceil(b2 / 8)) -> positions (..., b2 // 4, 2) int64.

    Example:
        >>> unpack_meta(torch.tensor([0x4D], dtype=torch.uint8), 8)
        tensor([[1, 3],
                [0, 1]])
    """
    groups = b2 // 4
    if meta.shape[-1:] != (math.ceil(groups / 2),):
        raise ValueError(f"meta last dim {tuple(meta.shape)[-1:]} does not match b2={b2} (want ceil(b2/8))")
    nib = unpack_nibbles(meta, groups).to(torch.int64)
    return torch.stack([nib & 3, nib >> 2], dim=-1)
