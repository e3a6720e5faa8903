"""Mask file interop: PATCH / MaskLLM .npz round trips and the errors on files that do not fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from patchc.pruning.mask_files import detect_format, load_npz, read_meta, save_npz
from patchc.pruning import oneshot
from patchc.ir import TilePlan


def _masks(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "up.weight": torch.rand(model.up.weight.shape, generator=g) > 0.5,  # 40 x 24 = 960 bits
        "down.weight": torch.rand(model.down.weight.shape, generator=g) > 0.3,  # 18 x 40 = 720 bits
        "odd.weight": torch.rand(model.odd.weight.shape, generator=g) > 0.5,  # 24 x 18 = 432 bits
    }


@pytest.mark.parametrize("fmt", ["patch", "maskllm"])
def test_round_trip_exact(tiny_mlp, tmp_path, fmt):
    masks = _masks(tiny_mlp)
    masks["odd.weight"][0, :5] = torch.tensor([True, False, True, True, False])  # 432 bits: whole bytes
    path = save_npz(masks, tmp_path / "m.npz", format=fmt)
    assert path == tmp_path / "m.npz" and sorted(p.name for p in tmp_path.iterdir()) == ["m.npz"]
    back = load_npz(path, tiny_mlp)
    assert sorted(back) == sorted(masks)
    for fqn, m in masks.items():
        assert back[fqn].dtype == torch.bool and torch.equal(back[fqn], m), fqn
    assert detect_format(list(np.load(path).files)) == fmt


def test_file_layout_matches_release_formats(tiny_mlp, tmp_path):
    masks = _masks(tiny_mlp)
    save_npz(masks, tmp_path / "p.npz", format="patch", meta={"sparsity": 0.35})
    with np.load(tmp_path / "p.npz") as z:
        assert sorted(z.files) == sorted(["__meta__"] + [k for f in masks for k in (f, f + ".__shape__")])
        assert z["up.weight"].dtype == np.uint8 and z["up.weight"].shape == (960 // 8,)
        np.testing.assert_array_equal(z["up.weight"], np.packbits(masks["up.weight"].numpy().reshape(-1)))
        assert z["down.weight.__shape__"].dtype == np.int64 and z["down.weight.__shape__"].tolist() == [18, 40]
        assert z["__meta__"].shape == () and z["__meta__"].dtype.kind == "U"
        assert json.loads(str(z["__meta__"]))["sparsity"] == 0.35
    assert read_meta(tmp_path / "p.npz")["producer"] == "patchc"
    save_npz(masks, tmp_path / "q", format="maskllm")  # no ".npz" appended
    with np.load(tmp_path / "q") as z:
        assert sorted(z.files) == sorted(f + ".mask" for f in masks)
    assert read_meta(tmp_path / "q") == {}


def test_plan_round_trip(tiny_mlp, tmp_path):
    masks = oneshot(tiny_mlp, "magnitude", "2:4", layers=["up.weight", "down.weight"], progress=False)
    plan = TilePlan.from_masks(tiny_mlp, masks, tile=(8, 8))
    for fmt in ("patch", "maskllm"):
        save_npz(plan, tmp_path / f"{fmt}.npz", format=fmt)
        back = load_npz(tmp_path / f"{fmt}.npz", tiny_mlp, strict=False)
        assert sorted(back) == sorted(masks)
        for fqn in masks:
            assert torch.equal(back[fqn], masks[fqn])
        plan2 = TilePlan.from_masks(tiny_mlp, back, tile=(8, 8))
        for fqn in masks:
            assert torch.equal(plan2.layers[fqn].to_dense(), plan.layers[fqn].to_dense())
    assert read_meta(tmp_path / "patch.npz")["layers"]["up.weight"]["tile"] == [8, 8]


def _write(path, **arrays):
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def test_mismatches_are_listed(tiny_mlp, tmp_path):
    masks = _masks(tiny_mlp)
    bits = {k: np.packbits(v.numpy().reshape(-1)) for k, v in masks.items()}
    # PATCH: one unexpected name, one wrong shape, one wrong packed length, one missing layer.
    _write(
        tmp_path / "bad.npz",
        __meta__=np.asarray("{}"),
        **{"layers.9.fc.weight": bits["up.weight"], "layers.9.fc.weight.__shape__": np.array([40, 24])},
        **{"up.weight": bits["up.weight"], "up.weight.__shape__": np.array([24, 40])},
        **{"down.weight": bits["down.weight"][:-1], "down.weight.__shape__": np.array([18, 40])},
    )
    with pytest.raises(ValueError) as info:
        load_npz(tmp_path / "bad.npz", tiny_mlp)
    msg = str(info.value)
    assert "bad.npz" in msg and "patch mask file" in msg
    assert "unexpected: layers.9.fc.weight" in msg
    assert "up.weight: file (24, 40) vs model (40, 24)" in msg
    assert "down.weight: 89 uint8 values" in msg and "vs 90 uint8 for shape (18, 40)" in msg
    assert "missing" not in msg  # odd.weight (K = 18) has no 2:4 groups: not expected

    # MaskLLM: no shapes, so a wrong shape shows as a wrong packed length.
    _write(tmp_path / "bad2.npz", **{"up.weight.mask": bits["down.weight"], "bogus.mask": bits["up.weight"]})
    with pytest.raises(ValueError) as info:
        load_npz(tmp_path / "bad2.npz", tiny_mlp, strict=False)
    msg = str(info.value)
    assert "maskllm mask file" in msg and "unexpected: bogus" in msg
    assert "up.weight: 90 uint8 values (shape (90,)) vs 120 uint8 for shape (40, 24)" in msg
    assert "missing" not in msg

    # Shape entry without its mask, and a file of neither format.
    _write(tmp_path / "half.npz", **{"up.weight.__shape__": np.array([40, 24])})
    with pytest.raises(ValueError, match=r"up.weight \(has 'up.weight.__shape__' but no packed mask\)"):
        load_npz(tmp_path / "half.npz", tiny_mlp, strict=False)
    _write(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a PATCH mask file"):
        load_npz(tmp_path / "other.npz", tiny_mlp)
    with pytest.raises(ValueError, match="cannot read"):
        (tmp_path / "junk.npz").write_bytes(b"junk")
        load_npz(tmp_path / "junk.npz", tiny_mlp)


def test_partial_files_need_strict_false(tiny_mlp, tmp_path):
    save_npz({"up.weight": torch.ones(40, 24, dtype=torch.bool)}, tmp_path / "m.npz")
    with pytest.raises(ValueError, match=r"missing: down.weight \(a masked layer of the model\)\n"):
        load_npz(tmp_path / "m.npz", tiny_mlp)
    assert list(load_npz(tmp_path / "m.npz", tiny_mlp, strict=False)) == ["up.weight"]
    # A state_dict works as the reference too.
    assert list(load_npz(tmp_path / "m.npz", tiny_mlp.state_dict(), strict=False)) == ["up.weight"]


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="fc.weight: masks must be 2-D"):
        save_npz({"fc.weight": torch.ones(4, dtype=torch.bool)}, tmp_path / "m.npz")
    with pytest.raises(ValueError, match="unknown format"):
        save_npz({}, tmp_path / "m.npz", format="safetensors")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def _transposed_and_expert_models():
    """A GPT-2 (Conv1D weights stored (K, N)) and a Qwen2-MoE (fused 3-D expert weights), tiny and random."""
    import transformers as t

    torch.manual_seed(0)
    gpt2 = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_embd=64, n_layer=1, n_head=4, n_positions=32))
    moe = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    return {"gpt2": gpt2.eval(), "qwen2_moe": moe.eval()}


@pytest.mark.parametrize("name, read", [
    ("model.layers.0.mlp.experts.gate_up_proj.3", ("model.layers.0.mlp.experts.gate_up_proj", 3)),
    ("model.layers.0.mlp.experts.down_proj.12", ("model.layers.0.mlp.experts.down_proj", 12)),
    ("model.layers.0.mlp.up_proj.weight", ("model.layers.0.mlp.up_proj.weight", None)),
    ("7", ("7", None)), ("w.3a", ("w.3a", None)), ("w.", ("w.", None))])
def test_expert_slice_reads_back_the_layer_names_of_experts_and_only_those(name, read):
    """Mask files, plans and the backend all tell "<param>.<e>" from a plain weight by this one reading."""
    from patchc.ir.targets import expert_slice, layer_name

    assert expert_slice(name) == read
    assert layer_name(*read) == name


@pytest.mark.parametrize("family", ["gpt2", "qwen2_moe"])
def test_oneshot_masks_of_conv1d_and_experts_plan_save_and_load_as_they_are(tmp_path, family):
    """`oneshot` gives a Conv1D weight's mask as (N, K), the transpose of the stored weight, and one mask per
    expert as "<param>.<e>". `TilePlan.from_masks(model, ...)` plans them (it refused both), and both file
    formats give them back exactly through the model (the MaskLLM file came back scrambled for GPT-2: same
    bit count, the stored shape); the plan serves what the masks say."""
    import copy

    import patchc

    model = _transposed_and_expert_models()[family]
    masks = oneshot(model, method="magnitude", pattern="2:4", progress=False)
    assert any(name[-1].isdigit() for name in masks) == (family == "qwen2_moe")
    plan = TilePlan.from_masks(model, masks, tile=(16, 16))
    plan.verify()
    assert set(plan.layers) == set(masks) and plan.density == pytest.approx(0.5)
    for fqn, mask in masks.items():
        assert torch.equal(plan.layers[fqn].mask(), mask), fqn
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want = plan.apply(copy.deepcopy(model))(ids).logits
        got = patchc.compile(model, plan, tune=False)(ids).logits  # fp32 rounding apart (1.5e-7 here)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for fmt in ("patch", "maskllm"):
        back = load_npz(save_npz(plan, tmp_path / f"{fmt}.npz", format=fmt), model)
        assert set(back) == set(masks) and all(torch.equal(back[k], masks[k]) for k in masks), fmt
    with pytest.raises(Exception, match=r"from_weights: .* is a transposed \(Conv1D\) or fused-expert weight .*"
                                        r"TilePlan.from_linears\(model\)"):  # it read them as stored, planning nonsense
        TilePlan.from_weights(plan.apply(copy.deepcopy(model)), tile=(16, 16))
    if family == "qwen2_moe":  # a state dict cannot say which weights hold experts: the error says what to pass
        with pytest.raises(ValueError, match=r"gate_up_proj\.0 \(an expert of a fused weight: pass the model"):
            load_npz(tmp_path / "patch.npz", model.state_dict())
        with pytest.raises(Exception, match=r"is read through the model: pass it, not its state"):
            TilePlan.from_masks(model.state_dict(), masks, tile=(16, 16))
    else:
        with pytest.raises(Exception, match=r"Conv1D weight is stored transposed: pass the model"):
            TilePlan.from_masks(model.state_dict(), masks, tile=(16, 16))


def _damaged_files(tmp_path):
    """{name: (file, the reason named)}: files numpy refuses with BadZipFile, EOFError, TypeError, or advice."""
    np.savez(tmp_path / "ok.npz", **{"up.weight.mask": np.arange(120, dtype=np.uint8)})
    whole = (tmp_path / "ok.npz").read_bytes()
    flipped = bytearray(whole)
    flipped[whole.find(b"\x93NUMPY") + 80] ^= 0xFF  # inside the member's data: its CRC no longer fits
    np.save(tmp_path / "one.npy", np.zeros(3))
    np.savez(tmp_path / "objects.npz", a=np.array([{"x": 1}], dtype=object))
    files = {"cut": (whole[: len(whole) // 2], "a damaged zip archive: File is not a zip file"),
             "empty": (b"", "empty"),
             "member": (bytes(flipped), "a damaged zip archive: Bad CRC-32 for file 'up.weight.mask.npy'"),
             "npy": ((tmp_path / "one.npy").read_bytes(), "one .npy array, not a .npz archive of masks"),
             "text": (b"hello\n", "neither a .npz (zip) archive nor a .npy array"),
             "objects": ((tmp_path / "objects.npz").read_bytes(), "holds Python objects, not arrays of numbers")}
    for name, (data, _) in files.items():
        (tmp_path / f"{name}.npz").write_bytes(data)
    return {name: (tmp_path / f"{name}.npz", why) for name, (_, why) in files.items()}


def test_a_file_numpy_cannot_read_is_named_with_a_short_reason(tiny_mlp, tmp_path):
    for name, (path, why) in _damaged_files(tmp_path).items():
        # read_meta reads __meta__ alone (a 7B file's masks are GBs): a damaged mask member is load_npz's to find
        readers = [lambda p: load_npz(p, tiny_mlp)] + ([read_meta] if name not in ("member", "objects") else [])
        for read in readers:
            with pytest.raises(ValueError) as err:
                read(path)
            assert str(err.value) == f"{path}: cannot read as a .npz mask file ({why})", name
            assert "allow_pickle" not in str(err.value)
    np.savez(tmp_path / "meta.npz", __meta__=np.array("{broken"))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'meta.npz'}: its __meta__ entry is not JSON \(Expecting"):
        read_meta(tmp_path / "meta.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'other.npz'}: not a PATCH mask file"):
        load_npz(tmp_path / "other.npz", tiny_mlp)
