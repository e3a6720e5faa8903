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


def test_a_family_goes_through_every_stage(sweep, monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")  # as the sweep's child processes run
    result = sweep.check("llama")
    assert result["passed"] == "generate" == sweep.STAGES[-1] and "error" not in result
    assert result["generate"] == 3  # the prompt, the first decode step, a graph dynamic in the length
    assert result["layers"] == 14 and result["kept_dense"] == 0  # 7 projections x 2 layers, all served
    assert result["export"] == "dynamic"
    assert (result["graphs"], result["backend_ops"], result["backend_left_dense"]) == (1, 14, 0)  # no graph break


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
               {"type": "d", "passed": "compile", "failed": "backend", "error": "AssertionError: not close"}]
    summary = sweep.summarise(results)
    assert (summary["types"], summary["built"], summary["whole_path"]) == (5, 4, 2)
    assert summary["not_built"] == ["no_such_family"] and summary["kept_dense"] == {"b": 4}
    assert summary["backend_left_dense"] == {"b": 2} and summary["per_length"] == ["a"]
    assert summary["failed"] == {"c": "masks: AssertionError: not close", "d": "backend: AssertionError: not close"}
    json.dumps(summary)  # goes to the results file as is
