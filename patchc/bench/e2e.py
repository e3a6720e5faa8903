"""End-to-end part of `patchc bench`: a LLaMA-shaped model decoding through `patchc.compile` vs dense.

One random plan per linear shape (tiles 128 x 128, 2:4 tiles placed at random for the sparsity) covers
every block; `patchc.compile` swaps the block linears for `TileLinear`s, on the default configs first and
then (with tuning, on a GPU) tuned: one tuning for batch 16 serves batch 1 through its M buckets. Both
models prefill a prompt, then generate `tokens` tokens, one decode step per CUDA-graph replay (on CPU:
plain calls); and each prefills a 2048-token prompt alone (M = 2048, the layer speed part's prefill size),
where the tuned layers take the route they timed fastest there (the hybrid kernel or cuBLAS on the weight
unpacked). Correctness first: the compiled model's logits
are compared with an independent dense copy that holds the same pruned weights (`plan.apply`), run by
cuBLAS, never with the object that was patched.

Example:
    >>> rows = run_e2e(BenchOptions(dry_run=True, parts=("e2e",)), "cpu", Deadline(60))  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import torch

from patchc.bench.layers import Deadline, make_layer
from patchc.bench.llama import Llama, LlamaShape
from patchc.bench.options import BenchOptions, LayerCase

PROMPT = 16
LONG_PROMPT = 2048  # one prompt's prefill, M = 2048 tokens in each layer (the dry run: 64)
SPARSITIES = (0.45, 0.35)


def make_plan(model: Llama, sparsity: float, tile: tuple[int, int], seed: int) -> Any:
    """A TilePlan over every block linear: one random LayerPlan per shape, shared by same-shaped layers.

    Weights get std 1/sqrt(K) (as nn.Linear's init): activations stay O(1) through the blocks in fp16."""
    from patchc.ir import TilePlan

    by_shape: dict[tuple[int, int], Any] = {}
    layers = {}
    for fqn, shape in model.linear_names().items():
        if shape not in by_shape:  # the speed part's seed: same tile kinds, so its tunings are cache hits
            layer = make_layer(LayerCase(shape, sparsity, tile, "fp32", ()), seed)
            scale = shape[1] ** -0.5
            by_shape[shape] = dataclasses.replace(layer, dense=layer.dense * scale, values=layer.values * scale)
        layers[fqn] = dataclasses.replace(by_shape[shape], name=fqn)
    return TilePlan(layers=layers, skipped={}, meta={})


@torch.no_grad()
def decode_speed(model: Llama, batch: int, tokens: int, graphed: bool, warmup: bool = True) -> dict[str, float]:
    """Prefill PROMPT tokens, then `tokens` greedy decode steps; tokens/s of the decode steps. `warmup`: a
    first prefill compiles the kernels (the interpreter of a dry run has nothing to compile)."""
    dev = model.embed.weight.device
    model.reset_cache(batch, PROMPT + tokens)
    prompt = torch.randint(0, model.s.vocab, (batch, PROMPT), device=dev)
    tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    if warmup:  # compiles every prefill kernel
        model(prompt, torch.arange(PROMPT, device=dev))
    step = _graphed_step(model, tok, pos) if graphed else (lambda: model(tok, pos))
    t0 = time.perf_counter()
    first = model(prompt, torch.arange(PROMPT, device=dev))
    tok.copy_(first.argmax(-1))
    _sync(dev)
    t1 = time.perf_counter()
    for i in range(tokens):
        pos.fill_(PROMPT + i)
        logits = step()
        tok.copy_(logits.argmax(-1))
    _sync(dev)
    t2 = time.perf_counter()
    return {"prefill_ms": (t1 - t0) * 1e3, "decode_ms": (t2 - t1) * 1e3, "decode_tok_s": batch * tokens / (t2 - t1)}


@torch.no_grad()
def prefill_ms(model: Llama, length: int, reps: int = 3, warmup: bool = True) -> float:
    """ms of one forward over a `length`-token prompt at batch 1 (the best of `reps`, after a warm-up forward
    that compiles its kernels); the cache is sized to the prompt."""
    dev = model.embed.weight.device
    model.reset_cache(1, length)
    ids = torch.randint(0, model.s.vocab, (1, length), generator=torch.Generator().manual_seed(2)).to(dev)
    pos = torch.arange(length, device=dev)
    if warmup:
        model(ids, pos)
    best = float("inf")
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        model(ids, pos)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _graphed_step(model: Llama, tok: torch.Tensor, pos: torch.Tensor) -> Any:
    """One decode step captured in a CUDA graph after warm-up steps on a side stream (kernels compiled)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(tok, pos)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(tok, pos)

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def logits_error(fast: Llama, dense: Llama, vocab: int, device: Any) -> dict[str, float]:
    """Max |logit difference| of the compiled model and the dense copy on one prompt, and the logit scale."""
    ids = torch.randint(0, vocab, (2, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    pos = torch.arange(PROMPT, device=device)
    for m in (fast, dense):
        m.reset_cache(2, PROMPT)
    a, b = fast(ids, pos).float(), dense(ids, pos).float()
    err, scale = float((a - b).abs().max()), float(b.abs().max())
    rel = 2e-2 if dtype_of(dense) != torch.float32 else 1e-4  # fp16 layers round outputs 4 blocks deep
    return {"logits_max_err": err, "logits_max": scale, "logits_ok": err <= rel * scale + 1e-3}


def dtype_of(model: Llama) -> torch.dtype:
    return model.embed.weight.dtype


def runs(opts: BenchOptions, cuda: bool) -> list[tuple[bool, float]]:
    """(tuned, sparsity) in the order they run: every sparsity on the default configs first, then tuned (GPU
    with `opts.tune`), so a run cut short (tuning takes minutes) still has its numbers; the dry run: one.

    Example:
        >>> runs(BenchOptions(), cuda=True)
        [(False, 0.45), (False, 0.35), (True, 0.45), (True, 0.35)]
    """
    sparsities = SPARSITIES[: 1 if opts.dry_run else None]
    return [(tuned, s) for tuned in ((False, True) if opts.tune and cuda else (False,)) for s in sparsities]


def run_e2e(opts: BenchOptions, device: str, deadline: Deadline, progress: bool = True) -> dict[str, Any]:
    """Dense and compiled decode throughput per sparsity and batch; {"rows", "skipped"}."""
    import patchc
    from patchc.runtime import tune_plan
    from patchc.runtime.dispatch import TileLinear
    from patchc.runtime.timing import compile_ahead

    cuda = device.startswith("cuda")
    shape = LlamaShape.llama2_7b(opts.e2e_layers) if not opts.dry_run else LlamaShape.tiny()
    dtype = torch.float16 if cuda else torch.float32
    tile = (128, 128) if not opts.dry_run else (32, 32)
    tokens = opts.e2e_tokens if not opts.dry_run else 3
    long_prompt = LONG_PROMPT if not opts.dry_run else 64
    # the interpreter compiles nothing and its timings mean nothing: each forward once (a third of the part)
    timing = dict(warmup=False) if opts.dry_run else {}
    reps = 1 if opts.dry_run else 3
    torch.manual_seed(opts.seed)
    base = Llama(shape, 1, PROMPT).to(device=device, dtype=dtype).eval()
    rows, skipped = [], []
    dense_speed = {b: decode_speed(base, b, tokens, cuda, **timing) for b in opts.e2e_batches}
    dense_prefill = prefill_ms(base, long_prompt, reps=reps, **timing)
    for tuned, sparsity in runs(opts, cuda):
        if deadline.over():
            skipped.append(f"{sparsity:.0%}{' (tuned)' if tuned else ''}")
            continue
        plan = make_plan(base, sparsity, tile, opts.seed)
        # tuned for batch 16 and a 128-token prefill like the speed part (cache hits); the decode buckets
        # serve batch 1 and the 16-token prompt
        # the plan's random weights are the pruned model (force: they were not made from base's weights)
        if tuned:  # into the tuning cache, until the part's deadline (what it had no time for runs on defaults)
            tune_plan(plan, max(opts.e2e_batches), 128, dtype, device, progress=progress,
                      time_limit=max(0.0, deadline.left()))
        fast = patchc.compile(base, plan, batch_size=max(opts.e2e_batches), prefill_len=128,
                              tune="cached" if tuned else False, progress=progress, force=True)
        mods = [m for m in fast.modules() if isinstance(m, TileLinear)]
        # every kernel the prompts, decode steps and the logits check will launch, compiled in parallel
        compile_ahead(mods, sorted({b * n for b in opts.e2e_batches for n in (1, PROMPT)} | {2 * PROMPT, long_prompt}))
        tuned_layers = f"{sum(m.tuning.source != 'default' for m in mods)}/{len(mods)}"
        pruned = copy.deepcopy(base)
        plan.apply(pruned, force=True)
        err = logits_error(fast, pruned, shape.vocab, device)
        del pruned
        prefill = {"prefill_tokens": long_prompt, "dense_prefill_ms": dense_prefill,
                   "long_prefill_ms": prefill_ms(fast, long_prompt, reps=reps, **timing)}
        prefill["prefill_speedup"] = dense_prefill / prefill["long_prefill_ms"]
        for b in opts.e2e_batches:
            r = decode_speed(fast, b, tokens, cuda, **timing)
            rows.append({"sparsity": sparsity, "tuned": tuned, "tuned_layers": tuned_layers, "batch": b,
                         "layers": shape.layers, "tokens": tokens, **err, **prefill,
                         "dense_tok_s": dense_speed[b]["decode_tok_s"], **r,
                         "speedup": r["decode_tok_s"] / dense_speed[b]["decode_tok_s"], "cuda_graphs": cuda})
        del fast
        if cuda:
            torch.cuda.empty_cache()
    return {"rows": rows, "skipped": skipped, "shape": dataclasses.asdict(shape)}
