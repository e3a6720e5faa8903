"""The inline PTX that expands 2:4 groups (`kernels._EXPAND_ASM`), checked without a GPU.

A compiled kernel runs the PTX; the interpreter runs `expand_words`' plain-op branch instead. This module
executes the PTX text itself with a small model of the instructions it uses (semantics as in the PTX ISA:
`shf.r.wrap`, `and`, `shl`, `xor`, `shr`, `prmt` in its default mode) for every metadata byte and both
groups of the byte, and compares the four dense values with the 2:4 definition: value v0 at position i0,
v1 at i1, zeros elsewhere. A swapped operand, a wrong `$n`, a bad selector constant fails here.
"""

from __future__ import annotations

import re

import pytest

from patchc.codegen import kernels

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    src = (b << 32) | a  # bytes 0-3 from a, 4-7 from b
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:  # sign-replicate mode: never used by the expansion
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _value(token: str, regs: dict[str, int]) -> int:
    token = token.strip()
    if token in regs:
        return regs[token]
    return int(token, 0) & MASK


OPS = {
    "shf.r.wrap.b32": lambda a, b, c: (((b << 32) | a) >> (c & 31)) & MASK,
    "and.b32": lambda a, b: a & b,
    "xor.b32": lambda a, b: a ^ b,
    "shl.b32": lambda a, b: (a << min(b, 32)) & MASK,
    "shr.b32": lambda a, b: a >> min(b, 32),
    "prmt.b32": _prmt,
}


def run_asm(text: str, inputs: list[int], n_out: int) -> list[int]:
    """Execute `text` with $n_out.. bound to `inputs`; returns the output registers $0..$n_out-1."""
    regs = {f"${n_out + i}": v & MASK for i, v in enumerate(inputs)}
    for line in text.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op not in OPS:
            raise AssertionError(f"the expansion uses {op!r}: add its semantics to this test")
        dst, *srcs = [a.strip() for a in args.split(",")]
        regs[dst] = OPS[op](*(_value(s, regs) for s in srcs))
    return [regs[f"${i}"] for i in range(n_out)]


def _halves(words: list[int]) -> list[int]:
    return [(w >> s) & 0xFFFF for w in words for s in (0, 16)]


PAIRS = [(i0, i1) for i0 in range(4) for i1 in range(i0 + 1, 4)]


@pytest.mark.parametrize("group", [0, 1])  # low / high nibble of the metadata byte
def test_expand_asm_places_each_kept_value_at_its_position(group):
    text = str(kernels._EXPAND_ASM.value if hasattr(kernels._EXPAND_ASM, "value") else kernels._EXPAND_ASM)
    assert re.findall(r"\$(\d)", text) and max(int(n) for n in re.findall(r"\$(\d)", text)) == 5
    sh = 4 * group
    r0, r1 = (sh + 29) & 31, (sh + 31) & 31  # what load_sparse_block passes
    v0, v1 = 0xBEEF, 0x1234
    pair = v0 | (v1 << 16)
    for (i0, i1) in PAIRS:
        for other in PAIRS:  # the other group's nibble in the same byte must not leak in
            nib, nib_other = i0 | (i1 << 2), other[0] | (other[1] << 2)
            byte = (nib << sh) | (nib_other << (4 - sh))
            got = _halves(run_asm(text, [pair, byte, r0, r1], 2))
            want = [v0 if p == i0 else v1 if p == i1 else 0 for p in range(4)]
            assert got == want, f"nibble {nib:#x} in byte {byte:#04x}: {got} != {want}"


def test_prmt_model_matches_the_isa_examples():
    """The model itself: default-mode selectors pick bytes of {b, a}; 0x3210 is the identity on a."""
    a, b = 0x33221100, 0x77665544
    assert _prmt(a, b, 0x3210) == a and _prmt(a, b, 0x7654) == b and _prmt(a, b, 0x0123) == 0x00112233
    assert _prmt(a, 0, 0x5410) == 0x00001100
