"""Bench (beside the job): the GPU proof (`patchc bench`, `make gpu`): correctness and speed of everything below.

It takes random plans of real layer shapes through codegen (`tile_linear`) and the runtime
(`TileLinear`, `patchc.compile`) and measures them against cuBLAS, cuSPARSELt and an fp64 reference on
the GPU it runs on; `--dry-run` runs the same code on CPU under the Triton interpreter with tiny shapes.

    record = patchc.bench.run(patchc.bench.BenchOptions())          # a CUDA GPU; ~8.5 minutes
    record = patchc.bench.run(patchc.bench.BenchOptions(dry_run=True, out_dir="runs/bench"))

Modules: `options` (what runs), `layers` (random layers, timers, roofline), `check`, `speed`, `llama` +
`e2e` (the end-to-end model), `record` (JSONL history, markdown), `driver` (`run`: the parts in order,
within the time budget).
"""

from __future__ import annotations

from patchc.utils.lazy import lazy_exports, names_of

# Imported on first use: the command line reads options.py (PARTS) without importing torch and Triton.
_LAZY = {**names_of("patchc.bench.options", "BenchOptions"),
         **names_of("patchc.bench.driver", "BenchError", "run", "exit_status")}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = list(_LAZY)
