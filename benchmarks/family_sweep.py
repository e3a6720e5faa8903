"""Every causal-LM model type of the installed transformers, tiny and random, through patchc's whole path.

    python benchmarks/family_sweep.py                  # all of them (196 in transformers 5.24: ~35 min on 2 cores)
    python benchmarks/family_sweep.py --types llama gemma4_text deepseek_v4
    python benchmarks/family_sweep.py --experts batched_mm --types qwen3_moe gpt_oss   # backend stages on it
    python benchmarks/family_sweep.py --offload        # only `tiny`, then the blocks streamed (--offload)

tests/test_families.py checks ~30 families with hand-written configs. A transformers release adds families
faster than that matrix grows, so this sweep shrinks each type's default config by rule (hidden 64, 2
layers, 4 heads, 4 experts, ...; per-layer lists and latent attention's head sizes kept in step; `FITS` for
what a validator ties) and runs:

    tiny     the config shrinks and the model builds and runs its own forward. Where it does not, the rule
             does not fit that config (a validator, a derived size): the type is "not built", which says
             nothing about patchc
    export   `export_causal_lm` (dynamic length, else one graph per length)
    masks    `patchc.transform` masks at least one weight; the ones mask reproduces the model
    plan     `harden` -> `plan.apply` equals the eval-mode program
    compile  `patchc.compile` equals the plan-applied model; layers with a 2:4 tile it keeps dense (read in a
             form the runtime does not serve) are counted, not failed; what its `save_pretrained` writes
             (`dense_state_dict`) is the plan-applied model's state dict, key for key and value for value
    backend  `torch.compile(model, backend="patch", options={"plan": plan})` equals it too; the graphs dynamo
             hands the backend and the planned layers they leave dense are counted
    inferred `torch.compile(pruned, backend="patch")` of the plan-applied model, the plan read off its zeros in
             every graph, equals it too; its patchc ops are counted beside the planned backend's
    generate `model.generate()` (greedy, 6 tokens, KV cache) with the forward compiled by the backend gives
             the plan-applied model's tokens (prompt, first decode step and dynamic graphs). A type whose
             own `generate` fails is counted as passed with "generate": "n/a"

With --offload the sweep runs `tiny` and then `offload` alone: the model's blocks streamed from host memory
(`patchc.models.offload.stream_blocks`, as `patchc eval --offload` and `patchc sample --offload` run it, here
host to host, each forward's next block copied as one starts, as prefetch does on a GPU) give its own logits
exactly, and its own greedy `generate()` (KV cache) its own tokens. The blocks hold NaN between their forwards
(`poison`), so a weight read outside its block's forward, a device mismatch on a GPU, fails here too; the
record counts the prefetched copies and the misses (a block that did not come next).

Each type runs in its own process (a crash or hang costs that type only, `--timeout`). Prints one line per
type and a summary; appends a record per run to benchmarks/results/families.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "families.jsonl"
STAGES = ("tiny", "export", "masks", "plan", "compile", "backend", "inferred", "generate")

# Integer config fields set to these values when a config has them (counts, widths, expert geometry).
SMALL = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
             expert_intermediate_size=32, intermediate_size_mlp=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=128, num_experts=4, n_routed_experts=4, num_local_experts=4,
             num_experts_per_tok=2, n_shared_experts=1, num_shared_experts=1, n_group=1, topk_group=1,
             kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             first_k_dense_replace=0, d_model=64, n_embd=64, n_head=4, n_layer=2, ffn_dim=64, d_ff=64,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, sliding_window=8,
             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
             rotary_dim=8, d_head=16, num_experts_per_token=2, num_expert_group=1, linear_num_heads=4,
             linear_head_dim=16, expert_ffn_hidden_size=32, mamba_d_ssm=128, mamba_headdim=16, index_n_heads=2,
             index_head_dim=16, index_topk=8, attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=8)
# Fields a config leaves None until a kind of layer needs them (Qwen4's QSA indexer) or derives later (a
# head_dim of hidden / heads): set when present.
UNSET = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
             head_dim=16, num_key_value_heads=2, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1)
_BLT_PART = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, head_dim=16,
                 max_position_embeddings=256, sliding_window=8)
# Types whose validators tie sizes the rule cannot know (checked against transformers 5.24); "layers" is
# the layer count to shrink to.
FITS: dict[str, dict[str, Any]] = {
    "mamba2": dict(num_heads=8),  # num_heads * head_dim = hidden * expand
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # expands to one kind per layer
    "zaya": dict(num_experts_per_tok=1),  # its router supports top-1 only
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "zamba": dict(layers=4, attn_layer_period=2, attn_layer_offset=1),  # two layers share one attention block
    "zamba2": dict(layers=4, hybrid_layer_ids=[1, 3]),  # two layers share one attention block
    # counted in blocks, an attention block then an mlp block per layer: three layers
    "dory": dict(layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,
                 layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]),
    "gemma3n_text": dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, num_kv_shared_layers=0),
    # the nested configs as a released config.json has them (the default's attention config lacks rope_theta)
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(hidden_size=64, ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    # an indexer, then a layer reusing its keys, values and pool; a pool below the 16-token example, so the
    # sparse selection runs (the defaults are laid out for 50 layers and 16K-key pools)
    "kolibri1_1": dict(layers=3, layer_types=["sliding_attention", "indexed_attention", "indexed_attention"],
                       index_layers=[1], kv_source_layers=[0, 1, 1], mlp_only_layers=[0], index_pool_size=8,
                       index_compression=4, index_topk=4, index_num_heads=2, index_num_local_tokens=2,
                       index_num_sink_tokens=1),
    # its default config has no RoPE parameters, which its rotary embedding reads per layer type
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # the causal LM holds the text model only; the vision and audio adapters must still output its width
    "dots3_note": dict(vision_config=dict(adapter_out_dim=SMALL["hidden_size"]),
                       audio_config=dict(adapter_out_dim=SMALL["hidden_size"])),
    "xmod": dict(default_language="en_XX"),  # its adapters need a language to route to
    # the block width (not hidden_size), and chunks the 16-token example fills (below a chunk it steps per token)
    "xlstm": dict(embedding_dim=64, chunk_size=8),
    # BLT's four nested models, which the rule does not reach (their defaults build 2B parameters)
    "blt": dict(encoder_hash_byte_group_vocab=1000, local_attention_window_len=8,
                **{f"{part}_config": dict(_BLT_PART, **extra) for part, extra in (
                    ("patcher", dict(num_hidden_layers=2, vocab_size=260)), ("global", dict(num_hidden_layers=2)),
                    ("encoder", dict(hidden_size_global=64, num_hidden_layers=1, vocab_size=260, cross_attn_k=2)),
                    ("decoder", dict(hidden_size_global=64, num_hidden_layers=2, vocab_size=260, cross_attn_k=2)))}),
}
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
                "num_layers_per_stack")
PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type")


def shrink(d: dict[str, Any], layers: int = 2) -> dict[str, Any]:
    """A config dict made tiny by rule: SMALL's fields, `layers` layers (per-layer lists cut to match, each
    kind of layer kept once where they fit), nested text / decoder configs too."""
    original, d = d, dict(d)
    for key, value in SMALL.items():
        if _is_int(d.get(key)):
            d[key] = value
    d.update({key: value for key, value in UNSET.items() if key in d and d[key] is None})
    if isinstance(d.get("kv_lora_rank"), int) and isinstance(d.get("num_key_value_heads"), int):
        d["num_key_value_heads"] = d["num_attention_heads"]  # multi-head latent attention: one latent per head
    _keep_latent_sizes(original, d)
    counts = {original[key] for key in LAYER_COUNTS if _is_int(original.get(key))}
    for key in LAYER_COUNTS:
        if _is_int(d.get(key)):
            d[key] = layers
    for key, value in d.items():  # any other list with one entry per layer: cut, each int entry made small
        if key not in PER_LAYER_LISTS and isinstance(value, (list, tuple)) and value and len(value) in counts:
            small = SMALL.get(key.removesuffix("_per_layer"))
            d[key] = [small if small is not None and _is_int(v) else v for v in value[:layers]]
    for key in PER_LAYER_LISTS:
        if isinstance(d.get(key), (list, tuple)) and d[key]:
            d[key] = (list(dict.fromkeys(d[key])) * layers)[:layers]
    per_layer = d.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:  # heterogeneous configs (Gemma 4): keep the first overrides
        d["per_layer_config"] = {str(i).zfill(len(k)): _small_overrides(sub)
                                 for i, (k, sub) in enumerate(sorted(per_layer.items())[:layers])}
    for key in ("text_config", "decoder_config"):
        if isinstance(d.get(key), dict):
            d[key] = shrink(d[key], layers)
    return d


def _small_overrides(sub: dict[str, Any]) -> dict[str, Any]:
    """A layer's own overrides made small: head_dim 32 (Gemma 4's global layers), other sizes as SMALL's."""
    sub = {f: 32 if f == "head_dim" else SMALL[f] if f in SMALL and _is_int(v) else v for f, v in sub.items()}
    if "kv_lora_rank" in sub and "num_key_value_heads" in sub:
        sub["num_key_value_heads"] = sub.get("num_attention_heads", SMALL["num_attention_heads"])
    return sub


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _keep_latent_sizes(original: dict[str, Any], d: dict[str, Any]) -> None:
    """Multi-head latent attention's derived sizes keep their relation to the parts: a query head of nope +
    rope dims, and a head_dim that is either that sum (dots3) or the rope part alone (DeepSeek-V3)."""
    if not all(_is_int(original.get(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim")):
        return
    nope, rope = original["qk_nope_head_dim"], original["qk_rope_head_dim"]
    if _is_int(d.get("qk_head_dim")):
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if _is_int(d.get("head_dim")):
        if original["head_dim"] == rope:
            d["head_dim"] = d["qk_rope_head_dim"]
        elif original["head_dim"] == nope + rope:
            d["head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]


def tiny_config(model_type: str) -> Any:
    """The type's default config shrunk by rule, with its FITS entries."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    skip = ("transformers_version", "model_type", "architectures")
    fits = dict(FITS.get(model_type, {}))
    small = shrink({k: v for k, v in default.to_dict().items() if k not in skip}, fits.pop("layers", 2))
    return type(default)(**{**small, **fits})


def check(model_type: str, experts: str | None = None) -> dict[str, Any]:
    """Run one type through the stages; {"type", "passed": last stage passed, "error", ...}. `experts`: the
    transformers experts implementation ("batched_mm", ...) the backend and generate stages run the dense
    model with, where the model lets it be set."""
    import torch
    from transformers import AutoModelForCausalLM

    import patchc
    from patchc.models.hf_export import export_causal_lm
    from patchc.models.per_length import PerLengthExport
    from patchc.models.traceable import traceable_layers
    from patchc.runtime.dispatch import TileLinear
    from patchc.runtime.experts import TileExperts

    out: dict[str, Any] = {"type": model_type, "passed": None}
    stage = "tiny"
    stack = contextlib.ExitStack()
    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        # Layers patchc traces in another form (Qwen4-Exp's indexer) run in it in every model below, so the
        # stages compare like with like (it differs from the original among tied scores: tests/test_traceable.py).
        swapped = stack.enter_context(traceable_layers(model, every_instance=True))
        if swapped:
            out["traceable"] = len(swapped)
        with torch.no_grad():
            dense = model(ids, use_cache=False).logits
        out["passed"], stage = "tiny", "export"
        ep = export_causal_lm(model)
        out["export"] = "per-length" if isinstance(ep, PerLengthExport) else "dynamic"
        out["passed"], stage = "export", "masks"
        prog = patchc.transform(ep, patchc.PatchConfig(tile=(16, 16), sparsity=0.35, init_std=0.5))
        out["layers"] = len(prog.layers)
        with torch.no_grad(), prog.mask_mode("ones"):
            torch.testing.assert_close(_logits(prog(ids)), dense, atol=1e-4, rtol=1e-4)
        out["passed"], stage = "masks", "plan"
        prog.eval()
        with torch.no_grad():
            masked = _logits(prog(ids))
        plan = patchc.harden(prog)
        pruned = plan.apply(copy.deepcopy(model))
        with torch.no_grad():
            applied = pruned(ids, use_cache=False).logits
        torch.testing.assert_close(applied, masked, atol=1e-4, rtol=1e-4)
        out["passed"], stage = "plan", "compile"
        fast = patchc.compile(model, plan, tune=False)
        served = {n for n, m in fast.named_modules() if isinstance(m, (TileLinear, TileExperts))}
        out["kept_dense"] = sum(1 for name, layer in plan.layers.items()  # all-dense layers stay F.linear
                                if layer.n_sparse and not any(name.startswith(s + ".") for s in served))
        with torch.no_grad():
            torch.testing.assert_close(fast(ids, use_cache=False).logits, applied, atol=1e-4, rtol=1e-4)
        _check_saved(fast, pruned)
        del fast
        out["passed"], stage = "compile", "backend"
        if experts is not None and getattr(model, "_can_set_experts_implementation", lambda: False)():
            model.set_experts_implementation(experts)
            out["experts"] = experts
        out.update(_check_backend(model, plan, ids, applied))
        out["passed"], stage = "backend", "inferred"
        inferred = _check_backend(pruned, None, ids, applied)
        out["inferred_ops"], out["inferred_left_dense"] = inferred["backend_ops"], inferred["backend_left_dense"]
        out["passed"], stage = "inferred", "generate"
        out["generate"] = _check_generate(model, pruned, plan)
        out["passed"] = "generate"
    except Exception as error:  # noqa: BLE001 - the sweep records every failure and goes on
        out["failed"] = stage
        out["error"] = first_line(error)
    finally:
        stack.close()
    return out


def check_offload(model_type: str) -> dict[str, Any]:
    """`tiny`, then `offload`: the streamed model's logits and greedy tokens are its own, exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    from patchc.models.offload import stream_blocks

    out: dict[str, Any] = {"type": model_type, "passed": None}
    stage = "tiny"
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
        ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            dense = model(ids, use_cache=False).logits
        out["passed"], stage = "tiny", "offload"
        prompt, kw = ids[:1, :7], dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        try:
            with torch.no_grad():
                tokens = model.generate(prompt, **kw)
        except Exception:  # noqa: BLE001 - a family without generate support says nothing of patchc
            tokens = None
        # poison: a block's weight read outside its forward gives NaN; prefetch: the next block's copy is made
        # as one starts, as on a GPU with room for it (here at once, not on a side stream)
        stream = stream_blocks(model, "cpu", poison=True, prefetch=True)
        out["blocks"], out["resident"] = len(stream.blocks), len(stream.resident)
        with torch.no_grad():
            assert torch.equal(model(ids, use_cache=False).logits, dense), "the streamed logits differ"
            out["generate"] = "n/a" if tokens is None else bool(torch.equal(model.generate(prompt, **kw), tokens))
        assert out["generate"] is not False, "the streamed model generates other tokens"
        assert stream.on_device == [] and stream.arriving is None, f"copies left on the device: {stream.on_device}"
        out["prefetched"], out["misses"] = stream.prefetched, stream.misses
        out["passed"] = "offload"
    except Exception as error:  # noqa: BLE001 - the sweep records every failure and goes on
        out["failed"] = stage
        out["error"] = first_line(error)
    return out


def first_line(error: BaseException) -> str:
    """"Type: the message's first line" (300 characters at most), as a type's record gives its failure."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _check_saved(fast: Any, pruned: Any) -> None:
    """The compiled model's `save_pretrained` state is the plan-applied model's state dict, exactly."""
    import torch

    from patchc.runtime.saving import dense_state_dict

    got, want = dense_state_dict(fast), pruned.state_dict()
    assert got.keys() == want.keys(), f"save_pretrained's state differs in keys {sorted(set(got) ^ set(want))[:4]}"
    for path, module in fast.named_modules():  # zero-computation experts' rows (LongCat's): never read, saved as 0
        for proj, unread in getattr(module, "unread_rows", {}).items():
            key = f"{path}.{proj}"
            if unread:
                assert not got[key][-unread:].any(), f"{key}: the rows no token reads are not saved as zeros"
                want[key] = torch.cat([want[key][:-unread], got[key][-unread:]])
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def _check_backend(model: Any, plan: Any, ids: Any, expected: Any) -> dict[str, int]:
    """torch.compile(backend="patch") of the dense model with the plan reproduces the applied plan:
    {"graphs": graphs dynamo compiled, "backend_ops": patchc ops in them, "backend_left_dense": planned layers
    (expert slices one by one) that some graph left dense or no graph served (`patchc.runtime.unserved`)}.
    `plan` None: `model` is the plan-applied model, its plan inferred from the zeros (nothing left dense counted)."""
    import warnings

    import torch

    from patchc.runtime import unserved

    torch._dynamo.reset()
    graphs: list[int] = []  # per graph: the patchc ops in it
    ops = (torch.ops.patchc.tile_linear.default, torch.ops.patchc.tile_grouped_mm.default)
    options = {**({"plan": plan} if plan is not None else {}), "tune": False,
               "graph_callback": lambda gm, n: graphs.append(sum(node.target in ops for node in gm.graph.nodes))}
    compiled = torch.compile(model, backend="patch", options=options)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # what is left dense is counted below
        got = compiled(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    left = unserved(plan if plan is not None else model)  # a model compiled without a plan: its 2:4 weights
    return {"graphs": len(graphs), "backend_ops": sum(graphs), "backend_left_dense": len(left)}


def _check_generate(model: Any, pruned: Any, plan: Any) -> str | int:
    """Greedy tokens of the dense model with its forward compiled by the backend equal the plan-applied
    model's; the number of graphs compiled, or "n/a" where the model's own generate fails."""
    import torch

    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    try:
        with torch.no_grad():
            want = pruned.generate(ids, **kw)
    except Exception:  # noqa: BLE001 - a family without generate support says nothing of patchc
        return "n/a"
    graphs: list[int] = []
    dense = copy.deepcopy(model)
    torch._dynamo.reset()
    dense.forward = torch.compile(dense.forward, backend="patch",
                                  options={"plan": plan, "tune": False, "graph_callback": lambda gm, n: graphs.append(n)})
    # past torch's limit of 8 graphs per function dynamo runs the frame eagerly, on the dense model's own weights:
    # Kolibri 1.1's decoding reaches it (transformers' deprecate_kwarg wrapper is one function for every method)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
        got = dense.generate(ids, **kw)
    torch._dynamo.reset()
    assert torch.equal(got, want), f"generated {got.tolist()}, the plan-applied model {want.tolist()}"
    return len(graphs)


def _logits(out: Any) -> Any:
    return out if hasattr(out, "shape") else out[0]


def model_types() -> list[str]:
    from transformers.models.auto import modeling_auto

    return sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_one(model_type: str, timeout: float, experts: str | None = None, offload: bool = False) -> dict[str, Any]:
    """`check` (`check_offload` with `offload`) in a fresh process (a crash, hang or leak stays there)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--child", model_type, *(["--experts", experts] if experts else []),
           *(["--offload"] if offload else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        result = json.loads(lines[-1]) if lines else {
            "type": model_type, "passed": None, "failed": "process",
            "error": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:300]}"}
    except subprocess.TimeoutExpired:
        result = {"type": model_type, "passed": None, "failed": "process", "error": f"timed out after {timeout:.0f} s"}
    result["s"] = round(time.perf_counter() - t0, 1)
    return result


def summarise(results: list[dict[str, Any]], last: str = STAGES[-1]) -> dict[str, Any]:
    built = [r for r in results if r["passed"] is not None]
    whole = [r["type"] for r in built if r["passed"] == last]
    return {"types": len(results), "built": len(built), "whole_path": len(whole),
            "not_built": sorted(r["type"] for r in results if r["passed"] is None),
            "failed": {r["type"]: f"{r['failed']}: {r['error']}" for r in built if r["passed"] != last},
            "kept_dense": {r["type"]: r["kept_dense"] for r in built if r.get("kept_dense")},
            "backend_left_dense": {r["type"]: r["backend_left_dense"] for r in built if r.get("backend_left_dense")},
            "inferred_differs": {r["type"]: [r["backend_ops"], r["inferred_ops"], r["inferred_left_dense"]]
                                 for r in built if "inferred_ops" in r
                                 and (r["inferred_ops"], r["inferred_left_dense"]) != (r["backend_ops"], 0)},
            "per_length": sorted(r["type"] for r in built if r.get("export") == "per-length"),
            "generate_na": sorted(r["type"] for r in built if r.get("generate") == "n/a")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", help="model types (default: every causal-LM type of the installed transformers)")
    p.add_argument("--jobs", type=int, default=2, help="types checked at once, one process each")
    p.add_argument("--timeout", type=float, default=600, help="seconds per type")
    p.add_argument("--results", default=str(RESULTS), help="JSON Lines file the run's record is appended to ('': none)")
    p.add_argument("--experts", help="transformers experts implementation for the backend and generate stages "
                                     "(e.g. batched_mm; default: the model's own, grouped_mm)")
    p.add_argument("--offload", action="store_true", help="only `tiny` and `offload` (the blocks streamed)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["PATCHC_CPU_IMPL"] = "reference"  # the plain-PyTorch path: the kernels have their own tests
        result = check_offload(args.child) if args.offload else check(args.child, args.experts)
        print(json.dumps(result), flush=True)
        return 0
    from tqdm import tqdm

    types = args.types or model_types()
    results = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool, tqdm(total=len(types), desc="families", file=sys.stderr) as bar:
        for r in pool.map(lambda t: run_one(t, args.timeout, args.experts, args.offload), types):
            results.append(r)
            bar.update()
            bar.write(f"{r['type']:28s} {r['passed'] or '-':8s} {r['s']:6.1f} s  {r.get('error', '')[:120]}")
    summary = summarise(results, "offload" if args.offload else STAGES[-1])
    print(f"{summary['whole_path']} of {summary['built']} types that build tiny go through the whole path "
          f"({summary['types']} types; not built: {len(summary['not_built'])})")
    for name, why in summary["failed"].items():
        print(f"  failed  {name}: {why}")
    for name, count in summary["kept_dense"].items():
        print(f"  served dense by patchc.compile: {name}: {count} layer(s)")
    for name, count in summary["backend_left_dense"].items():
        print(f"  left dense by backend=\"patch\": {name}: {count} layer(s)")
    for name, (planned, inferred, left) in summary["inferred_differs"].items():
        print(f"  backend=\"patch\" without the plan: {name}: {inferred} ops against {planned} with it, "
              f"{left} weight(s) with a 2:4 tile left dense")
    if summary["generate_na"]:
        print(f"  no generate of their own: {', '.join(summary['generate_na'])}")
    if summary["per_length"]:
        print(f"  exported one graph per length: {', '.join(summary['per_length'])}")
    if args.results:
        import transformers

        from patchc.bench.record import append_jsonl
        from patchc.utils.env import cpu_model, versions

        append_jsonl(Path(args.results), {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": cpu_model(), **versions(),
                                    "transformers": transformers.__version__, "experts": args.experts,
                                    "offload": args.offload, "summary": summary,
                                    "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
