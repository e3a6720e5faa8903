"""Bench (beside the job): the GPU proof (`patchc bench`, `make gpu`): correctness and speed of everything below.

It takes random plans of real layer shapes through codegen (`tile_linear`) and the runtime
(`TileLinear`, `patchc.compile`) and measures them against cuBLAS, cuSPARSELt and an fp64 reference on
the GPU it runs on; `--dry-run` runs the same code on CPU under the Triton interpreter with tiny shapes.

    record = patchc.bench.run(patchc.bench.BenchOptions())          # a CUDA GPU; ~8.5 minutes
    record = patchc.bench.run(patchc.bench.BenchOptions(dry_run=True, out_dir="runs/bench"))

Modules: `options` (what runs), `layers` (random layers, timers, roofline), `check`, `speed`, `llama` +
`e2e` (the end-to-end model), `record` (JSONL history, markdown), `run` (the driver).
"""

from __future__ import annotations

from patchc.bench.options import BenchOptions
from patchc.bench.run import BenchError, exit_status, run

__all__ = ["BenchOptions", "BenchError", "run", "exit_status"]
