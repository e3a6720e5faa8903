"""Exported weights split into shards (`max_shard_size`), as transformers' save_pretrained splits them.

Tolerance: none. A sharded folder must load to the very logits of `plan.apply(copy of the model)` and of
the same export in one file: the shards hold the same bytes, only in several files.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from patchc.export import CONFIG, WEIGHTS, ExportError, export_pretrained, from_pretrained, load_plan
from patchc.export.shards import INDEX, parse_size, split
from patchc.ir import TilePlan
from tests.conftest import tiny_hf
from tests.test_export import check_round_trip, data_bytes, hybrid_masks


@pytest.fixture(autouse=True)
def reference_on_cpu(monkeypatch):
    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")


@pytest.fixture(scope="module")
def llama():
    model = tiny_hf("llama")
    plan = TilePlan.from_masks(model, hybrid_masks(model, seed=2), tile=(16, 16))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = plan.apply(copy.deepcopy(model))(ids, use_cache=False).logits
    return model, plan, ids, ref


def shard_names(folder) -> dict[str, set[str]]:
    """{shard file: the tensor names its header holds}."""
    out = {}
    for path in sorted(folder.glob("model-*-of-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out[path.name] = set(f.keys())
    return out


def test_sizes_read_as_transformers_reads_max_shard_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5kb") == 1500 and parse_size(" 64 KiB ") == 65536 and parse_size(4096) == 4096
    for bad, why in [("5 parsecs", "not a size"), ("GB", "not a size"), (0, "must be positive"), ("-1GB", "not a size"),
                     (2.5, "give bytes as an int"), (True, "give bytes as an int")]:
        with pytest.raises(ValueError, match=why):
            parse_size(bad)


def test_split_fills_shards_in_order_and_gives_an_oversized_unit_its_own():
    assert split([3, 3, 3, 9], 6) == [[0, 1], [2], [3]]
    assert split([9, 1, 1], 6) == [[0], [1, 2]]
    assert split([2, 2, 2], 100) == [[0, 1, 2]]
    assert split([], 10) == [[]], "a model with no tensors still gets its one (empty) file"


def test_a_sharded_export_loads_to_the_same_logits_and_keeps_each_layer_in_one_shard(llama, tmp_path):
    model, plan, ids, ref = llama
    limit = 24_000
    out = export_pretrained(plan, model, tmp_path / "sharded", max_shard_size=limit)
    assert not (out / WEIGHTS).exists()
    body = json.loads((out / CONFIG).read_text())
    assert body["weights"] == INDEX and body["version"] == 2
    index = json.loads((out / INDEX).read_text())
    shards = shard_names(out)
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    for name, names in shards.items():  # the index names exactly what each shard holds
        assert {k for k, v in index["weight_map"].items() if v == name} == names
        big_unit = len({n.split(".patchc.")[0] for n in names}) == 1
        assert data_bytes(out / name) <= limit or big_unit, f"{name} is over the limit with more than one unit"
    for fqn in plan.layers:  # every buffer of a layer sits in one shard
        assert len({v for k, v in index["weight_map"].items() if k.startswith(fqn + ".patchc.")}) == 1, fqn
    total = sum(data_bytes(out / name) for name in shards)
    assert index["metadata"]["total_size"] == total == plan.nbytes() + body["bytes"]["plain"]
    check_round_trip(plan, model, out, lambda m: m(ids, use_cache=False).logits, ref)
    got = load_plan(out)
    for fqn, layer in plan.layers.items():
        for part, t in layer.tensors().items():
            assert torch.equal(got.layers[fqn].tensors()[part], t), f"{fqn}: {part}"


def test_an_export_under_the_limit_stays_one_version_1_file(llama, tmp_path):
    """Older patchc reads what it always read: sharding (version 2) only when the weights exceed the limit."""
    model, plan, *_ = llama
    out = export_pretrained(plan, model, tmp_path / "one")
    assert (out / WEIGHTS).is_file() and not (out / INDEX).exists() and not shard_names(out)
    body = json.loads((out / CONFIG).read_text())
    assert body["weights"] == WEIGHTS and body["version"] == 1


def test_a_bad_shard_size_is_refused_before_anything_is_written(llama, tmp_path):
    model, plan, *_ = llama
    with pytest.raises(ExportError, match=r"max_shard_size '5 parsecs': not a size"):
        export_pretrained(plan, model, tmp_path / "x", max_shard_size="5 parsecs")
    assert not list(tmp_path.iterdir())


def test_broken_shards_are_named(llama, tmp_path):
    model, plan, *_ = llama
    out = export_pretrained(plan, model, tmp_path / "sharded", max_shard_size=24_000)
    index = json.loads((out / INDEX).read_text())
    names = sorted(shard_names(out))
    # a tensor the index puts in another shard than the one holding it
    moved = next(k for k, v in index["weight_map"].items() if v == names[0] and ".patchc." not in k)
    (out / INDEX).write_text(json.dumps({**index, "weight_map": {**index["weight_map"], moved: names[1]}}))
    with pytest.raises(ExportError, match=rf"tensor '{moved}' is in one of the index / model-0000[12]"):
        from_pretrained(out)
    (out / INDEX).write_text(json.dumps({**index, "weight_map": {**index["weight_map"], moved: "../model.safetensors"}}))
    with pytest.raises(ExportError, match="is not a file name beside the index"):
        from_pretrained(out)
    (out / INDEX).write_text(json.dumps(index))
    (out / names[1]).unlink()
    with pytest.raises(ExportError, match=rf"{INDEX}: shard {names[1]} is missing"):
        from_pretrained(out)
    (out / INDEX).write_text("{")
    with pytest.raises(ExportError, match="not a readable shard index"):
        from_pretrained(out)
    body = json.loads((out / CONFIG).read_text())
    (out / CONFIG).write_text(json.dumps({**body, "weights": "../elsewhere.safetensors"}))
    with pytest.raises(ExportError, match="'weights' must name a file in the folder"):
        from_pretrained(out)


def test_the_cli_takes_max_shard_size_and_refuses_a_bad_one(capsys):
    from patchc.job.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["export", "runs/x", "--out", "o", "--max-shard-size", "2GiB"]).max_shard_size == 2 * 2**30
    assert parser.parse_args(["import", "m", "--out", "o"]).max_shard_size == 50 * 10**9
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["import", "m", "--out", "o", "--max-shard-size", "lots"])
    assert e.value.code == 2 and "max_shard_size 'lots': not a size" in capsys.readouterr().err


def test_a_sharded_moe_with_a_planned_tied_head_round_trips(tmp_path):
    """Shards of one layer (or less) each: an experts module's slices are spread over many files and still
    load into one TileExperts, and a planned head tied to the embeddings keeps W * M in both."""
    import transformers

    from patchc.ir.from_pruned import layer_from_weight
    from tests.conftest import prune_24

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, tie_word_embeddings=True)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(prune_24(p.reshape(-1, p.shape[-1])).reshape(p.shape))
    plan = TilePlan.from_linears(model, tile=16)  # a tied head is not among the matrices it reads: add it
    head = layer_from_weight("lm_head.weight", model.lm_head.weight, (16, 16))
    plan = TilePlan(layers={**plan.layers, "lm_head.weight": head}, meta=plan.meta)
    assert sum(".experts." in n for n in plan.layers) == 16 and head.n_sparse > 0
    out = export_pretrained(plan, model, tmp_path / "moe", max_shard_size=1)
    assert len(shard_names(out)) > len(plan.layers)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        for dense in (True, False):
            loaded = from_pretrained(out, dense=dense)
            assert loaded.lm_head.weight is loaded.model.embed_tokens.weight or not dense
            torch.testing.assert_close(loaded(ids).logits, want, atol=1e-5, rtol=1e-5)


def test_a_buffer_the_header_does_not_describe_is_refused(llama, tmp_path):
    from safetensors.torch import save_file

    model, plan, *_ = llama
    out = export_pretrained(plan, model, tmp_path / "out")
    with safe_open(str(out / WEIGHTS), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    fqn = next(iter(plan.layers))
    for extra, why in [(f"{fqn}.patchc.bias", rf"tensor '{fqn}.patchc.bias' is not described"),
                       ("model.nowhere.weight.patchc.kinds", r"tensor 'model\.nowhere\.weight\.patchc\.kinds' is not described")]:
        save_file({**tensors, extra: torch.zeros(4)}, str(out / WEIGHTS), metadata=metadata)
        with pytest.raises(ExportError, match=why):
            from_pretrained(out)
