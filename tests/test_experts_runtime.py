"""Fused MoE experts at run time: `TileExperts` (routed, HF's fused-experts forward) and `TileBmmExperts`
(Llama 4: every expert's rows at once) against the original transformers modules, on the Triton
interpreter's kernel path and on a GPU when there is one."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchc
from patchc.runtime.experts import TileBmmExperts, TileExperts, experts_module
from patchc.runtime.grouped_op import TileGroupedLinear
from tests.conftest import assert_close_fp32, prune_24

transformers = pytest.importorskip("transformers")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: experts build kernels on CUDA only")


def _plan_into(experts: nn.Module, path: str, stored_kn: bool = False) -> patchc.TilePlan:
    """A random hybrid plan for every expert slice, its W * M written into the module's weights."""
    from patchc.codegen.reference import random_layer_plan

    layers = {}
    for proj in ("gate_up_proj", "down_proj"):
        param = getattr(experts, proj)
        for e in range(param.shape[0]):
            name = f"{path}.{proj}.{e}"
            rows, cols = param.shape[1:]
            n, k = (cols, rows) if stored_kn else (rows, cols)
            layers[name] = random_layer_plan(n, k, kinds="mixed", seed=len(layers), name=name)
            dense = layers[name].to_dense()
            with torch.no_grad():
                param[e] = dense.t() if stored_kn else dense
    return patchc.TilePlan(layers=layers)


def _tiny_experts(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A Mixtral fused-experts module (2 experts, hidden 32, intermediate 16) holding a random hybrid plan's
    weights, the plan, and a routing of 6 tokens (top-2)."""
    from transformers.models.mixtral import modeling_mixtral

    if not hasattr(modeling_mixtral, "MixtralExperts"):  # transformers 4.x: a ModuleList of expert MLPs
        pytest.skip(f"transformers {transformers.__version__} has no fused MixtralExperts (transformers 5 has)")
    MixtralExperts = modeling_mixtral.MixtralExperts

    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=2, num_experts_per_tok=2)
    experts = MixtralExperts(cfg).eval()
    plan = _plan_into(experts, "mlp.experts")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=gen)
    index = torch.stack([torch.randperm(2, generator=gen) for _ in range(6)])
    weights = torch.rand(6, 2, generator=gen).softmax(-1)
    to = dict(device=device, dtype=dtype)
    return experts.to(**to), plan, "mlp.experts", (x.to(**to), index.to(device), weights.to(**to))


def _tiny_bmm_experts(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A Llama 4 experts module (2 experts, hidden 32, intermediate 16; weights stored (E, K, N)) holding a
    random hybrid plan's weights, the plan, and 5 rows per expert."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    cfg = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=2)
    experts = Llama4TextExperts(cfg).eval()
    plan = _plan_into(experts, "feed_forward.experts", stored_kn=True)
    x = torch.randn(2 * 5, 32, generator=torch.Generator().manual_seed(3))
    to = dict(device=device, dtype=dtype)
    return experts.to(**to), plan, "feed_forward.experts", (x.to(**to),)


def _tiny_normed_experts(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Routed experts that norm each expert's output before its routing weight (transformers'
    `has_post_expert_norm`, as Muse Spark's do), in the Mixtral experts' shapes and routing."""
    moe = pytest.importorskip("transformers.integrations.moe")
    if "has_post_expert_norm" not in inspect.signature(moe.use_experts_implementation).parameters:
        pytest.skip(f"transformers {transformers.__version__}'s experts decorator has no post-expert norm")
    experts, plan, path, args = _tiny_experts(device, dtype)

    @moe.use_experts_implementation(has_post_expert_norm=True)
    class NormedExperts(nn.Module):
        def __init__(self, config) -> None:
            super().__init__()
            self.num_experts, self.act_fn = 2, experts.act_fn
            self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
            self.post_expert_norm = nn.RMSNorm(32, eps=1e-6, device=device, dtype=dtype)
            nn.init.uniform_(self.post_expert_norm.weight, 0.5, 2.0)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for e in range(self.num_experts):
                token, slot = (top_k_index == e).nonzero(as_tuple=True)
                gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = self.post_expert_norm(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
                out.index_add_(0, token, y * top_k_weights[token, slot, None])
            return out

    return NormedExperts(experts.config).eval(), plan, path, args


def _spy_grouped(monkeypatch) -> list[str]:
    """Run the grouped kernels in the Triton interpreter; returns the list each launch appends its name to."""
    from patchc.runtime import grouped_op
    from patchc.runtime import op as rt_op

    if not rt_op.kernels_interpreted():
        pytest.skip("patchc's Triton kernels were not decorated under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    monkeypatch.setenv("PATCHC_CPU_IMPL", "triton")
    launched: list[str] = []
    real = grouped_op.launch_grouped
    monkeypatch.setattr(grouped_op, "launch_grouped", lambda *a, **k: launched.append(k.get("name")) or real(*a, **k))
    return launched


@pytest.mark.parametrize("build, kind", [(_tiny_experts, TileExperts), (_tiny_bmm_experts, TileBmmExperts),
                                         (_tiny_normed_experts, TileExperts)])
def test_experts_dense_fallback_and_kernel_path_in_the_triton_interpreter(build, kind, monkeypatch):
    """`experts_module` picks the drop-in by the forward's signature; its CPU fallback and its grouped hybrid
    kernels (the GPU path, here interpreted: one launch per projection for every expert) equal the original."""
    experts, plan, path, args = build()
    fast = experts_module(experts, plan, path)
    assert type(fast) is kind and all(isinstance(k, TileGroupedLinear) for k in fast.kernels.values())
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    with torch.no_grad():
        assert_close_fp32(fast(*args), experts(*args))
    launched = _spy_grouped(monkeypatch)
    with torch.no_grad():
        got, want = fast(*args), experts(*args)
    assert launched == [f"{path}.gate_up_proj", f"{path}.down_proj"]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_a_pair_at_routing_weight_zero_gives_its_expert_no_row(monkeypatch):
    """A (token, slot) pair at routing weight 0 adds nothing (LongCat-Flash under transformers 5.25 sends its
    zero-computation pairs to routed experts so): neither path computes it, so an expert only such pairs hit is
    not read, and the output is still the module's own."""
    from patchc.runtime import grouped_op

    experts, plan, path, (x, index, weights) = _tiny_experts()
    weights = weights.masked_fill(index == 1, 0.0)  # expert 1: every pair it gets is at weight 0
    fast = experts_module(experts, plan, path)
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    read = []
    real_linear = fast._linear
    monkeypatch.setattr(fast, "_linear", lambda proj, e, rows: read.append(e) or real_linear(proj, e, rows))
    with torch.no_grad():
        want = experts(x, index, weights)
        assert_close_fp32(fast(x, index, weights), want)
    assert read == [0, 0]
    _spy_grouped(monkeypatch)
    ends, real = [], grouped_op.launch_grouped
    monkeypatch.setattr(grouped_op, "launch_grouped", lambda *a, **k: ends.append(a[1].tolist()) or real(*a, **k))
    with torch.no_grad():
        torch.testing.assert_close(fast(x, index, weights), want, atol=1e-4, rtol=1e-5)
    assert ends == [[6, 6], [6, 6]]  # 6 rows for expert 0, none for expert 1, none past the last end


@pytest.mark.parametrize("top_k", [1, None])
def test_bmm_experts_compute_only_the_rows_the_router_scored(top_k, monkeypatch):
    """Llama 4's block hands every expert every token, scaled by its router score (0 where not picked): the
    drop-in computes the scored rows only, so an expert no token picked is not read; with the block's top_k
    the kernels get T * top_k rows, not E * T. The output is still the module's own, zero rows included."""
    from transformers.models.llama4.modeling_llama4 import Llama4Router, Llama4TextExperts

    from patchc.runtime import grouped_op

    cfg = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                                        num_experts_per_tok=1)
    experts = Llama4TextExperts(cfg).eval()
    plan = _plan_into(experts, "feed_forward.experts", stored_kn=True)
    tokens = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    router = Llama4Router(cfg)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:3, :3] = torch.eye(3) * 10  # token t picks expert argmax(tokens[t, :3]): expert 3 never
        scores, _ = router(tokens)
        rows = tokens.repeat(4, 1) * scores.transpose(0, 1).reshape(-1, 1)  # as Llama4TextMoe.forward
        want = experts(rows)
    picked = scores.ne(0).sum(0).tolist()
    assert sum(picked) == 5 and picked[3] == 0
    fast = experts_module(experts, plan, "feed_forward.experts", top_k=top_k)
    assert type(fast) is TileBmmExperts and fast.rows_per_token == top_k and fast.skips_zero_rows
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    read = []
    real_linear = fast._linear
    monkeypatch.setattr(fast, "_linear", lambda proj, e, x: read.append(e) or real_linear(proj, e, x))
    with torch.no_grad():
        assert_close_fp32(fast(rows), want)
    assert sorted(set(read)) == [e for e in range(4) if picked[e]]
    _spy_grouped(monkeypatch)
    launches, real = [], grouped_op.launch_grouped
    monkeypatch.setattr(grouped_op, "launch_grouped",
                        lambda *a, **k: launches.append((a[0].shape[0], a[1].tolist())) or real(*a, **k))
    with torch.no_grad():
        got = fast(rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert not got[20 - 5:].any()  # expert 3's rows: zeros
    ends = torch.tensor(picked).cumsum(0).tolist()
    assert launches == [(5 if top_k else 20, ends)] * 2
    # a zero row's input gradient is zero too (up(x) * silu(gate(x)) at x = 0): gradients pass as the module's
    x, x_want, g = rows.clone().requires_grad_(True), rows.clone().requires_grad_(True), torch.randn_like(want)
    (fast(x) * g).sum().backward()
    (experts(x_want) * g).sum().backward()
    assert x_want.grad.abs().sum() > 0 and not x_want.grad[15:].any()
    torch.testing.assert_close(x.grad, x_want.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_a_served_llama4_block_runs_the_routers_picks_only(path, monkeypatch):
    """`patchc.compile` serves Llama 4's MoE block as `TileLlama4Moe`: the router's picks sorted by expert go to
    the experts' kernels (T x top_k rows), never the block's E x T rows, and the logits are the plan-applied
    model's, on the CPU path and the grouped kernels' (interpreted)."""
    from patchc.runtime import grouped_op
    from patchc.runtime.experts import TileLlama4Moe
    from tests.test_backend_experts import _family_plan

    case, plan = _family_plan("llama4")
    pruned = plan.apply(copy.deepcopy(case.model))
    if path == "triton":
        _spy_grouped(monkeypatch)
    else:
        monkeypatch.setenv("PATCHC_CPU_IMPL", path)
    launches, real = [], grouped_op.launch_grouped
    monkeypatch.setattr(grouped_op, "launch_grouped", lambda *a, **k: launches.append(a[0].shape[0]) or real(*a, **k))
    every_row = []
    monkeypatch.setattr(TileBmmExperts, "forward", lambda self, x: every_row.append(x.shape) or None)
    with torch.no_grad():
        want = case.run(pruned)
        fast = patchc.compile(case.model, plan, tune=False)
        block = fast.model.layers[0].feed_forward
        assert type(block) is TileLlama4Moe and type(block.experts) is TileBmmExperts
        assert set(dict(block.named_children())) == {"router", "shared_expert", "experts"}  # the block's names
        assert_close_fp32(case.run(fast), want)
    assert not every_row
    assert launches == ([case.ids.numel() * case.model.config.num_experts_per_tok] * 2 if path == "triton" else [])


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("build, kind", [(_tiny_experts, TileExperts), (_tiny_bmm_experts, TileBmmExperts)])
def test_experts_on_gpu_match_the_original_module(build, kind):
    """fp16 on CUDA, eagerly and replayed from a CUDA graph (the routing is sorted and read on the device);
    no dense copy of the experts is kept."""
    experts, plan, path, args = build("cuda", torch.float16)
    fast = experts_module(experts, plan, path)
    assert type(fast) is kind and all(isinstance(k, TileGroupedLinear) for k in fast.kernels.values())
    assert all(getattr(fast, f"{p}_dense") is None for p in fast.names)
    with torch.no_grad():
        want = experts(*args)
        torch.testing.assert_close(fast(*args), want, atol=2e-2, rtol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast(*args)
        graph.replay()
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def test_an_experts_module_called_another_way_is_listed_not_replaced():
    """A fused-experts module whose forward is neither form is left with the plan's values and named."""
    from patchc.runtime.compile import plan_swaps

    experts, plan, path, (x, index, weights) = _tiny_experts()

    class Gated(nn.Module):  # same weights, another call: forward(hidden_states, gammas)
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.gate_up_proj, self.down_proj = inner.gate_up_proj, inner.down_proj

        def forward(self, hidden_states, gammas):
            return hidden_states

    holder = nn.Module()
    holder.mlp = nn.Module()
    holder.mlp.experts = Gated(experts)
    swaps, fused, missed = plan_swaps(holder, plan)
    assert not fused and set(missed) == set(plan.layers)
    assert all("neither the routed" in why and "gammas" in why for why in missed.values())


def test_experts_whose_projections_hold_different_experts_are_left_out_by_name():
    """Experts whose gate_up_proj holds more experts than down_proj, without saying the extra ids compute
    nothing (LongCat-Flash's `zero_expert_num`, served: tests/test_longcat.py), are left as they are: a plan
    naming their slices keeps them dense, saying why, and the rest of the model is served."""
    from patchc.ir.from_pruned import layer_from_weight
    from patchc.ir.targets import expert_projections

    if not hasattr(transformers, "LongcatFlashConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no LongCat-Flash")
    cfg = transformers.LongcatFlashConfig(
        vocab_size=128, hidden_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=4,
        ffn_hidden_size=64, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
        v_head_dim=16, n_routed_experts=4, zero_expert_num=4, expert_ffn_hidden_size=32, moe_topk=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # 2:4 by magnitude along every weight's rows: the plan's layers hold 2:4 tiles
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(prune_24(p))
    experts = model.model.layers[0].mlp.experts
    assert expert_projections(experts) == ["gate_up_proj", "down_proj"]
    if experts.gate_up_proj.shape[0] == experts.down_proj.shape[0]:  # transformers 5.25 holds the routed ones only
        with torch.no_grad():
            experts.gate_up_proj = nn.Parameter(torch.cat([experts.gate_up_proj, experts.gate_up_proj]))
    experts.zero_expert_num = 0  # the extra rows are no longer zero-computation experts
    assert (experts.gate_up_proj.shape[0], experts.down_proj.shape[0]) == (8, 4) and expert_projections(experts) == []
    path = "model.layers.0.mlp.experts"
    plan = patchc.TilePlan(layers={
        f"{path}.gate_up_proj.0": layer_from_weight(f"{path}.gate_up_proj.0", experts.gate_up_proj[0], (16, 16)),
        "model.layers.0.mlps.0.up_proj.weight": layer_from_weight(
            "model.layers.0.mlps.0.up_proj.weight", model.model.layers[0].mlps[0].up_proj.weight, (16, 16))})
    with pytest.warns(UserWarning, match=r"gate_up_proj\.0 \(its projections hold different numbers of experts "
                                         r"\(gate_up_proj: 8, down_proj: 4\)"):
        kept = patchc.compile(model, plan, tune=False)
    assert kept.model.layers[0].mlp.experts.__class__ is experts.__class__
    assert type(kept.model.layers[0].mlps[0].up_proj).__name__ == "TileLinear"


def test_compile_tunes_one_slice_per_fused_weight_and_every_expert_shares_it(monkeypatch):
    """patchc.compile asks the tuner for the first planned slice of each projection only (the slices share a
    shape) and hands that tuning to the projection's TileGroupedLinear."""
    import dataclasses
    import importlib

    from patchc.runtime.op import kernels_interpreted

    compile_mod = importlib.import_module("patchc.runtime.compile")  # the package's `compile` is the function

    if not kernels_interpreted():
        pytest.skip("TileExperts builds its grouped kernels on CPU only under the Triton interpreter")
    experts, plan, path, args = _tiny_experts()
    holder = nn.Module()
    holder.mlp = nn.Module()
    holder.mlp.experts = experts
    asked = []

    def fake_tunings(plan, names, *rest):
        asked.extend(names)
        from patchc.codegen.layout import pack
        from patchc.runtime.tuner import default_tuning

        out = {}
        for fqn in names:
            t = default_tuning(plan.layers[fqn], pack(plan.layers[fqn]), 16, 128, "sm_80")
            out[fqn] = dataclasses.replace(t, threshold=7)
        return out

    monkeypatch.setattr(compile_mod, "_tunings", fake_tunings)
    fast = patchc.compile(holder, plan, tune=True)
    assert asked == [f"{path}.gate_up_proj.0", f"{path}.down_proj.0"]
    assert all(k.threshold == 7 and k.tuning.fqn == f"{path}.{p}.0" for p, k in fast.mlp.experts.kernels.items())
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    with torch.no_grad():
        assert_close_fp32(fast.mlp.experts(*args), experts(*args))


def test_compiling_a_copy_copies_no_fused_expert_weight_that_leaves(monkeypatch):
    """A 3-D expert weight whose every slice is planned leaves with its experts module (the TileExperts is
    built from the plan alone): the copy `compile` works on never copies it. One with an unplanned slice is
    read while the TileExperts is built, so it is copied, with W * M written into its planned slices."""
    from tests.conftest import prune_24

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.copy_(prune_24(p.reshape(-1, p.shape[-1])).reshape(p.shape))
    plan = patchc.TilePlan.from_linears(model, tile=16)
    partial = "model.layers.1.mlp.experts.down_proj"  # down_proj: (E, 32, 48); its slice 2 left unplanned
    plan = patchc.TilePlan(layers={n: lp for n, lp in plan.layers.items() if n != f"{partial}.2"}, meta=plan.meta)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = plan.apply(copy.deepcopy(model))(ids).logits
    copied: list[tuple[int, ...]] = []
    real = nn.Parameter.__deepcopy__
    monkeypatch.setattr(nn.Parameter, "__deepcopy__", lambda self, memo: copied.append(tuple(self.shape)) or real(self, memo))
    fast = patchc.compile(model, plan, tune=False)
    monkeypatch.undo()
    experts_3d = [s for s in copied if len(s) == 3]
    assert experts_3d == [(4, 32, 48)], f"only the fused weight with an unplanned slice is copied, got {experts_3d}"
    assert all(isinstance(fast.model.layers[i].mlp.experts, TileExperts) for i in (0, 1))
    with torch.no_grad():
        assert_close_fp32(fast(ids).logits, want)


@pytest.mark.parametrize("build, rows", [(_tiny_experts, [3 * 3, 20 * 3]), (_tiny_bmm_experts, [3 * 2, 20 * 2])])
def test_model_warmup_warms_fused_experts_for_the_rows_their_tokens_route(build, rows, monkeypatch):
    """`patchc.runtime.warmup(model, ms)` runs each projection's grouped kernels at M x top_k rows (top-3
    routing: the config says so) or, for Llama 4's, M x its block's top_k, M x experts where that is not known
    (its 2 experts see every token): what a captured graph of M tokens launches."""
    experts, plan, path, _ = build()
    fast = experts_module(experts, plan, path)
    model = nn.Module()
    model.config = transformers.MixtralConfig(num_experts_per_tok=3)
    model.add_module("experts", fast)
    _spy_grouped(monkeypatch)
    warmed: list[tuple[str, list[int]]] = []
    real = TileGroupedLinear._run_each
    monkeypatch.setattr(TileGroupedLinear, "_run_each", lambda self, r: warmed.append((self.name, r)) or real(self, r))
    assert patchc.runtime.warmup(model, [3, 20]) == 1
    assert warmed == [(f"{path}.gate_up_proj", rows), (f"{path}.down_proj", rows)]
    del model.config
    if isinstance(fast, TileBmmExperts):
        assert patchc.runtime.warmup(model, [1]) == 1  # needs no top_k
        fast.rows_per_token = 1  # as patchc.compile sets it from the block: only the scored rows are launched
        warmed.clear()
        assert patchc.runtime.warmup(model, [3, 20]) == 1 and warmed[0][1] == [3, 20]
    else:
        with pytest.raises(ValueError, match=r"mlp\.experts routes each token.*top_k=K"):
            patchc.runtime.warmup(model, [1])
        warmed.clear()
        assert patchc.runtime.warmup(model, [5], top_k=3) == 1 and warmed[0][1] == [15]


def test_bmm_experts_benchmark_runs_both_forms_and_they_agree(capsys):
    """`benchmarks/bench_bmm_experts.py` at a tiny size: both rows timed, each the transformers module's output."""
    from tests.conftest import load_benchmark

    bench = load_benchmark("bench_bmm_experts")
    assert bench.main(["--experts", "4", "--hidden", "32", "--ffn", "16", "--tokens", "1", "3", "--rounds", "2",
                       "--device", "cpu", "--threads", str(torch.get_num_threads()), "--no-record"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("T=")]
    assert len(lines) == 2 and all("every row" in line and "scored rows" in line for line in lines)
    errors = [float(line.rsplit("error ", 1)[1].rstrip(")")) for line in lines]
    assert max(errors) < 1e-5
