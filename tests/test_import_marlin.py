"""`patchc import` of compressed-tensors' ``marlin-24`` checkpoints: int4 / int8 2:4 weights in Sparse-Marlin's layout.

The fixtures were written by compressed-tensors 0.14.0 itself (`data/compressed_tensors/make_fixtures.py`),
beside the library's own quantized integers q and scales: the decoder must give q * scale bit for bit, and
the served model must match a plain transformers model holding those weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

import patchc  # noqa: E402
from patchc.export import load_plan, marlin24  # noqa: E402
from patchc.export.importing import import_sparse  # noqa: E402
from patchc.ir import TILE_SPARSE24, PlanError  # noqa: E402
from patchc.models.hf import HFLoadError, load_hf_causal  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "compressed_tensors"
IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 40, 63], [3, 7, 11, 13, 19, 23, 29, 31]])


def truth(path: Path) -> dict[str, torch.Tensor]:
    """{"<module>.weight": q * scale in fp16} from the library's integers and scales (scale per group of K)."""
    t = load_file(path)
    out = {}
    for key in (k for k in t if k.endswith(".q")):
        q, s = t[key].float(), t[key.removesuffix(".q") + ".scale"].float()
        out[key.removesuffix(".q") + ".weight"] = (q * s.repeat_interleave(q.shape[1] // s.shape[1], 1)).half()
    return out


def decode_all(checkpoint: Path, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    st = load_file(checkpoint)
    return {name: marlin24.decode_marlin24(*(st[name.removesuffix("weight") + p] for p in
                                             ("weight_packed", "scale_packed", "meta")), name)[0] for name in want}


@pytest.mark.parametrize("checkpoint, truth_file, groups", [
    ("marlin24/model.safetensors", "marlin24-truth.safetensors", {1, 3}),  # int4, a scale per 128 columns
    ("marlin24-w8.safetensors", "marlin24-w8.safetensors", {1}),  # int8, a scale per output channel
])
def test_marlin24_values_decode_to_the_librarys_integers_times_scales(checkpoint, truth_file, groups):
    want = truth(DATA / truth_file)
    got = decode_all(DATA / checkpoint, want)
    seen = set()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=0, rtol=0)  # bit for bit
        nz = (got[name] != 0).reshape(w.shape[0], -1, 4).sum(-1)
        assert int(nz.max()) <= 2, f"{name}: 2:4 broken"
        seen.add(load_file(DATA / truth_file)[name.removesuffix("weight") + "scale"].shape[1])
    assert seen == groups


def test_each_part_of_the_layout_matters(monkeypatch):
    """Undoing Marlin's meta swizzle, its scale order or its 1024-value order the plain way fails."""
    want = truth(DATA / "marlin24-truth.safetensors")
    down = "model.layers.0.mlp.down_proj.weight"  # 3 scale groups a row: the only permuted scales
    plain_rows = lambda n, ncols: torch.arange(n * ncols).reshape(ncols, n).t().reshape(-1)  # noqa: E731
    for attr, wrong, broken in (("meta_offsets", plain_rows, set(want)),
                                ("SCALE_ORDER", torch.arange(64), {down}),
                                ("marlin_order", lambda bits: torch.arange(1024), set(want))):
        with monkeypatch.context() as m:
            m.setattr(marlin24, attr, wrong)
            got = decode_all(DATA / "marlin24" / "model.safetensors", want)
        assert {n for n in want if not torch.equal(got[n], want[n])} == broken, attr


def test_a_marlin24_checkpoint_imports_and_serves(tmp_path, monkeypatch):
    # The import is on trial, not the kernels (their interpreter tests are elsewhere): serving through the
    # plain-PyTorch path reads the same packed values and metadata, in 1 s where the interpreter takes 20.
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    want = truth(DATA / "marlin24-truth.safetensors")
    summary = import_sparse(DATA / "marlin24", tmp_path / "out", tile=16)
    assert (summary.layout, summary.dtype, summary.layers, summary.dense_tiles) == ("marlin-24", "float16", 7, 0)
    assert "served dequantized, as float16 2:4 tiles: larger than the checkpoint" in summary.format()
    plan = load_plan(tmp_path / "out")
    assert set(plan.layers) == set(want)
    for name, layer in plan.layers.items():
        assert bool((layer.kinds == TILE_SPARSE24).all()), name
        torch.testing.assert_close(layer.to_dense(), want[name], atol=0, rtol=0)

    config = json.loads((DATA / "marlin24" / "config.json").read_text())
    config.pop("quantization_config")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    state = {k: v.float() for k, v in load_file(DATA / "marlin24" / "model.safetensors").items() if k.endswith("weight")}
    model.load_state_dict({**state, **{k: v.float() for k, v in want.items()}}, strict=True)
    served = patchc.from_pretrained(tmp_path / "out", dtype=torch.float32)  # fp32: only the kernel order differs
    with torch.no_grad():
        torch.testing.assert_close(served(IDS).logits, model(IDS).logits, atol=1e-5, rtol=1e-5)


def test_marlin24_errors_name_the_layer(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DATA / "marlin24", src)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.scale_packed"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PlanError, match="model.layers.0.mlp.up_proj.weight: tensor 'model.layers.0.mlp.up_proj.scale_packed' missing"):
        import_sparse(src, tmp_path / "out", tile=16)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".patchc-import.*"))

    tensors = load_file(DATA / "marlin24" / "model.safetensors")
    del tensors["model.layers.0.mlp.gate_proj.meta"]  # dense packed int4: nothing says which 2 of 4 are kept
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PlanError, match="layer model.layers.0.mlp.gate_proj.weight is packed int4 / fp4"):
        import_sparse(src, tmp_path / "out", tile=16)

    st = load_file(DATA / "marlin24" / "model.safetensors")
    m = "model.layers.0.mlp.down_proj"
    with pytest.raises(PlanError, match=f"layer {m}.weight: meta is a torch.int32"):
        marlin24.decode_marlin24(st[m + ".weight_packed"], st[m + ".scale_packed"], st[m + ".meta"].int(), m + ".weight")
    with pytest.raises(PlanError, match=f"layer {m}.weight: weight_packed holds 16 values per int32"):
        marlin24.decode_marlin24(st[m + ".weight_packed"][:, :128], st[m + ".scale_packed"], st[m + ".meta"], m + ".weight")
    with pytest.raises(PlanError, match=r"scale_packed is a torch.float16 tensor of shape \(3, 64\), expected float \(groups, 128\) with groups dividing K=384"):
        marlin24.decode_marlin24(st[m + ".weight_packed"], st[m + ".scale_packed"][:, :64], st[m + ".meta"], m + ".weight")


def test_marlin24_serves_in_fp16_unless_told_otherwise(tmp_path):
    """Its values are int4 times fp16 scales: fp16 numbers, which a bf16 config would round."""
    src = tmp_path / "src"
    shutil.copytree(DATA / "marlin24", src)
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = "bfloat16"  # as the released w4a16 checkpoints' configs say
    (src / "config.json").write_text(json.dumps(config))
    assert import_sparse(src, tmp_path / "auto", tile=16).dtype == "float16"
    assert import_sparse(src, tmp_path / "bf16", tile=16, dtype=torch.bfloat16).dtype == "bfloat16"


def test_transformers_loaders_point_a_marlin24_checkpoint_at_import():
    with pytest.raises(HFLoadError, match="marlin-24 checkpoint.*patchc import"):
        load_hf_causal(DATA / "marlin24")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_imported_marlin24_model_on_gpu_matches_cublas_on_the_same_weights(tmp_path):
    """The hybrid kernels serve the dequantized int4 weights; compared with a plain model holding q * scale."""
    want = truth(DATA / "marlin24-truth.safetensors")
    import_sparse(DATA / "marlin24", tmp_path / "out", tile=16)
    served = patchc.from_pretrained(tmp_path / "out", device="cuda")
    config = json.loads((DATA / "marlin24" / "config.json").read_text())
    config.pop("quantization_config")
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).half().eval()
    state = {k: v for k, v in load_file(DATA / "marlin24" / "model.safetensors").items() if k.endswith("weight")}
    reference.load_state_dict({**state, **want}, strict=True)
    reference.cuda()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        for rows in (1, 4):  # decode-sized and larger batches take different kernels
            got, ref = served(ids[:rows]).logits.float(), reference(ids[:rows]).logits.float()
            torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)
