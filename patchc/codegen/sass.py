"""What a compiled kernel costs, read from its cubin without a GPU: registers, spills, instruction mix.

Uses the `cuobjdump` that Triton ships with its NVIDIA backend (`-res-usage` for the resource line,
`-sass` for the machine code). The numbers are what a profiler would show first when a kernel is slow:
registers per thread (occupancy), local-memory bytes (spills), and whether the weight loads are 128-bit
(`LDG.E.128`), pipelined into shared memory (`LDGSTS`, i.e. cp.async) and fed to tensor cores
(`HMMA` on sm_80, `HGMMA`, i.e. wgmma, on sm_90).

Example:
    >>> usage = resource_usage("kernels/sm_90/layer/prefill.cubin")   # doctest: +SKIP
    >>> usage["registers"], usage["spill_bytes"]                      # doctest: +SKIP
    (201, 0)
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache

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


@lru_cache(maxsize=1)
def cuobjdump() -> str | None:
    """Path of Triton's cuobjdump, or None when this Triton has none (then nothing here is measured)."""
    try:
        import triton

        return triton.knobs.nvidia.cuobjdump.path
    except Exception:  # older Triton without knobs, or a build without the NVIDIA tools
        return None


def _run(*args: str | os.PathLike) -> str:
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found: this Triton installation ships no NVIDIA tools")
    proc = subprocess.run([tool, *map(str, args)], check=False, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump {' '.join(map(str, args))} failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


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


def instruction_mix(cubin: str | os.PathLike) -> dict[str, int]:
    """Static counts of the SASS opcodes in `INSTRUCTIONS` (in the code, not executed counts).

    Example:
        >>> instruction_mix("prefill.cubin")["hgmma"] > 0   # doctest: +SKIP
        True
    """
    sass = _run("-sass", cubin)
    return {name: len(re.findall(pattern, sass)) for name, pattern in INSTRUCTIONS.items()}


def static_profile(cubin: str | os.PathLike) -> dict[str, int] | None:
    """`resource_usage` and `instruction_mix` together; None when no cuobjdump is available."""
    if cuobjdump() is None:
        return None
    return resource_usage(cubin) | instruction_mix(cubin)


__all__ = ["INSTRUCTIONS", "cuobjdump", "instruction_mix", "resource_usage", "static_profile"]
