"""What a result was measured on: library versions and the device, for reports, benchmarks and cache keys.

Example:
    >>> versions()["torch"] == torch.__version__
    True
    >>> device_name("cpu")  # doctest: +SKIP
    'cpu (AMD EPYC, AVX512, 2 threads)'
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def versions() -> dict[str, str]:
    """{"patchc", "torch", "triton", "python"} versions; triton is "none" where it cannot be imported.

    Example:
        >>> sorted(versions())
        ['patchc', 'python', 'torch', 'triton']
    """
    import patchc  # here, not at the top: patchc's own __init__ imports modules that use this one

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - missing (CPU-only, non-Linux) or broken: still a valid, distinct value
        triton_version = "none"
    return {"patchc": patchc.__version__, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version()}


def device_name(device: str | torch.device) -> str:
    """The GPU's name for a CUDA device, else the CPU's model, the vector ISA torch's kernels use and
    torch's thread count (float results move with the ISA: AVX2 and AVX-512 kernels sum in other orders).

    Example:
        >>> device_name("cuda:0")  # doctest: +SKIP
        'NVIDIA H100 80GB HBM3'
    """
    device = str(device)
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    threads = torch.get_num_threads()
    return f"cpu ({cpu_model()}, {torch.backends.cpu.get_cpu_capability()}, {threads} thread{'s' * (threads != 1)})"


def proc_bytes(path: str | Path, field: str) -> int | None:
    """Bytes of a ``Field:  N kB`` line of a Linux /proc file (meminfo, a status); None when the file cannot
    be read or has no such field.

    Example:
        >>> proc_bytes("/proc/meminfo", "MemAvailable") > 0  # doctest: +SKIP
        True
    """
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows (e.g. "arm64")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


__all__ = ["cpu_model", "device_name", "versions"]
