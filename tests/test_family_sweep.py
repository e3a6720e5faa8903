"""benchmarks/family_sweep.py: its shrinking rule, one family through every stage, and its summary."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_benchmark

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sweep():
    return load_benchmark("family_sweep")


def test_shrink_makes_every_size_small_and_keeps_each_kind_of_layer(sweep):
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "kv_lora_rank": 512, "use_cache": True, "tie_word_embeddings": False,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"] * 27,
              "per_layer_config": {"05": {"head_dim": 512}, "11": {"head_dim": 512}, "17": {"head_dim": 512}},
              "text_config": {"hidden_size": 2048, "num_hidden_layers": 16}}
    small = sweep.shrink(config)
    assert small["hidden_size"] == 64 and small["num_hidden_layers"] == 2 and small["num_attention_heads"] == 4
    assert small["num_key_value_heads"] == 4  # latent attention: one latent per head
    assert small["layer_types"] == ["sliding_attention", "full_attention"]
    assert small["per_layer_config"] == {"00": {"head_dim": 32}, "01": {"head_dim": 32}}
    assert small["text_config"] == {"hidden_size": 64, "num_hidden_layers": 2}
    assert small["use_cache"] is True and small["tie_word_embeddings"] is False  # booleans are not sizes
    assert config["hidden_size"] == 4096  # the caller's dict is left alone


def test_shrink_keeps_derived_sizes_in_step(sweep):
    """Sizes a config ties to others: a list with one entry per layer (Gemma 3n's widths, Laguna's heads) is cut
    and its sizes made small; latent attention's head sizes keep their sum (DeepSeek-V3's head_dim is the rope
    part, dots3's the whole query head); fields left None get a size."""
    deepseek = {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "qk_head_dim": 192, "head_dim": 64, "num_experts_per_tok": None,
                "intermediate_size": [16384] * 61, "num_attention_heads_per_layer": [64] * 61,
                "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 58}
    small = sweep.shrink(deepseek)
    heads = ("qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "head_dim")
    assert [small[k] for k in heads] == [8, 8, 16, 8]
    assert small["intermediate_size"] == [64, 64] and small["num_attention_heads_per_layer"] == [4, 4]
    assert small["mlp_layer_types"] == ["dense", "sparse"] and small["num_experts_per_tok"] == 2
    assert sweep.shrink({**deepseek, "head_dim": 192})["head_dim"] == 16
    four = sweep.shrink({"num_hidden_layers": 32, "layer_types": ["a", "b"] * 16}, layers=4)
    assert four["layer_types"] == ["a", "b"] * 2


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gptj", "mamba2", "zamba", "dory"])
def test_the_rule_and_its_table_build_families_it_did_not(sweep, model_type):
    """Types that did not build tiny under transformers 5.24 before the derived-size rules and FITS."""
    if model_type not in sweep.model_types():
        pytest.skip(f"this transformers has no {model_type}")
    config = sweep.tiny_config(model_type)
    assert config.num_hidden_layers <= 4 and getattr(config, "hidden_size", 64) == 64


def test_a_family_goes_through_every_stage(sweep, monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")  # as the sweep's child processes run
    result = sweep.check("llama")
    assert result["passed"] == "generate" == sweep.STAGES[-1] and "error" not in result
    assert result["generate"] == 3  # the prompt, the first decode step, a graph dynamic in the length
    assert result["layers"] == 14 and result["kept_dense"] == 0  # 7 projections x 2 layers, all served
    assert result["export"] == "dynamic"
    assert (result["graphs"], result["backend_ops"], result["backend_left_dense"]) == (1, 14, 0)  # no graph break
    assert (result["inferred_ops"], result["inferred_left_dense"]) == (14, 0)  # the same 14 read off the zeros


@pytest.mark.full  # the sweep's --experts passed through; tests/test_backend_experts.py serves batched_mm itself
def test_the_backend_stages_run_on_the_experts_implementation_asked_for(sweep, monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    result = sweep.check("qwen3_moe", experts="batched_mm")
    assert result["passed"] == "generate" and result["experts"] == "batched_mm" and "error" not in result
    assert result["backend_left_dense"] == 0 and result["backend_ops"] > 0


def test_a_config_the_rule_does_not_fit_is_not_counted_against_patchc(sweep):
    result = sweep.check("no_such_family")  # as a config whose validator refuses the rule's sizes
    assert result["passed"] is None and result["failed"] == "tiny" and "no_such_family" in result["error"]
    results = [result, {"type": "a", "passed": "generate", "export": "per-length"},
               {"type": "b", "passed": "generate", "kept_dense": 4, "backend_left_dense": 2},
               {"type": "c", "passed": "export", "failed": "masks", "error": "AssertionError: not close"},
               {"type": "d", "passed": "compile", "failed": "backend", "error": "AssertionError: not close"},
               {"type": "e", "passed": "generate", "backend_ops": 14, "inferred_ops": 12, "inferred_left_dense": 1},
               {"type": "f", "passed": "generate", "backend_ops": 14, "inferred_ops": 14, "inferred_left_dense": 0}]
    summary = sweep.summarise(results)
    assert (summary["types"], summary["built"], summary["whole_path"]) == (7, 6, 4)
    assert summary["inferred_differs"] == {"e": [14, 12, 1]}
    assert summary["not_built"] == ["no_such_family"] and summary["kept_dense"] == {"b": 4}
    assert summary["backend_left_dense"] == {"b": 2} and summary["per_length"] == ["a"]
    assert summary["failed"] == {"c": "masks: AssertionError: not close", "d": "backend: AssertionError: not close"}
    json.dumps(summary)  # goes to the results file as is


def test_the_offload_sweep_streams_a_family_and_names_a_read_outside_its_block(sweep, monkeypatch):
    """--offload: `tiny`, then the blocks streamed, prefetched and poisoned between their forwards; the model's own
    logits and greedy tokens, exactly. A block's weight read by code outside it turns the logits NaN."""
    result = sweep.check_offload("llama")
    assert result == {"type": "llama", "passed": "offload", "blocks": 2, "resident": result["resident"],
                      "generate": True, "prefetched": 7, "misses": 0}  # one a forward: logits, 6 generate steps
    summary = sweep.summarise([result, {"type": "x", "passed": "tiny", "failed": "offload", "error": "E: e"}],
                              "offload")
    assert summary["whole_path"] == 1 and summary["failed"] == {"x": "offload: E: e"}
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaModel.forward

    def peek(self, *args, **kwargs):  # reads a block's weight outside the block: a device mismatch on a GPU
        out = forward(self, *args, **kwargs)
        out.last_hidden_state = out.last_hidden_state + self.layers[0].mlp.up_proj.weight.sum()
        return out

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", peek)
    result = sweep.check_offload("llama")
    assert result["failed"] == "offload" and "the streamed logits differ" in result["error"]
