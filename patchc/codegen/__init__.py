"""Stage 4, codegen: Triton kernels for hybrid dense / 2:4 layers: packed layout, kernels, launchers, offline builds.

It takes `TilePlan` layers from the IR (`patchc.ir`), packs them into the kernels' block layout and hands
the launcher (and offline cubins) to the runtime (`patchc.runtime`).

    packed = patchc.codegen.pack(plan, "layers.0.feed_forward.w1.weight", block=(64, 64))
    y = patchc.codegen.tile_linear(x, packed)                       # x (M, K) -> (M, N)
    files = patchc.codegen.generate(plan, "out/", target="sm_90")  # Triton source + PTX + cubin + manifest

Modules: `layout` (pack, PackedLayer), `kernels` (@triton.jit), `launch` (tile_linear, launch_grouped),
`specialise` (a launch's arguments, constexprs and grid, shared with `generate`), `counters` (the split-K
tile counters the kernels' in-kernel reduction keeps), `grouped_layout` / `grouped_kernels` (fused MoE
experts stacked into one layout, one launch), `unpack_kernel`
(W * M unpacked on the device, for cuBLAS at prefill sizes: `launch.unpack`), `configs`
(KernelConfig, per-architecture tables), `generate` (offline compile; `summary`, what it prints), `offline`
(what an offline cubin assumes: check_launch), `sass` (static profile of a cubin), `reference` (plain PyTorch),
`interpreter`
(Triton's interpreter, which runs the kernels on a CPU, without its per-helper-call overhead).
"""

from __future__ import annotations

from patchc.codegen.configs import ARCH_TABLE, KernelConfig
from patchc.codegen.generate import generate
from patchc.codegen.launch import tile_linear
from patchc.codegen.layout import PackedLayer, PackError, pack, packed_to_dense
from patchc.codegen.offline import check_launch
from patchc.codegen.reference import reference_tile_linear

__all__ = [
    "pack",
    "tile_linear",
    "generate",
    "check_launch",
    "PackedLayer",
    "PackError",
    "KernelConfig",
    "ARCH_TABLE",
    "packed_to_dense",
    "reference_tile_linear",
]
