"""`patchc import` / `TilePlan.from_linears` across families: fused MoE experts, Llama 4's bmm experts, GPT-2's
Conv1D, and a BERT encoder with its sentence-transformers pooling.

A 2:4 MoE checkpoint is planned expert by expert ("<3-D param>.<expert>"), and served by `TileExperts`.
The compressed-tensors fixture `moe/` was written by compressed-tensors 0.14.0 under transformers 4 (one
nn.Linear per expert, as the released MoE checkpoints are); transformers 5 fuses the decoded experts when it
loads them. Every comparison is with a plain transformers model holding the same pruned weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

import patchc  # noqa: E402
from patchc.export import load_plan  # noqa: E402
from patchc.export.importing import import_sparse  # noqa: E402
from patchc.ir import TILE_SPARSE24, TilePlan  # noqa: E402
from patchc.ir.targets import model_matrices, read  # noqa: E402
from patchc.models.hf import load_hf_causal, load_hf_tokenizer, minilm_dir, transformers_major  # noqa: E402
from patchc.runtime.dispatch import TileLinear  # noqa: E402
from patchc.runtime.experts import TileBmmExperts, TileExperts  # noqa: E402
from tests.conftest import prune_24  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "compressed_tensors"
IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 63], [3, 7, 11, 13, 19, 23, 29, 31]])
BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64)
needs_fused = pytest.mark.skipif(transformers_major() < 5, reason="transformers 4 keeps one nn.Linear per expert")


def build(family: str) -> nn.Module:
    t = transformers
    torch.manual_seed(0)
    return {
        "qwen3_moe": lambda: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_key_value_heads=1,
            head_dim=16, **BASE)),
        "llama4": lambda: t.Llama4ForCausalLM(t.Llama4TextConfig(
            intermediate_size=16, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
            num_key_value_heads=1, head_dim=16, **BASE)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)),
    }[family]().eval()


@pytest.mark.parametrize("family, experts, transposed", [pytest.param("qwen3_moe", TileExperts, False, marks=needs_fused),
                                                        ("llama4", TileBmmExperts, True), ("gpt2", None, True)])
def test_pruned_experts_and_conv1d_weights_import_and_serve(family, experts, transposed, tmp_path):
    model = build(family)
    matrices = model_matrices(model)
    with torch.no_grad():
        for target in matrices.values():  # every servable matrix, the router too (Llama 4's is an nn.Linear)
            w = read(model, target)
            w.copy_(prune_24(w))
    model.save_pretrained(tmp_path / "src")
    summary = import_sparse(tmp_path / "src", tmp_path / "out", tile=16)

    plan = load_plan(tmp_path / "out")
    routers = {n for n in matrices if "router" in n}
    assert set(plan.layers) == set(matrices) - routers, "every expert slice and Conv1D weight, routers left out"
    assert summary.left_dense == dict.fromkeys(routers, "a MoE router ('*router*'): sparsifying it changes routing")
    assert all(bool((lp.kinds == TILE_SPARSE24).all()) for lp in plan.layers.values())
    sliced = [t for t in matrices.values() if t.expert is not None]
    assert bool(sliced) == (experts is not None)
    assert all(t.transposed == transposed for t in (sliced or matrices.values()))
    for name, target in matrices.items():  # the plan holds (N, K) = (out, in) whatever the storage
        if name in plan.layers:
            torch.testing.assert_close(plan.layers[name].to_dense(), read(model, target), atol=0, rtol=0)
    # where each slice or transpose lives, as the job's plans record it (the backend serves by it)
    recorded = plan.meta.get("targets", {})
    assert recorded == TilePlan.from_linears(model, tile=16).meta.get("targets", {})
    assert set(recorded) == {n for n in plan.layers if matrices[n].expert is not None or matrices[n].transposed}

    served = patchc.from_pretrained(tmp_path / "out")
    fast = patchc.compile(model, tune=False)  # the same model in memory, its plan read off the zeros
    for m in (served, fast):
        kinds = {type(x) for x in m.modules()}
        assert TileLinear in kinds and (experts is None or experts in kinds)
        with torch.no_grad():
            torch.testing.assert_close(m(IDS).logits, model(IDS).logits, atol=1e-5, rtol=1e-5)


def moe_reference(truth: dict[str, torch.Tensor], tmp_path: Path, device: str = "cpu") -> nn.Module:
    """A plain transformers model of the `moe/` fixture's config holding `truth` (per-expert names), loaded by
    transformers itself, which fuses the experts as it does for any released checkpoint."""
    config = json.loads((DATA / "moe" / "config.json").read_text())
    config.pop("quantization_config")
    plain = tmp_path / "truth"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    save_file(truth, str(plain / "model.safetensors"), metadata={"format": "pt"})
    return load_hf_causal(plain, device=device, dtype=torch.bfloat16)[0]


def test_a_compressed_tensors_moe_checkpoint_imports_every_expert(tmp_path):
    truth = load_file(DATA / "moe-truth.safetensors")  # per-expert names, as the checkpoint stores them
    summary = import_sparse(DATA / "moe", tmp_path / "out", tile=16)
    fused = transformers_major() >= 5  # transformers 4 loads one nn.Linear per expert projection
    assert (summary.layout, summary.dtype, summary.dense_tiles) == ("sparse-24-bitmask", "bfloat16", 0)
    assert summary.layers == (12 if fused else 16)
    plan = load_plan(tmp_path / "out")
    experts = "model.layers.0.mlp.experts"
    for e in range(4):
        gate, up, down = (truth[f"{experts}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        want = ({f"{experts}.gate_up_proj.{e}": torch.cat([gate, up]), f"{experts}.down_proj.{e}": down} if fused else
                {f"{experts}.{e}.{p}_proj.weight": w for p, w in (("gate", gate), ("up", up), ("down", down))})
        for name, w in want.items():
            torch.testing.assert_close(plan.layers[name].to_dense(), w, atol=0, rtol=0)  # bit for bit
    assert "model.layers.0.mlp.gate.weight" not in plan.layers, "the router was stored dense"

    reference = moe_reference(truth, tmp_path)
    served = patchc.from_pretrained(tmp_path / "out")
    assert any(isinstance(m, TileExperts) for m in served.modules()) == fused
    with torch.no_grad():
        torch.testing.assert_close(served(IDS).logits.float(), reference(IDS).logits.float(), atol=2e-2, rtol=2e-2)


def test_a_pruned_encoder_imports_with_its_tokenizer_and_pooling(tmp_path):
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64)).eval()  # MiniLM's vocabulary: its tokenizer files go with it
    with torch.no_grad():
        for name, target in model_matrices(model).items():
            if "pooler" not in name:
                w = read(model, target)
                w.copy_(prune_24(w))
    model.save_pretrained(tmp_path / "src")
    for f in minilm_dir().iterdir():
        if f.name.startswith(("tokenizer", "vocab", "special_tokens")):
            shutil.copyfile(f, tmp_path / "src" / f.name)
    shutil.copytree(minilm_dir() / "1_Pooling", tmp_path / "src" / "1_Pooling")
    summary = import_sparse(tmp_path / "src", tmp_path / "out", tile=16)
    assert (summary.layers, summary.dense_tiles) == (12, 0), "2 layers x (q, k, v, attention out, FFN in, FFN out)"
    assert (tmp_path / "out" / "1_Pooling").is_dir() and (tmp_path / "out" / "vocab.txt").is_file()
    served = patchc.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 30522, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(served(ids, mask), model(ids, attention_mask=mask).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)


def test_from_linears_leaves_a_pruned_router_plain_and_names_it():
    model = build("llama4")  # its router is an nn.Linear whose forward returns (scores, logits)
    with torch.no_grad():
        router = model.model.layers[0].feed_forward.router.weight
        router.copy_(prune_24(router))
    plan = TilePlan.from_linears(model, tile=16)
    assert not plan.layers, "nothing else was pruned"
    assert plan.skipped["model.layers.0.feed_forward.router.weight"].startswith("a MoE router")
    assert plan.skipped["model.layers.0.feed_forward.experts.down_proj.0"] == "no 2:4 tile"
    with pytest.raises(ValueError, match="no linear weight .* holds a 2:4 tile"):
        patchc.compile(model)


def test_a_folder_without_tokenizer_files_has_no_tokenizer(tmp_path):
    """transformers 5 builds an empty Qwen2Tokenizer (special tokens only) for a Qwen folder without
    tokenizer files; text through it would be unknown tokens only."""
    build("qwen3_moe").save_pretrained(tmp_path)
    assert load_hf_tokenizer(tmp_path) is None


@needs_fused
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_imported_moe_on_gpu_runs_the_grouped_kernels_and_matches_the_dense_model(tmp_path):
    """Every expert of the compressed-tensors MoE through `TileExperts`' grouped kernels, against transformers'
    own experts holding the same weights."""
    truth = load_file(DATA / "moe-truth.safetensors")
    import_sparse(DATA / "moe", tmp_path / "out", tile=16)
    reference = moe_reference(truth, tmp_path, device="cuda")
    served = patchc.from_pretrained(tmp_path / "out", device="cuda")
    assert any(isinstance(m, TileExperts) and m.kernels for m in served.modules())
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        for rows in (1, 4):
            got, ref = served(ids[:rows]).logits.float(), reference(ids[:rows]).logits.float()
            torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)
