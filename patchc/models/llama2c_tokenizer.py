"""llama2.c's tokenizer: a SentencePiece-style BPE read from its .bin file (e.g. tok512.bin).

Example:
    >>> tok = load_tokenizer(STORIES260K_DIR / "tok512.bin")
    >>> tok.decode(tok.encode("Once upon a time"))
    'Once upon a time'
"""

from __future__ import annotations

import heapq
import os
import struct
from pathlib import Path

import torch

from patchc.models.llama2c import CheckpointError

BOS_ID = 1
EOS_ID = 2


class Tokenizer:
    """llama2.c's SentencePiece-style BPE tokenizer (run.c encode/decode semantics).

    File format: int32 max_token_length, then per token: float32 score, int32 byte length, bytes.
    Ids 0/1/2 are <unk>/BOS/EOS; byte-fallback tokens <0x00>..<0xFF> are ids 3..258.

    Example:
        >>> tok = load_tokenizer(STORIES260K_DIR / "tok512.bin")
        >>> ids = tok.encode("Once upon a time")       # [1, ...]: BOS, then " Once", ...
        >>> tok.decode(ids)
        'Once upon a time'
    """

    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, pieces: list[bytes], scores: list[float], max_token_length: int) -> None:
        if len(pieces) != len(scores):
            raise ValueError("Tokenizer: pieces and scores must have the same length")
        self.pieces = pieces
        self.scores = scores
        self.max_token_length = max_token_length
        self.lookup: dict[bytes, int] = {}
        for i, p in enumerate(pieces):
            self.lookup.setdefault(p, i)  # first id wins for duplicate pieces
        # Decoded bytes of each piece: "<0xXX>" -> that byte (run.c's sscanf "<0x%02hhX>").
        self._bytes = [self._piece_bytes(p) for p in pieces]

    @staticmethod
    def _piece_bytes(p: bytes) -> bytes:
        if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">"):
            try:
                return bytes([int(p[3:5], 16)])
            except ValueError:
                pass
        return p

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """run.c encode: [BOS], dummy-prefix " ", code points (byte fallback id = byte + 3), greedy merges."""
        ids: list[int] = [self.bos_id] if bos else []
        if not text:
            return ids + ([self.eos_id] if eos else [])
        tokens: list[int] = []
        space = self.lookup.get(b" ")
        if space is not None:
            tokens.append(space)
        for ch in text:
            b = ch.encode("utf-8")
            tid = self.lookup.get(b)
            if tid is not None:
                tokens.append(tid)
            else:
                tokens.extend(byte + 3 for byte in b)
        return ids + self._merge(tokens) + ([self.eos_id] if eos else [])

    def _merge(self, tokens: list[int]) -> list[int]:
        # Same result as run.c's O(n^2) loop (repeatedly merge the best-scoring adjacent pair, leftmost on
        # ties), in O(n log n): a heap keyed by (-score, left position) over a linked list, with stale
        # entries skipped. Node indices keep the original left-to-right order, so the tie-break matches.
        n = len(tokens)
        if n < 2:
            return tokens
        tok = list(tokens)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap: list[tuple[float, int, int, int, int]] = []

        def push(i: int) -> None:
            j = nxt[i]
            if j >= n:
                return
            merged = self.lookup.get(self.pieces[tok[i]] + self.pieces[tok[j]])
            if merged is not None and self.scores[merged] > -1e10:
                heapq.heappush(heap, (-self.scores[merged], i, j, tok[i], tok[j]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, j, ti, tj = heapq.heappop(heap)
            if not (alive[i] and alive[j] and nxt[i] == j and tok[i] == ti and tok[j] == tj):
                continue
            tok[i] = self.lookup[self.pieces[ti] + self.pieces[tj]]
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        return [tok[i] for i in range(n) if alive[i]]

    def decode_piece(self, prev_id: int, token_id: int) -> bytes:
        """Bytes of one token as run.c prints it: the leading space after BOS is dropped."""
        piece = self._bytes[token_id]
        if prev_id == self.bos_id and piece.startswith(b" "):
            piece = piece[1:]
        return piece

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of a token sequence; BOS/EOS are not printed (run.c), invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = bytearray()
        prev = -1
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} out of range for a {self.vocab_size}-token vocabulary")
            if t not in (self.bos_id, self.eos_id):
                out += self.decode_piece(prev, t)
            prev = t
        return out.decode("utf-8", errors="replace")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Read a llama2.c tokenizer .bin (e.g. tok512.bin); errors name the file.

    Example:
        >>> load_tokenizer(STORIES260K_DIR / "tok512.bin").vocab_size
        512
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"llama2.c tokenizer not found: {path}")
    raw = path.read_bytes()
    if len(raw) < 4:
        raise CheckpointError(f"{path}: too short for a llama2.c tokenizer (needs an int32 max_token_length)")
    (max_len,) = struct.unpack_from("<i", raw)
    if not 0 < max_len < 1 << 16:
        raise CheckpointError(f"{path}: bad max_token_length {max_len}; not a llama2.c tokenizer file")
    pieces: list[bytes] = []
    scores: list[float] = []
    pos = 4
    while pos < len(raw):
        if pos + 8 > len(raw):
            raise CheckpointError(f"{path}: truncated in the record of token {len(pieces)} (byte {pos})")
        score, length = struct.unpack_from("<fi", raw, pos)
        pos += 8
        if not 0 <= length <= max_len or pos + length > len(raw):
            raise CheckpointError(f"{path}: token {len(pieces)} has bad length {length} (byte {pos - 4})")
        pieces.append(raw[pos : pos + length])
        scores.append(score)
        pos += length
    if len(pieces) < 259:
        raise CheckpointError(f"{path}: only {len(pieces)} tokens; llama2.c tokenizers have 3 specials + 256 bytes")
    return Tokenizer(pieces, scores, max_len)


__all__ = ["BOS_ID", "EOS_ID", "Tokenizer", "load_tokenizer"]
