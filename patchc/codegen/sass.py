"""What a compiled kernel costs, read from its cubin without a GPU: registers, spills, instruction mix.

Uses the `cuobjdump` and `nvdisasm` that Triton ships with its NVIDIA backend (`cuobjdump -res-usage` for
the resource line, nvdisasm for the machine code of many kernels in one call). The numbers are what a
profiler would show first when a kernel is slow: registers per thread (occupancy), local-memory bytes
(spills), and whether the weight loads are 128-bit (`LDG.E.128`), pipelined into shared memory (`LDGSTS`,
i.e. cp.async) and fed to tensor cores (`HMMA` on sm_80, `HGMMA`, i.e. wgmma, on sm_90). For the weight
loops (`weight_loops`): one iteration's instructions, barriers and shuffles, and the warp-instructions
issued per weight byte, which decide whether a decode kernel can reach the memory roofline at all.

Example:
    >>> usage = resource_usage("kernels/sm_90/layer/prefill.cubin")   # doctest: +SKIP
    >>> usage["registers"], usage["spill_bytes"]                      # doctest: +SKIP
    (201, 0)
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from patchc.utils.files import write_bytes_atomic

# SASS opcodes worth counting, by what they tell about the kernel
INSTRUCTIONS = {
    "ldg128": r"\bLDG\.E\.128\b",  # 16-byte global loads (vectorised)
    "ldg": r"\bLDG\.E\b(?!\.)",  # 4-byte (or narrower) global loads
    "ldgsts": r"\bLDGSTS\b",  # cp.async: global -> shared, pipelined
    "hmma": r"\bHMMA\b",  # mma.sync tensor-core ops (sm_80)
    "hgmma": r"\bHGMMA\b",  # wgmma tensor-core ops (sm_90)
    "ffma": r"\bFFMA\b",  # fp32 fused multiply-add (multiply-and-sum decode)
}
_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
# one SASS instruction line: /*0d30*/  @P1 BRA 0x4c0 ;
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
# instructions whose hex operands are code addresses (rebased when kernels are disassembled together)
_CODE_ADDRESS = re.compile(r"^(?:@!?U?P\w+\s+)?(?:BRA|BRX|BSSY|CALL|RET|JMP|JMX)\b")
_HEX = re.compile(r"0x([0-9a-f]+)")
_FORMAT = "sass-2"  # the cached text's form: bumped when what `disassemble_many` writes changes
_BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")
# per-loop counts: what limits the issue rate of a loop that should stream weights
LOOP_COUNTS = {
    "barriers": r"\bBAR\.SYNC\b",
    "shuffles": r"\bSHFL\b",
    "ldg128": INSTRUCTIONS["ldg128"],
    "ldg": r"\bLDG\.E\b(?!\.128)",
    "lds": r"\bLDS\b",
    "sts": r"\bSTS\b",
    "ffma": INSTRUCTIONS["ffma"],
    "ldg_past_l1": r"\bLDG\.E[\w.]*\.STRONG\.GPU\b",  # ld.global.cg: split-K's fixup, never a weight load
    "local": r"\b(?:LDL|STL)\b",  # stack or spill traffic: per iteration when inside a loop
}


@lru_cache(maxsize=1)
def cuobjdump() -> str | None:
    """Path of Triton's cuobjdump, or None when this Triton has none (then nothing here is measured)."""
    try:
        import triton

        return triton.knobs.nvidia.cuobjdump.path
    except Exception:  # older Triton without knobs, or a build without the NVIDIA tools
        return None


def _run(*args: str | os.PathLike, tool: str | None = None) -> str:
    """Run `tool` (default cuobjdump) with `args`; its stdout, or a RuntimeError with its stderr's end."""
    tool = tool or cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found: this Triton installation ships no NVIDIA tools")
    proc = subprocess.run([tool, *map(str, args)], check=False, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        name = Path(tool).name
        raise RuntimeError(f"{name} {' '.join(map(str, args))[:300]} failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


@lru_cache(maxsize=1)
def nvdisasm() -> str | None:
    """Path of Triton's nvdisasm, or None (then each cubin is read by `cuobjdump -sass` alone)."""
    try:
        import triton

        path = triton.knobs.nvidia.nvdisasm.path
    except Exception:  # older Triton without knobs, or a build without the NVIDIA tools
        return None
    return path if path and os.path.isfile(path) else None


def resource_usage(cubin: str | os.PathLike) -> dict[str, int]:
    """Registers per thread, stack, static shared and local (spill) bytes of the kernel in `cubin`.

    Example:
        >>> resource_usage("decode.cubin")   # doctest: +SKIP
        {'registers': 169, 'stack_bytes': 0, 'static_shared_bytes': 1024, 'spill_bytes': 0}
    """
    match = _RESOURCES.search(_run("-res-usage", cubin))
    if match is None:
        raise RuntimeError(f"{cubin}: cuobjdump -res-usage printed no resource line")
    regs, stack, shared, local = map(int, match.groups())
    return {"registers": regs, "stack_bytes": stack, "static_shared_bytes": shared, "spill_bytes": local}


def disassemble(cubin: str | os.PathLike) -> str | None:
    """The SASS text of `cubin`, read once for every count below; None without cuobjdump.

    Example:
        >>> "Function : decode_kernel" in disassemble("decode_m1.cubin")   # doctest: +SKIP
        True
    """
    return disassemble_many([cubin])[0]


def disassemble_many(cubins: Sequence[str | os.PathLike]) -> list[str | None]:
    """The SASS text of each cubin file: one nvdisasm call for all those of one architecture.

    Disassembling takes ~0.5 s a call whatever the size, nearly all of it the tool's start-up: one call for
    all the kernels of a generation (257 of them: 5 s instead of 145 s). Each text is kept in
    `sass_cache_dir()`, by the cubin's and the tools' hashes, so the same kernels generated again (with
    Triton's cache or without: the cubins are the same bytes) read it back. Without nvdisasm, or when it
    cannot read a batch, each cubin is read by `cuobjdump -sass` alone. None for each without cuobjdump.

    Example:
        >>> decode, prefill = disassemble_many(["decode_m1.cubin", "prefill.cubin"])   # doctest: +SKIP
    """
    tool = cuobjdump()
    if tool is None:
        return [None] * len(cubins)
    folder = sass_cache_dir()
    blobs = [Path(c).read_bytes() for c in cubins]
    keys = [_sass_key(blob) for blob in blobs]
    known = {key: _read_cached(folder, key) for key in keys}
    todo = {key: (path, blob) for key, path, blob in zip(keys, cubins, blobs) if known[key] is None}  # each once
    for key, sass in zip(todo, _disassemble_files(*zip(*todo.values()))):
        known[key] = sass
        if folder is not None:
            try:
                write_bytes_atomic(folder / f"{key}.sass", sass.encode())
            except OSError:  # a read-only cache folder: the text is still right, only not kept
                pass
    return [known[key] for key in keys]


def _read_cached(folder: Path | None, key: str) -> str | None:
    cached = None if folder is None else folder / f"{key}.sass"
    return cached.read_text() if cached is not None and cached.is_file() else None


def _disassemble_files(paths: Sequence[str | os.PathLike] = (), blobs: Sequence[bytes] = ()) -> list[str]:
    """SASS of each cubin (its file and its bytes): one nvdisasm call per architecture, `cuobjdump -sass` each
    where that fails."""
    if len(paths) < 2 or nvdisasm() is None:
        return [_run("-sass", path) for path in paths]
    by_arch: dict[str, list[int]] = {}
    for i, path in enumerate(paths):
        by_arch.setdefault(_arch(path), []).append(i)
    out: list[str | None] = [None] * len(paths)
    for arch, members in by_arch.items():
        if len(members) > 1:
            try:
                texts = _disassemble_together([blobs[i] for i in members], arch)
            except (RuntimeError, ValueError, struct.error):  # raw mode cannot read one: each alone below
                texts = [None] * len(members)
            for i, text in zip(members, texts):
                out[i] = text
    return [text if text is not None else _run("-sass", path) for text, path in zip(out, paths)]


def _arch(cubin: str | os.PathLike) -> str:
    """The cubin's architecture as cuobjdump names it ("80", "90a"): the header line of `cuobjdump -elf`."""
    match = re.search(r"\bsm\s*=\s*(\w+)", _run("-elf", cubin)[:2000])
    if match is None:
        raise RuntimeError(f"{cubin}: cuobjdump -elf names no architecture")
    return match.group(1)


def _disassemble_together(cubins: Sequence[bytes], arch: str) -> list[str]:
    """The code sections of same-architecture cubins one after another, disassembled raw in one nvdisasm
    call, then cut back into one text each, addresses counted from each function's start as cuobjdump does."""
    functions = [(i, name, code) for i, cubin in enumerate(cubins) for name, code in _code_sections(cubin)]
    blob, starts = b"", []
    for _, _, code in functions:
        starts.append(len(blob))
        blob += code
    with tempfile.TemporaryDirectory(prefix="patchc-sass-") as tmp:
        path = Path(tmp) / "code.bin"
        path.write_bytes(blob)
        raw = _run("-b", f"SM{arch}", path, tool=nvdisasm())
    lines = [(int(addr, 16), text) for addr, text in _LINE.findall(raw)]
    texts = [[f"\n\tcode for sm_{arch}"] for _ in cubins]
    for (i, name, code), start in zip(functions, starts):
        body = [_rebased(addr - start, text, start, len(code)) for addr, text in lines
                if start <= addr < start + len(code)]
        if len(body) * 16 != len(code):  # every 16-byte instruction read, or the cut is not to be trusted
            raise ValueError(f"nvdisasm read {len(body)} instructions of {name}'s {len(code) // 16}")
        texts[i] += [f"\t\tFunction : {name}", *body]
    return ["\n".join(text) + "\n" for text in texts]


def _rebased(addr: int, text: str, start: int, size: int) -> str:
    """One instruction line as cuobjdump prints it, its code-address operands counted from `start`."""
    if _CODE_ADDRESS.match(text):
        text = _HEX.sub(lambda m: hex(v - start) if start <= (v := int(m.group(1), 16)) <= start + size
                        else m.group(0), text)
    return f"        /*{addr:04x}*/                   {text} ;"


def _code_sections(cubin: bytes) -> list[tuple[str, bytes]]:
    """(function name, machine code) of each `.text.<name>` section of a 64-bit little-endian ELF cubin."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_at = headers[names_index][4]

    def name(offset: int) -> str:
        start = names_at + offset
        return cubin[start:cubin.index(b"\0", start)].decode()

    return [(name(h[0])[len(".text."):], cubin[h[4]:h[4] + h[5]]) for h in headers
            if name(h[0]).startswith(".text.")]


def sass_cache_dir() -> Path | None:
    """Where `disassemble` keeps SASS: PATCHC_SASS_CACHE, else `patchc-sass/` in Triton's cache folder; None
    when caching is off (PATCHC_SASS_CACHE=0) or this Triton names no cache folder."""
    folder = os.environ.get("PATCHC_SASS_CACHE", "").strip()
    if folder == "0":
        return None
    if folder:
        return Path(folder)
    try:
        import triton

        return Path(triton.knobs.cache.dir) / "patchc-sass"
    except Exception:  # an older Triton without knobs
        return None


def _sass_key(cubin: bytes) -> str:
    """The cache key of `cubin`'s SASS: its bytes and the tools' paths, sizes and mtimes."""
    tools = []
    for tool in (cuobjdump(), nvdisasm()):
        stat = None if tool is None else os.stat(tool)
        tools.append("-" if stat is None else f"{os.path.realpath(tool)}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256(cubin + f"{_FORMAT}|{'|'.join(tools)}".encode()).hexdigest()


def instruction_mix(sass: str) -> dict[str, int]:
    """Static counts of the SASS opcodes in `INSTRUCTIONS` (in the code, not executed counts).

    Example:
        >>> instruction_mix(disassemble("prefill.cubin"))["hgmma"] > 0   # doctest: +SKIP
        True
    """
    return {name: len(re.findall(pattern, sass)) for name, pattern in INSTRUCTIONS.items()}


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction in `cuobjdump -sass` output, in address order."""
    return [(int(addr, 16), text) for addr, text in _LINE.findall(sass)]


def loops(sass: str) -> list[dict[str, int]]:
    """The loops of a kernel, outermost first within address order: every backward branch closes one.

    Each loop is {"start", "end" (byte addresses), "instructions" in its body (label to backward branch,
    both included), and the `LOOP_COUNTS` of its body}. A kernel's main loops are its top-level ones; in
    patchc's kernels the dense-block loop comes before the 2:4-block loop.

    Example:
        >>> [lp["instructions"] for lp in loops(open("decode_m1.sass").read())]   # doctest: +SKIP
        [135, 346]
    """
    code = sass_instructions(sass)
    found = []
    for addr, text in code:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:  # backward: a loop (a branch to itself is the end-of-code trap)
            start = int(m.group(1), 16)
            body = [t for a, t in code if start <= a <= addr]
            found.append({"start": start, "end": addr, "instructions": len(body),
                          **{k: sum(bool(re.search(p, t)) for t in body) for k, p in LOOP_COUNTS.items()}})
    return [lp for lp in found  # drop loops nested inside another one: the outer body already counts them
            if not any(o is not lp and o["start"] <= lp["start"] and lp["end"] <= o["end"] for o in found)]


def loop_cost(loop: dict[str, int], num_warps: int, weight_bytes: int) -> float:
    """Warp-instructions issued per weight byte by one iteration of `loop` that streams `weight_bytes`.

    An H100 issues ~0.93e12 warp-instructions/s against 3.35e12 B/s of HBM: above ~0.28 a loop cannot reach
    the memory roofline even at perfect issue.

    Example:
        >>> loop_cost({"instructions": 135}, num_warps=8, weight_bytes=128 * 64 * 2)
        0.06591796875
    """
    return loop["instructions"] * num_warps / weight_bytes


def weight_loops(sass: str | None, has_dense: bool, has_sparse: bool, block: tuple[int, int],
                 elem_bytes: int, num_warps: int, block_m: int | None = None) -> list[dict] | None:
    """The cost of a hybrid kernel's two weight loops: [{"loop": "dense" | "2:4", ..., "warp_instr_per_byte"}].

    patchc's kernels walk a block row's dense blocks, then its 2:4 blocks; an iteration reads one block:
    BLOCK_N * BLOCK_K elements dense, half of them plus 1/8 byte per element of metadata 2:4. `sass` is
    `disassemble(cubin)`. [] when the code has no loop at all: a program reads a fixed tile or two
    (a small layer cut by split-K) and the compiler unrolled them. None without SASS (no cuobjdump) or
    when the code does not have exactly the expected loops (then nothing is claimed). With `block_m` (prefill,
    bound by compute) each loop also gets "warp_instr_per_kflop", to hold against `MMA_ISSUE_BUDGET`.

    Example:
        >>> [(lp["loop"], round(lp["warp_instr_per_byte"], 3)) for lp in weight_loops(
        ...     disassemble("decode_m1.cubin"), True, True, (128, 64), 2, 8)]  # doctest: +SKIP
        [('dense', 0.052), ('2:4', 0.139)]
    """
    if sass is None:
        return None
    bn, bk = block
    kinds = [("dense", bn * bk * elem_bytes)] * has_dense + [("2:4", bn * bk // 2 * elem_bytes + bn * bk // 8)] * has_sparse
    found = [lp for lp in loops(sass) if not lp["ldg_past_l1"]]  # the fixup's loop over splits is no weight loop
    if len(found) != len(kinds):
        return None if found else []
    out = []
    for (kind, nbytes), lp in zip(kinds, found):
        row = {"loop": kind, "weight_bytes": nbytes, **lp,
               "warp_instr_per_byte": round(loop_cost(lp, num_warps, nbytes), 4)}
        if block_m:  # one iteration multiplies BLOCK_M x BLOCK_K tokens by the BLOCK_N x BLOCK_K block
            row["warp_instr_per_kflop"] = round(lp["instructions"] * num_warps * 1e3 / (2 * block_m * bn * bk), 4)
        out.append(row)
    return out


# Warp-instructions an SM issues (4 a cycle) per 1,000 FLOPs of its tensor cores at dense fp16 peak (a prefill
# loop near it is bound by issue): H100 / H200 do 4,096 FLOP a cycle (989 TFLOPS, 132 SMs, 1.83 GHz), A100 2,048.
MMA_ISSUE_BUDGET = {"sm_80": 4e3 / 2048, "sm_90": 4e3 / 4096}


# The decode-kernel issue's static targets, for every decode variant that serves M <= 16: warp-instructions per
# weight byte of each weight loop, barriers per iteration where the variant serves M <= 4, no spills, no local
# memory in a loop, 128-bit weight loads. Above ~0.28 w-instr/B an H100 cannot be memory bound: room for the rest.
LOOP_TARGETS = {"dense": 0.08, "2:4": 0.14}
ISSUE_CEILING = 0.93e12 / 3.35e12  # H100 warp-instructions per HBM byte: a loop above it cannot be memory bound
TARGET_M = 16  # variants serving M up to this are held to LOOP_TARGETS
SMALL_M_BARRIERS = (4, 2)  # variants serving M <= 4: at most 2 barriers per loop iteration
# The smallest square tile whose decode loops meet LOOP_TARGETS (4096-wide fp16 / bf16 layers, sm_80 and
# sm_90): a loop iteration moves one tile, and a 32 x 32 2:4 tile's 1,152 bytes cannot pay for its loop
# (0.29 warp-instructions per byte), nor can 16 x 16 ones (0.76). `benchmarks/static_profile.py --tile`.
SMALLEST_FAST_TILE = 64


def target_misses(m_min: int, loops: list[dict] | None, profile: dict | None) -> list[str]:
    """The static targets a decode variant serving M >= `m_min` misses ([] = all hold; `loops` as
    `weight_loops` returns them, `profile` as `static_profile`). Variants from M > 16 on have none, nor has
    unrolled code (`loops == []`); a stack slot misses only inside a weight loop (ptxas may park one across them).

    Example:
        >>> target_misses(1, [{"loop": "2:4", "warp_instr_per_byte": 0.2, "barriers": 2, "ldg128": 2}],
        ...               {"spill_bytes": 0})
        ['2:4 loop 0.200 w-instr/B > 0.14']
    """
    if m_min > TARGET_M or loops == []:
        return []
    if profile is None:
        return ["no SASS profile (this Triton ships no cuobjdump)"]
    if loops is None:
        return ["the SASS does not have the dense / 2:4 loops expected: its cost is unknown"]
    misses = []
    for lp in loops:
        kind = lp["loop"]
        if lp["warp_instr_per_byte"] > LOOP_TARGETS[kind]:
            misses.append(f"{kind} loop {lp['warp_instr_per_byte']:.3f} w-instr/B > {LOOP_TARGETS[kind]}")
        if m_min <= SMALL_M_BARRIERS[0] and lp["barriers"] > SMALL_M_BARRIERS[1]:
            misses.append(f"{kind} loop {lp['barriers']} barriers per iteration > {SMALL_M_BARRIERS[1]}")
        if lp["ldg128"] < 1:
            misses.append(f"{kind} loop has no 128-bit weight load")
        if lp.get("local", 0):
            misses.append(f"{kind} loop touches local memory ({lp['local']} LDL / STL per iteration)")
    return misses + [f"spills {profile['spill_bytes']} B"] * bool(profile.get("spill_bytes", 0))


def static_profile(cubin: str | os.PathLike, sass: str | None = None) -> dict[str, int] | None:
    """`resource_usage` and `instruction_mix` together (`sass`: the cubin's, when already disassembled);
    None when no cuobjdump is available."""
    if cuobjdump() is None:
        return None
    return resource_usage(cubin) | instruction_mix(sass if sass is not None else disassemble(cubin))


__all__ = ["INSTRUCTIONS", "LOOP_COUNTS", "LOOP_TARGETS", "MMA_ISSUE_BUDGET", "SMALLEST_FAST_TILE", "TARGET_M",
           "cuobjdump", "disassemble", "disassemble_many", "instruction_mix", "loop_cost", "loops", "nvdisasm",
           "resource_usage", "sass_cache_dir", "sass_instructions", "static_profile", "target_misses", "weight_loops"]
