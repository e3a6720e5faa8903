"""What a result was measured on: library versions and the device, for reports, benchmarks and cache keys.

Example:
    >>> versions()["torch"] == torch.__version__
    True
    >>> device_name("cpu")  # doctest: +SKIP
    'cpu (x86_64, 1 threads)'
"""

from __future__ import annotations

import platform

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
    """The GPU's name for a CUDA device, else the CPU with the thread count torch uses.

    Example:
        >>> device_name("cuda:0")  # doctest: +SKIP
        'NVIDIA H100 80GB HBM3'
    """
    device = str(device)
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


__all__ = ["device_name", "versions"]
