"""`patchc import`: models that are already 2:4 in, folders `patchc.from_pretrained` serves out.

The compressed-tensors checkpoints under tests/data/compressed_tensors were written by compressed-tensors
0.14.0 itself (the last release with its sparse-24-bitmask compressor; `make_fixtures.py` there), so the
reader is checked against the library's files, not against patchc's idea of them. `truth.safetensors`
holds the pruned bf16 weights those checkpoints were made from: every comparison is with those, through a
plain transformers model built independently of the import.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

import patchc  # noqa: E402
from patchc.export import ExportError, load_plan  # noqa: E402
from patchc.export.importing import import_sparse  # noqa: E402
from patchc.ir import TILE_DENSE, TILE_SPARSE24  # noqa: E402
from patchc.models.hf import HFLoadError, load_hf_causal  # noqa: E402
from tests.conftest import save_word_tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "compressed_tensors"
ROOT = Path(__file__).resolve().parents[1]
BLOCK_LINEARS = 14  # 2 layers x (q, k, v, o, gate, up, down)
IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 63], [3, 7, 11, 13, 19, 23, 29, 31]])


def truth_model(weights: dict[str, torch.Tensor]) -> nn.Module:
    """A plain transformers Llama holding `weights` (the fixture's config, its quantization removed)."""
    config = json.loads((DATA / "bf16" / "config.json").read_text())
    config.pop("quantization_config")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def fp8_expected(truth: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bf16 weights an FP8 per-channel round trip of `truth` gives, with the checkpoint's own scales:
    e4m3(W / s) * s, computed here from the definition (not by the reader)."""
    stored = load_file(DATA / "fp8" / "model.safetensors")
    out = dict(truth)
    for key, scale in stored.items():
        if key.endswith(".weight_scale"):
            w = truth[key.removesuffix("_scale")].float()
            q = (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[key.removesuffix("_scale")] = (q.float() * scale.float()).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_compressed_tensors_files_import_and_serve(kind, tmp_path):
    truth = load_file(DATA / "truth.safetensors")
    want = truth if kind == "bf16" else fp8_expected(truth)
    summary = import_sparse(DATA / kind, tmp_path / "out", tile=16)
    assert (summary.layout, summary.dtype, summary.layers) == ("sparse-24-bitmask", "bfloat16", BLOCK_LINEARS)
    assert summary.dense_tiles == 0 and summary.sparse_tiles == 72 and not summary.left_dense
    assert not list(tmp_path.glob(".patchc-import.*")), "the decoded copy is removed"

    plan = load_plan(tmp_path / "out")
    plan.verify()
    assert set(plan.layers) == {k for k in truth if ".layers." in k and k.endswith("proj.weight")}
    for fqn, layer in plan.layers.items():
        assert bool((layer.kinds == TILE_SPARSE24).all()), fqn
        dense = layer.to_dense()
        groups = (dense != 0).reshape(dense.shape[0], -1, 4).sum(-1)
        assert int(groups.max()) <= 2, f"{fqn}: 2:4 broken"
        # bf16: bit-exact; fp8: the definition's round trip (one e4m3 rounding apart at most)
        tol = {} if kind == "bf16" else {"atol": 0, "rtol": 2 ** -3}
        torch.testing.assert_close(dense, want[fqn], **(tol or {"atol": 0, "rtol": 0}))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config, "the served model is not quantized"

    served = patchc.from_pretrained(tmp_path / "out")
    reference = truth_model(want)
    with torch.no_grad():
        got, ref = served(IDS).logits.float(), reference(IDS).logits.float()
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)  # bf16 through the same ops, kernel vs dense
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_fp8_values_are_the_dequantized_checkpoint():
    """The FP8 fixture's weights are the truth to within e4m3's precision (so the round trip is the right one)."""
    truth = load_file(DATA / "truth.safetensors")
    want = fp8_expected(truth)
    w, t = want["model.layers.0.mlp.up_proj.weight"].float(), truth["model.layers.0.mlp.up_proj.weight"].float()
    assert 0 < (w - t).abs().max() <= 2 ** -4 * t.abs().max()


def save_llama(folder: Path, prune: dict[str, str], dtype=torch.float32, tied: bool = False,
               kv_heads: int = 2) -> nn.Module:
    """A tiny random Llama saved with save_pretrained; `prune`: {linear name part: "24" | "half" | "none"}."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=64,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for name, mod in model.named_modules():
            how = next((v for k, v in prune.items() if name.endswith(k)), "24")
            if not isinstance(mod, nn.Linear) or name == "lm_head" or how == "none":
                continue
            w = mod.weight
            mags = w.abs().reshape(w.shape[0], -1, 4)
            keep = torch.zeros_like(mags, dtype=torch.bool).scatter_(-1, mags.topk(2, -1).indices, True)
            keep = keep.reshape(w.shape)
            if how == "half":  # the left 16 columns of every 16-row band stay dense: a hybrid layer
                keep[:, :16] = True
            w.mul_(keep)
    model.save_pretrained(folder)
    return model


def test_dense_stored_hybrid_model_imports_as_it_is(tmp_path):
    model = save_llama(tmp_path / "src", {"self_attn.o_proj": "half", "mlp.down_proj": "none"})
    summary = import_sparse(tmp_path / "src", tmp_path / "out", tile=16)
    assert summary.layout == "dense weights" and summary.dtype == "float32"
    assert summary.left_dense == {"model.layers.0.mlp.down_proj.weight": "no 2:4 tile"}
    plan = load_plan(tmp_path / "out")
    assert "lm_head.weight" not in plan.layers and "model.embed_tokens.weight" not in plan.layers
    o_proj = plan.layers["model.layers.0.self_attn.o_proj.weight"]
    assert (o_proj.kinds[:, 0] == TILE_DENSE).all() and (o_proj.kinds[:, 1:] == TILE_SPARSE24).all()
    assert len(plan.layers) == 6
    served = patchc.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(served(IDS).logits, model(IDS).logits, atol=1e-4, rtol=1e-5)
    assert "left as plain weights: 1 (1: no 2:4 tile)" in summary.format()


def test_the_tile_is_inferred_from_the_zeros_unless_given(tmp_path):
    """The widest side that keeps the 2:4 weights and fits the shapes: every weight here is 64 wide, so 64 x 64
    (128 x 128 would store each in a quarter of a tile); with grouped K / V heads (32 x 64) 32 x 32."""
    save_llama(tmp_path / "all", {}, kv_heads=4)
    summary = import_sparse(tmp_path / "all", tmp_path / "a")
    assert summary.tile == (64, 64) and summary.dense_tiles == 0 and summary.plan_bytes < summary.dense_bytes
    assert "tile 64x64 (inferred from the zeros; --tile sets it)" in summary.format()
    assert "at 64x64" not in summary.format()
    save_llama(tmp_path / "gqa", {})
    assert import_sparse(tmp_path / "gqa", tmp_path / "q").tile == (32, 32)
    save_llama(tmp_path / "hybrid", {"self_attn.o_proj": "half"}, kv_heads=4)  # dense 16-column stripes: 16 x 16
    summary = import_sparse(tmp_path / "hybrid", tmp_path / "h")
    assert summary.tile == (16, 16) and summary.dense_tiles == 4
    # o_proj's 64-wide tiles each hold a dense stripe: at 64 x 64 its 2:4 weights (3/4 of 64 x 64) are lost
    share = 1 - 64 * 48 / summary.coverage[16]
    assert f"at 64x64 the 2:4 tiles would hold {share:.0%} of these 2:4 weights" in summary.format()
    assert load_plan(tmp_path / "h").layers["model.layers.0.self_attn.o_proj.weight"].tile == (16, 16)
    assert "(inferred from the zeros" not in import_sparse(tmp_path / "hybrid", tmp_path / "g", tile=32).format()


@pytest.mark.parametrize("tile, message", [((0, 16), "--tile 0 16: both tile dims must be multiples of 4"),
                                           ((16, 18), "--tile 16 18: both"), ((-4, 4), "--tile -4 4: both"),
                                           ((256, 256), "tile 256x256 is wider than its weights")])
def test_a_tile_that_cannot_serve_the_weights_is_refused_before_any_folder(tmp_path, tile, message):
    save_llama(tmp_path / "src", {})
    with pytest.raises(ValueError, match=message):
        import_sparse(tmp_path / "src", tmp_path / "out", tile=tile)
    assert not (tmp_path / "out").exists()


def test_dtype_is_the_checkpoints_unless_given(tmp_path):
    save_llama(tmp_path / "src", {}, dtype=torch.bfloat16)
    assert import_sparse(tmp_path / "src", tmp_path / "a", tile=16).dtype == "bfloat16"
    assert import_sparse(tmp_path / "src", tmp_path / "b", tile=16, dtype=torch.float16).dtype == "float16"
    assert load_plan(tmp_path / "b").layers["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16


@pytest.mark.parametrize("max_shard_size", ["50GB", 20_000])
def test_import_packs_one_layer_at_a_time_and_writes_the_plan_from_linears_gives(tmp_path, monkeypatch, max_shard_size):
    """The plan is never held whole: when a layer is packed, no earlier packed layer is alive (the weights file
    took it and dropped it), in one file or in shards. The folder holds exactly the plan `TilePlan.from_linears`
    makes."""
    import weakref

    from patchc.export import importing

    model = save_llama(tmp_path / "src", {"self_attn.o_proj": "half", "mlp.down_proj": "none"})
    packed: weakref.WeakSet = weakref.WeakSet()
    alive_when_packing = []
    real = importing.layer_from_linear

    def pack(*args, **kwargs):
        alive_when_packing.append(len(packed))
        layer = real(*args, **kwargs)
        packed.add(layer)
        return layer

    monkeypatch.setattr(importing, "layer_from_linear", pack)
    import_sparse(tmp_path / "src", tmp_path / "out", tile=16, max_shard_size=max_shard_size)
    assert alive_when_packing == [0] * 6
    files = len(list((tmp_path / "out").glob("*.safetensors")))
    assert files == 1 if max_shard_size == "50GB" else files > 2
    want = patchc.TilePlan.from_linears(model, tile=16)
    got = load_plan(tmp_path / "out")
    assert list(got.layers) == list(want.layers) and got.skipped == want.skipped
    for fqn, layer in want.layers.items():
        for part, t in layer.tensors().items():
            assert torch.equal(got.layers[fqn].tensors()[part], t), f"{fqn}: {part}"
    body = json.loads((tmp_path / "out" / "patchc_config.json").read_text())
    assert body["bytes"]["plan"] == want.nbytes() and body["plan"]["density"] == pytest.approx(want.density, abs=1e-12)
    assert body["layers"]["model.layers.0.self_attn.o_proj.weight"]["dense_tiles"] == 4


def test_a_bf16_import_serves_what_transformers_loads_at_far_positions(tmp_path, monkeypatch):
    """`from_pretrained` builds the model in its dtype as transformers does, so buffers computed in fp32 stay
    fp32. Built in fp32 and cast, RoPE's inverse frequencies were rounded to bf16: at position 1000 a 128-dim
    head's angles were off by up to 1.2 rad (theta 1e4; 1.8 at 5e5); this tiny model's logits by 2e-3."""
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")  # TileLinear's exact CPU path: the same F.linear
    save_llama(tmp_path / "src", {}, dtype=torch.bfloat16)
    import_sparse(tmp_path / "src", tmp_path / "out", tile=16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()
    positions = torch.arange(1000, 1000 + IDS.shape[1]).expand_as(IDS)
    with torch.no_grad():
        want = ref(IDS, position_ids=positions).logits
        for dense in (True, False):
            served = patchc.from_pretrained(tmp_path / "out", dense=dense)
            assert served.model.rotary_emb.inv_freq.dtype == ref.model.rotary_emb.inv_freq.dtype == torch.float32
            assert served.model.embed_tokens.weight.dtype == torch.bfloat16
            assert torch.equal(served(IDS, position_ids=positions).logits, want), f"dense={dense}"


def test_import_refuses_what_it_cannot_serve(tmp_path):
    save_llama(tmp_path / "dense", {"proj": "none"}, tied=True)  # the tied LM head is no linear layer to plan
    with pytest.raises(ExportError, match="none of its 7 linear weights holds a 2:4 tile at 16x16"):
        import_sparse(tmp_path / "dense", tmp_path / "out")  # the tile search ends at the finest side
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".patchc-import.*"))

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        import_sparse(DATA / "bf16", tmp_path / "taken", tile=16)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"

    broken = fixture_without("bf16", "model.layers.1.mlp.up_proj.compressed", tmp_path)
    with pytest.raises(Exception, match="model.layers.1.mlp.up_proj.weight"):
        import_sparse(broken, tmp_path / "out", tile=16)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".patchc-import.*"))


def fixture_without(kind: str, tensor: str, tmp_path: Path) -> Path:
    """A copy of the `kind` fixture whose file lacks `tensor`."""
    src = tmp_path / f"{kind}-without"
    shutil.copytree(DATA / kind, src)
    tensors = load_file(src / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


def test_fp8_without_its_scale_is_named(tmp_path):
    src = fixture_without("fp8", "model.layers.0.self_attn.k_proj.weight_scale", tmp_path)
    with pytest.raises(Exception, match="model.layers.0.self_attn.k_proj.weight: quantized values without a weight_scale"):
        import_sparse(src, tmp_path / "out", tile=16)


def test_transformers_loaders_refuse_the_format_and_point_at_import():
    with pytest.raises(HFLoadError, match="sparse-24-bitmask checkpoint.*patchc import"):
        load_hf_causal(DATA / "bf16")


def test_cli_import_and_its_errors(tmp_path, capsys):
    """In this process (`python -m patchc` is `main`: tests/test_cli.py runs it as a process)."""
    from patchc.job.cli import main
    from patchc.job.recover import load_any_plan  # what `patchc generate` / `patchc tune` read

    assert main(["import", str(DATA / "fp8"), "--out", str(tmp_path / "out"), "--tile", "16", "16"]) == 0
    out = capsys.readouterr().out
    assert "72 of 72 tiles 2:4" in out and "patchc.from_pretrained" in out
    assert set(load_any_plan(tmp_path / "out").layers) == set(load_plan(tmp_path / "out").layers)

    assert main(["import", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing" in err
    assert not (tmp_path / "x").exists()

    assert main(["prune", "--model", str(DATA / "bf16"), "--steps", "1", "--no-baselines", "--out",
                 str(tmp_path / "r")]) == 2
    assert "patchc import" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_sharded_checkpoint_imports_the_same(tmp_path):
    """Shards with an index, one layer's three tensors spread over both: the same plan as the single file."""
    src = tmp_path / "sharded"
    src.mkdir()
    shutil.copy(DATA / "bf16" / "config.json", src / "config.json")
    tensors = load_file(DATA / "bf16" / "model.safetensors")
    names = sorted(tensors)
    first = {k for k in names[: len(names) // 2]} | {"model.layers.1.mlp.up_proj.bitmask"}
    shards = {"model-00001-of-00002.safetensors": {k: tensors[k] for k in names if k in first},
              "model-00002-of-00002.safetensors": {k: tensors[k] for k in names if k not in first}}
    for name, part in shards.items():
        save_file(part, src / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, part in shards.items() for k in part}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    save_word_tokenizer(src)
    (src / "original").mkdir()  # Meta's own weights beside the HF ones: never copied along
    (src / "original" / "consolidated.00.pth").write_bytes(b"\0" * 1024)
    import_sparse(src, tmp_path / "a", tile=16)
    assert patchc.export.load_tokenizer(tmp_path / "a").encode("the cat sat") == [1, 3, 4, 5]
    from patchc.export.importing import write_decoded

    (tmp_path / "decoded").mkdir()
    write_decoded(src, tmp_path / "decoded", file_bytes=4096)  # a few tensors a file, whatever the shards held
    names = {p.name for p in (tmp_path / "decoded").iterdir()}
    assert {"model.safetensors.index.json", "config.json", "tokenizer.json"} <= names
    assert "original" not in names
    weight_map = json.loads((tmp_path / "decoded" / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > len(shards) and files == sorted(n for n in names if n.endswith(".safetensors"))
    decoded = {k: t for f in files for k, t in load_file(tmp_path / "decoded" / f).items()}
    assert set(decoded) == set(weight_map) and set(decoded) == set(load_file(DATA / "truth.safetensors"))
    for key, t in load_file(DATA / "truth.safetensors").items():
        assert torch.equal(decoded[key], t), key
    import_sparse(DATA / "bf16", tmp_path / "b", tile=16)
    a, b = load_plan(tmp_path / "a"), load_plan(tmp_path / "b")
    assert set(a.layers) == set(b.layers) and len(a.layers) == BLOCK_LINEARS
    for fqn in a.layers:
        assert torch.equal(a.layers[fqn].to_dense(), b.layers[fqn].to_dense()), fqn


def test_decoding_holds_one_files_worth_of_tensors_not_a_shard(tmp_path, monkeypatch):
    """write_decoded writes the decoded tensors away in files of `file_bytes`: with 1 byte (a file per tensor),
    at most one earlier decoded tensor is alive when the next one is decoded (the progress bar's loop holds the
    last it handed out), however large the checkpoint's shard: it used to hold the whole decoded shard."""
    import weakref

    from patchc.export import importing

    made: list[weakref.ref] = []
    alive_when_decoding = []
    real = importing.decoded_tensors

    def tracked(*args, **kwargs):
        for key, t in real(*args, **kwargs):
            alive_when_decoding.append(sum(r() is not None for r in made))
            made.append(weakref.ref(t))
            yield key, t
            del t

    monkeypatch.setattr(importing, "decoded_tensors", tracked)
    (tmp_path / "d").mkdir()
    importing.write_decoded(DATA / "bf16", tmp_path / "d", file_bytes=1)
    assert len(made) == len(load_file(DATA / "truth.safetensors")) and max(alive_when_decoding) <= 1


def test_a_name_in_the_local_hugging_face_cache_imports(tmp_path):
    """`patchc import org/name` reads the cached snapshot (offline), sparse-24-bitmask included."""
    repo = tmp_path / "hub" / "models--acme--tiny-2of4"
    shutil.copytree(DATA / "fp8", repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "patchc", "import", "acme/tiny-2of4", "--out", str(tmp_path / "out"),
                           "--tile", "16", "16"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bfloat16: 72 of 72 tiles 2:4" in proc.stdout  # the dtype the cached config names
    assert len(load_plan(tmp_path / "out").layers) == BLOCK_LINEARS


@pytest.mark.parametrize("granularity", ["tensor", "channel", "group", "block"])
def test_int8_values_dequantize_with_every_scale_layout(granularity):
    """W8A8-style int8 values: W = q * s, s per tensor / output channel / group of 8 columns / 8x8 block."""
    from patchc.export.legacy import decode_24_bitmask

    n, k = 16, 32
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    keep = torch.zeros(n, k // 4, 4, dtype=torch.bool)
    keep.scatter_(-1, torch.rand(n, k // 4, 4, generator=gen).topk(2, -1).indices, True)
    keep = keep.reshape(n, k)
    bits = (keep.reshape(n, k // 8, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    shape = {"tensor": (1,), "channel": (n, 1), "group": (n, k // 8), "block": (n // 8, k // 8)}[granularity]
    scale = (torch.rand(shape, generator=gen) + 0.5).to(torch.bfloat16)
    rows, cols = torch.arange(n)[:, None], torch.arange(k)[None, :]  # each weight's own scale, by its indices
    per_weight = {"tensor": lambda: scale.float().reshape(1, 1).expand(n, k),
                  "channel": lambda: scale.float()[rows.expand(n, k), 0],
                  "group": lambda: scale.float()[rows, cols // 8],
                  "block": lambda: scale.float()[rows // 8, cols // 8]}[granularity]()
    want = (q.float() * keep * per_weight).to(torch.bfloat16)
    w, mask = decode_24_bitmask(q[keep].reshape(n, k // 2), bits, torch.tensor([[n], [k]]), "fc.weight", scale=scale)
    assert torch.equal(mask, keep) and w.dtype == torch.bfloat16
    torch.testing.assert_close(w, want, atol=0, rtol=0)
    with pytest.raises(Exception, match="fc.weight: asymmetric"):
        decode_24_bitmask(q[keep].reshape(n, k // 2), bits, torch.tensor([[n], [k]]), "fc.weight", scale=scale,
                          zero_point=torch.ones(n, 1, dtype=torch.int8))
    with pytest.raises(Exception, match=r"fc.weight: weight_scale of shape \(3,\) does not tile"):
        decode_24_bitmask(q[keep].reshape(n, k // 2), bits, torch.tensor([[n], [k]]), "fc.weight",
                          scale=torch.ones(3, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_imported_model_on_gpu_matches_a_dense_model_of_the_same_weights(dtype, tmp_path):
    """The hybrid kernels serve an imported sparse-24-bitmask model; compared with cuBLAS on the truth weights."""
    import_sparse(DATA / "fp8", tmp_path / "out", tile=16)
    served = patchc.from_pretrained(tmp_path / "out", device="cuda", dtype=dtype)
    reference = truth_model(fp8_expected(load_file(DATA / "truth.safetensors"))).to("cuda", dtype)
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        for rows in (1, 4):  # decode-sized and larger batches take different kernels
            got, want = served(ids[:rows]).logits.float(), reference(ids[:rows]).logits.float()
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_the_unstructured_sparse_bitmask_layout_imports_too(tmp_path):
    """compressed-tensors' `sparse-bitmask` (written by 0.14 itself): the same 2:4 model, the same plan."""
    summary = import_sparse(DATA / "bitmask", tmp_path / "out", tile=16)
    assert (summary.layout, summary.sparse_tiles, summary.dense_tiles) == ("sparse-bitmask", 72, 0)
    truth = load_file(DATA / "truth.safetensors")
    for fqn, layer in load_plan(tmp_path / "out").layers.items():
        torch.testing.assert_close(layer.to_dense(), truth[fqn], atol=0, rtol=0)


def test_sparse_bitmask_parts_are_checked_against_each_other():
    from patchc.export.legacy import decode_bitmask

    tensors = load_file(DATA / "bitmask" / "model.safetensors")
    parts = [tensors[f"model.layers.0.mlp.up_proj.{p}"] for p in ("compressed", "bitmask", "shape", "row_offsets")]
    w, mask = decode_bitmask(*parts, "up.weight")
    assert torch.equal(w, load_file(DATA / "truth.safetensors")["model.layers.0.mlp.up_proj.weight"])
    values, bits, shape, offsets = parts
    with pytest.raises(Exception, match="up.weight: 1023 compressed values for 1024 bits set"):
        decode_bitmask(values[:-1], bits, shape, offsets, "up.weight")
    with pytest.raises(Exception, match="up.weight: row_offsets do not match"):
        decode_bitmask(values, bits, shape, offsets.flip(0), "up.weight")
