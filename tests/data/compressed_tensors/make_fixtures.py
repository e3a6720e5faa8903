"""Writes the compressed-tensors fixtures of tests/test_import_sparse.py with the library itself.

compressed-tensors 0.14.0 is the last release that writes its 2:4 ``sparse-24-bitmask`` format (0.15 dropped
it), so these files are what llm-compressor saved, not what patchc's reader expects. Run once, with that
release beside any torch / transformers (it needs no more of them than its own imports):

    pip install --no-deps --target /tmp/ct014 compressed-tensors==0.14.0 loguru
    PYTHONPATH=/tmp/ct014 python tests/data/compressed_tensors/make_fixtures.py

It writes, next to this file:

    truth.safetensors   the 2:4-pruned bf16 weights of a tiny random Llama (the expected result)
    bf16/               that model saved as sparse-24-bitmask, bf16 values
    bitmask/            the same saved as sparse-bitmask (the library's unstructured layout, which 2:4
                        checkpoints were saved in too): nonzeros + bitmask + row offsets
    fp8/                the same after FP8_DYNAMIC quantization (e4m3 per-channel weight scales, as
                        llm-compressor's "2of4-FP8-dynamic" releases), then sparse-24-bitmask
    moe/                a tiny random Qwen3-MoE, 2:4-pruned (router and LM head dense), as sparse-24-bitmask;
                        written only under transformers 4, whose experts are one nn.Linear each, as in the
                        released MoE checkpoints (transformers 5 fuses them into 3-D weights when it loads)
    moe-truth.safetensors  its pruned bf16 weights, under those per-expert names
    marlin24/           a tiny random fp16 Llama (hidden 128, MLP 384), 2:4-pruned, quantized W4A16 (int4,
                        symmetric, a scale per 128 input columns) and saved as marlin-24 (Sparse-Marlin's layout)
    marlin24-truth.safetensors  the library's own int4 values q (int8) and scales of each layer: W = q * scale
    marlin24-w8.safetensors     the MLP's down projection quantized to int8 with a scale per output channel,
                        in marlin-24, beside its q and scale ("<module>.q", "<module>.scale")
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.config import SparsityCompressionConfig
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False)


def pruned_model() -> transformers.LlamaForCausalLM:
    """A random bf16 Llama whose block linears keep the 2 largest magnitudes of every group of 4."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16  # config.json says "bfloat16", as released checkpoints do
    prune_24(model)
    return model


MOE_CONFIG = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
                  max_position_embeddings=64, tie_word_embeddings=False)


def prune_24(model: torch.nn.Module, skip: str = "lm_head") -> None:
    """Keep the 2 largest magnitudes of every group of 4 in each nn.Linear but `skip` and MoE routers."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and skip not in name and not name.endswith("mlp.gate"):
            w = mod.weight.data
            mags = w.float().abs().reshape(w.shape[0], -1, 4)
            keep = torch.zeros_like(mags, dtype=torch.bool).scatter_(-1, mags.topk(2, -1).indices, True)
            mod.weight.data = w * keep.reshape(w.shape)


def pruned_moe() -> torch.nn.Module:
    """A random bf16 Qwen3-MoE (transformers 4: one nn.Linear per expert projection), pruned 2:4."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE_CONFIG)).to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    prune_24(model)
    return model


MARLIN_CONFIG = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False)


def quantize_int(model: torch.nn.Module, preset: str) -> dict[str, torch.Tensor]:
    """Apply the `preset` weight scheme (W4A16 / W8A16) with absmax scales; returns {module: q, module_scale}
    where q are the library's own quantized integers (`compressed_tensors...forward.quantize`)."""
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.lifecycle.forward import quantize

    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    qmax = 2 ** (scheme.weights.num_bits - 1) - 1
    truth = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "weight_scale"):
            w = mod.weight.float()
            per = scheme.weights.group_size or w.shape[1]
            absmax = w.reshape(w.shape[0], -1, per).abs().amax(-1)
            mod.weight_scale.data = (absmax / qmax).to(mod.weight_scale.dtype)
            mod.quantization_status = QuantizationStatus.FROZEN
            q = quantize(x=mod.weight.to(torch.float16), scale=mod.weight_scale.to(torch.float16), zero_point=None,
                         args=scheme.weights)
            truth[f"{name}.q"] = q.to(torch.int8)
            truth[f"{name}.scale"] = mod.weight_scale.detach().to(torch.float16).clone()
    return truth


def save_marlin(preset: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Path]:
    """(compressed state, truth, folder) of the tiny fp16 Llama quantized with `preset`, as marlin-24."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MARLIN_CONFIG)).to(torch.float16)
    model.config.dtype = torch.float16
    prune_24(model)
    truth = quantize_int(model, preset)
    # llm-compressor's 2:4 + W4A16 recipes record the sparsity as "dense" beside the marlin-24 quantization format
    dense_24 = SparsityCompressionConfig.load_from_registry("dense", sparsity_structure="2:4", targets=["Linear"],
                                                            ignore=["lm_head"])
    compressor = ModelCompressor.from_pretrained_model(model, sparsity_config=dense_24, quantization_format="marlin-24")
    out = HERE / "marlin24"
    shutil.rmtree(out, ignore_errors=True)
    model.config.save_pretrained(out)
    state = compressor.compress(model)
    if preset == "W4A16":
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
        compressor.update_config(out)
    else:
        shutil.rmtree(out)
    return state, truth, out


def quantize_fp8(model: torch.nn.Module) -> None:
    """FP8_DYNAMIC, with the weight scales llm-compressor's minmax observer sets (per-channel absmax / 448)."""
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for mod in model.modules():
        if hasattr(mod, "weight_scale"):
            mod.weight_scale.data = (mod.weight.float().abs().amax(1, keepdim=True) / 448.0).to(mod.weight_scale.dtype)
            mod.quantization_status = QuantizationStatus.FROZEN


def save_compressed(model: torch.nn.Module, out: Path, quantized: bool, layout: str = "sparse-24-bitmask",
                    ignore: tuple[str, ...] = ("lm_head",)) -> None:
    sparsity = SparsityCompressionConfig.load_from_registry(layout, sparsity_structure="2:4",
                                                            targets=["Linear"], ignore=list(ignore))
    compressor = ModelCompressor.from_pretrained_model(model, sparsity_config=sparsity,
                                                       quantization_format="float-quantized" if quantized else None)
    shutil.rmtree(out, ignore_errors=True)
    model.config.save_pretrained(out)
    state = compressor.compress(model)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(out)
    print(out, json.loads((out / "config.json").read_text())["quantization_config"]["sparsity_config"]["format"])


def main() -> None:
    model = pruned_model()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(HERE / "truth.safetensors"),
              metadata={"format": "pt"})
    save_compressed(model, HERE / "bf16", quantized=False)
    save_compressed(model, HERE / "bitmask", quantized=False, layout="sparse-bitmask")
    model = pruned_model()
    quantize_fp8(model)
    save_compressed(model, HERE / "fp8", quantized=True)
    state, truth, _ = save_marlin("W8A16")
    down = "model.layers.0.mlp.down_proj"
    save_file({**{k: v.contiguous() for k, v in state.items() if k.startswith(down + ".")},
               **{k: v for k, v in truth.items() if k.startswith(down + ".")}},
              str(HERE / "marlin24-w8.safetensors"), metadata={"format": "pt"})
    state, truth, _ = save_marlin("W4A16")
    save_file(truth, str(HERE / "marlin24-truth.safetensors"), metadata={"format": "pt"})
    if int(transformers.__version__.split(".")[0]) < 5:
        model = pruned_moe()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(HERE / "moe-truth.safetensors"),
                  metadata={"format": "pt"})
        save_compressed(model, HERE / "moe", quantized=False, ignore=("lm_head", "re:.*mlp.gate$"))
    else:
        print("moe/ left as it is: it is written under transformers 4 (per-expert nn.Linear)")


if __name__ == "__main__":
    main()
