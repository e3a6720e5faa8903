"""Stage 5, runtime: the `patchc::tile_linear` custom op, the autotuner, dispatch and the entry points.

It takes a `TilePlan` (and codegen's packed layers and launcher) and swaps a model's linears for
`TileLinear` modules that pick a tuned kernel config by M; this is what users run.

    fast = patchc.runtime.compile(model, plan, batch_size=16, prefill_len=128)   # also patchc.compile
    cm = torch.compile(model, backend="patch", options={"plan": plan})           # entry-point backend
    tunings = patchc.runtime.tune_plan(plan, batch_size=16, prefill_len=128)     # `patchc tune`

Modules: `op` (custom op + fake implementation), `candidates` (the candidate configs per GPU generation),
`timing` (timing a layer's configs), `tuner` (decode, prefill and per-M-bucket tuning), `cache` (on-disk
JSON cache), `dispatch` (TileLinear; `warmup` before CUDA-graph capture), `experts` (TileExperts: fused MoE
experts; `flat_experts`: DBRX's, held flat), `compile` (patchc.compile),
`backend` (the dynamo backend `patch_backend`; `bound_backend`: `patchc.backend(plan)`, its options
bound), `matmul_reads` (the matmul forms the backend recognises on a weight: linear, x @ W.T, matmul / mm,
Conv1D addmm, einsum), `grouped` (fused MoE experts under the
backend: the grouped mm it recognises), `grouped_op` (`patchc::tile_grouped_mm` and `TileGroupedLinear`:
every expert of a 3-D weight in one launch), `packs` (the backend's packed modules, shared by all the graphs
dynamo compiles for one model), `graph_names` (a graph's weights named as the plan names them, also in graphs
that start inside a submodule), `weight_graphs` (a graph per set of weights, for graphs dynamo reuses for
sibling submodules), `coverage` (`unserved(plan)` / `unserved(model)`: the planned layers, or a model's 2:4
weights, no backend graph has served), `saving` (`save_pretrained` of a compiled model: the pruned model as
transformers saves it).
"""

from __future__ import annotations

from patchc.runtime import op  # noqa: F401  (registers torch.ops.patchc.tile_linear)
from patchc.runtime.cache import TuneCache, default_cache_path
from patchc.runtime.candidates import candidate_space, candidates
from patchc.runtime.compile import compile  # noqa: A004
from patchc.runtime.coverage import unserved
from patchc.runtime.dispatch import TileLinear, warmup
from patchc.runtime.grouped_op import TileGroupedLinear
from patchc.runtime.tuner import LayerTuning, TuneError, tune_plan

__all__ = [
    "compile",
    "TileLinear",
    "TileGroupedLinear",
    "warmup",
    "tune_plan",
    "LayerTuning",
    "TuneError",
    "TuneCache",
    "default_cache_path",
    "candidate_space",
    "candidates",
    "patch_backend",
    "unserved",
]


def __getattr__(name: str):
    if name == "patch_backend":  # imported on use: it pulls in torch._dynamo
        from patchc.runtime.backend import patch_backend

        return patch_backend
    raise AttributeError(f"module 'patchc.runtime' has no attribute {name!r}")
