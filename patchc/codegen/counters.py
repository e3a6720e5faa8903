"""The int32 counters that split-K's in-kernel reduction (`kernels.fixup`) keeps, one per output tile.

A launch needs its tiles' counters at 0, and its last split of each tile sets the counter back to 0, so one
buffer per device serves every launch that starts after the previous one finished, as Marlin's lock
workspace does in vLLM. Two launches that overlap (patchc layers run on two CUDA streams at once) would
share counters: run those with `KernelConfig(reduce="launch")`.

The buffer must not come from a CUDA graph's memory pool, which may hand its memory to other tensors once
the graph no longer knows of it: cudagraph trees (`torch.compile(mode="reduce-overhead")`) route even their
eager warm-up runs' allocations to their pool, and restore the pool to a checkpoint when they switch
paths. torch routes a pool's allocations by thread, so the buffer is allocated on a thread of its own
(zeroed and synchronised there: it happens once per size), and never under capture:
there a launch needing more counters than exist raises and asks for the warm-up that captures need
anyway. A buffer is only replaced by a larger one, and the old one is kept alive: a captured graph, or a
kernel still queued, may point at it.

Example:
    >>> count = counters(torch.device("cuda"), tiles=32 * 4)   # doctest: +SKIP
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

MIN_COUNTERS = 8192  # 32 KiB: a 128,256-row LM head in 64-row blocks at 4 token tiles fits

_BUFFERS: dict[str, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def counters(device: torch.device, tiles: int, capturing: bool = False, where: str = "a layer") -> torch.Tensor:
    """At least `tiles` int32 zeros on `device`, shared by its launches (module doc); `capturing`: the
    current stream is capturing a CUDA graph, so nothing may be allocated."""
    buf = _BUFFERS.get(str(device))
    if buf is not None and buf.numel() >= tiles:
        return buf
    if capturing:
        raise RuntimeError(
            f"{where}: split-K needs {tiles} tile counters on {device} and the current CUDA stream is capturing a "
            f"graph; run the model once with the same M outside capture (warm-up) before capturing")
    if buf is not None:
        _OUTGROWN.append(buf)
    size = max(MIN_COUNTERS, tiles, 2 * (buf.numel() if buf is not None else 0))
    buf = _BUFFERS[str(device)] = _zeros_outside_pools(size, torch.device(device))
    return buf


def _zeros_outside_pools(size: int, device: torch.device) -> torch.Tensor:
    """int32 zeros from the caching allocator's own pool, whatever pool this thread's allocations go to."""

    def allocate() -> torch.Tensor:
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeroed before any stream's launch reads it
        return buf

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(allocate).result()
