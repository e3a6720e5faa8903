"""Quantized checkpoints: FP8 / MXFP4 / compressed-tensors load as dense fp32 weights, others are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from patchc.job import cli
from patchc.models.hf import HFLoadError, load_hf_causal, transformers_major

transformers = pytest.importorskip("transformers")
BLOCK = 32  # FP8 scale blocks of the tiny checkpoint
FP8_MAX = 448.0


def dense_dir(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    return tmp_path / "dense"


def fp8_dir(tmp_path):
    """The dense checkpoint as a block-wise FP8 one (DeepSeek-V3 / Qwen3-FP8 layout: e4m3 weights, one
    `weight_scale_inv` per BLOCK × BLOCK block of every projection); returns (folder, {name: dequantized})."""
    from safetensors.torch import load_file, save_file

    dense = dense_dir(tmp_path)
    out = tmp_path / "fp8"
    out.mkdir()
    tensors, expected = {}, {}
    for name, w in load_file(dense / "model.safetensors").items():
        if not name.endswith("proj.weight"):
            tensors[name] = w
            continue
        n, k = w.shape
        blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        scale = blocks.abs().amax((1, 3)) / FP8_MAX
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        tensors[name], tensors[name.replace("weight", "weight_scale_inv")] = q.reshape(n, k), scale.float()
        expected[name] = (q.float() * scale[:, None, :, None]).reshape(n, k)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (out / "config.json").write_text(json.dumps(config))
    return out, expected


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_dir(tmp_path):
    """A tiny gpt-oss whose experts are stored as MXFP4, as gpt-oss is released: per 32 weights of a row one
    power-of-two scale (uint8, bias 127) and 16 bytes of two e2m1 codes each; returns (folder, {name: dequantized})."""
    from safetensors.torch import load_file, save_file

    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64, sliding_window=16,
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    out = tmp_path / "mxfp4"
    out.mkdir()
    tensors, expected = {}, {}
    for name, p in load_file(tmp_path / "dense" / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = p
            continue
        rows = p.transpose(1, 2)  # stored (E, K, N); the checkpoint quantizes rows of (E, N, K)
        groups = rows.reshape(*rows.shape[:2], -1, 32)
        exponent = torch.ceil(torch.log2(groups.abs().amax(-1) / 6.0))
        codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - FP4).abs().argmin(-1).to(torch.uint8)
        tensors[name + "_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        tensors[name + "_scales"] = (exponent + 127).to(torch.uint8)
        expected[name] = (FP4[codes.long()] * torch.exp2(exponent)[..., None]).reshape(rows.shape).transpose(1, 2)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, expected


def relabel(folder, quantization_config):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return folder


def check_dequantized(model, dense, expected, rtol, count):
    """Quantized weights equal their own dequantization (up to `rtol`: transformers may round through bf16),
    every other weight is the dense checkpoint's, all fp32; no quantization left in the config."""
    assert getattr(model.config, "quantization_config", None) is None  # an export writes a dense config
    for (name, w), ref in zip(model.named_parameters(), dense.parameters(), strict=True):
        assert w.dtype == torch.float32, name
        if name in expected:
            torch.testing.assert_close(w.detach(), expected[name], rtol=rtol, atol=0, msg=name)
            assert not torch.equal(w, ref), name  # it really went through the quantized format
        else:
            assert torch.equal(w, ref), name
    assert len(expected) == count


@pytest.mark.parametrize("gpu_present", [False, True])
def test_fp8_checkpoint_loads_as_dense_fp32_weights(tmp_path, monkeypatch, gpu_present):
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate installed")
    folder, expected = fp8_dir(tmp_path)
    dense, _ = load_hf_causal(tmp_path / "dense")
    if gpu_present:  # where a GPU is present transformers keeps FP8 quantized unless told to dequantize
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    if transformers_major() < 5:
        with pytest.raises(HFLoadError, match=r"fp8: its weights are FP8; transformers 4\..* pip install -U"):
            load_hf_causal(folder)
        return
    model, _ = load_hf_causal(folder)
    check_dequantized(model, dense, expected, rtol=2.0**-8, count=2 * 7)  # 2 layers of q, k, v, o, gate, up, down
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith("_proj"))


def test_mxfp4_gpt_oss_loads_as_dense_fp32_experts(tmp_path):
    folder, expected = mxfp4_dir(tmp_path)
    dense, _ = load_hf_causal(tmp_path / "dense")
    model, _ = load_hf_causal(folder)
    check_dequantized(model, dense, expected, rtol=0, count=2 * 2)  # e2m1 times a power of two: exact in bf16 too


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_other_quantized_checkpoints_are_refused_by_name(tmp_path, capsys, method):
    folder = relabel(dense_dir(tmp_path), {"quant_method": method, "bits": 4})
    with pytest.raises(HFLoadError, match=rf"dense: its weights are quantized \({method}\); .*dequantize only fp8, "
                                          r"mxfp4, compressed-tensors checkpoints .*unquantized checkpoint"):
        load_hf_causal(folder)
    capsys.readouterr()
    assert cli.main(["prune", "--model", str(folder), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"quantized ({method})" in err, err
    assert not (tmp_path / "run").exists()


def test_a_dense_checkpoint_loads_without_quantization_arguments(tmp_path, monkeypatch):
    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: seen.update(kw) or real(*a, **kw))
    load_hf_causal(dense_dir(tmp_path))
    assert "quantization_config" not in seen and seen["dtype"] == torch.float32
