"""Inspector / autotuner and its cache, on CPU with an injected timing function (no kernel runs)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import patchc.runtime as rt
from patchc.ir import PlanError
from patchc.codegen.configs import KernelConfig
from patchc.codegen.reference import random_tile_plan
from patchc.runtime.cache import TuneCache, cache_key
from patchc.runtime.candidates import candidate_space, candidates, prune_reason, smem_estimate
from patchc.runtime.tuner import TuneError, tune_plan

F16 = torch.float16


class FakeTimer:
    """Counts calls; decode prefers split_k 2 / block 32x64, prefill prefers block_m 64; split_k 4 fails."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fn) -> float:
        self.calls += 1
        cfg = fn.args[-1]
        m = fn.args[0].shape[0]
        if cfg.split_k == 4:
            raise RuntimeError("out of resources")  # must score infinity, not crash
        if cfg.kernel == "decode":
            return 1.0 + abs(cfg.split_k - 2) + 0.1 * ((cfg.block_n, cfg.block_k) != (32, 64)) + m * 1e-3
        return 2.0 + (cfg.block_m != 64) + 0.01 * cfg.num_warps + m * 1e-4


def plan_of():
    return random_tile_plan({
        "mixed.weight": dict(n=128, k=1024, tile=(64, 64), kinds="mixed"),
        "sparse.weight": dict(n=64, k=512, tile=(64, 64), kinds="sparse"),
        "dense.weight": dict(n=64, k=256, tile=(64, 64), kinds="dense"),
    })


def run(plan, cache, timer, **kw):
    return tune_plan(plan, batch_size=16, prefill_len=32, dtype=F16, device="cpu", cache=cache,
                     progress=False, time_fn=timer, arch="sm_90", **kw)


def test_tune_decode_then_prefill_and_cache(tmp_path):
    plan, cache_path = plan_of(), tmp_path / "tune.json"
    timer = FakeTimer()
    first = run(plan, TuneCache(cache_path), timer)
    assert timer.calls > 0
    assert first["dense.weight"] is None  # all dense: F.linear
    mixed = first["mixed.weight"]
    assert (mixed.decode.kernel, mixed.prefill.kernel) == ("decode", "prefill")
    assert mixed.block == (32, 64) and mixed.decode.split_k == 2  # decode fixed the block
    assert (mixed.prefill.block_n, mixed.prefill.block_k) == mixed.block and mixed.prefill.block_m == 64
    assert mixed.threshold >= 16 and mixed.source == "tuned"
    assert first["sparse.weight"].prefill_backend == "triton"  # semi-structured needs a GPU
    # second run: everything from the cache, nothing timed
    again = FakeTimer()
    second = run(plan, TuneCache(cache_path), again)
    assert again.calls == 0
    assert {k: (v and (v.decode, v.prefill, v.block, v.threshold)) for k, v in second.items()} == \
        {k: (v and (v.decode, v.prefill, v.block, v.threshold)) for k, v in first.items()}
    assert second["mixed.weight"].source == "cache"
    # another dtype is another key: timed again
    third = FakeTimer()
    tune_plan(plan, 16, 32, torch.float32, "cpu", TuneCache(cache_path), False, time_fn=third, arch="sm_90")
    assert third.calls > 0


def test_corrupt_cache_survived_and_rewritten(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="ignoring it"):
        out = run(plan_of(), TuneCache(path), FakeTimer())
    assert out["mixed.weight"] is not None
    data = json.loads(path.read_text())
    assert data["format"] == "patchc-tune-cache" and len(data["entries"]) >= 4


def test_stale_entry_is_retuned(tmp_path):
    path = tmp_path / "tune.json"
    run(plan_of(), TuneCache(path), FakeTimer())
    data = json.loads(path.read_text())
    for rec in data["entries"].values():
        rec["config"] = [7, 1, 1, 1, 1, 1]  # unknown kernel code
    path.write_text(json.dumps(data))
    timer = FakeTimer()
    with pytest.warns(RuntimeWarning, match="stale entry"):
        out = run(plan_of(), TuneCache(path), timer)
    assert timer.calls > 0 and out["mixed.weight"].decode.kernel == "decode"


def test_a_decode_record_holding_a_prefill_config_is_stale_not_a_crash(tmp_path):
    """The cache never raises: a decode (or bucket) record with kernel code 1 (prefill) passed its parse and
    then crashed LayerTuning ("decode buckets must hold decode configs")."""
    path = tmp_path / "tune.json"
    run(plan_of(), TuneCache(path), FakeTimer())
    data = json.loads(path.read_text())
    decode = [k for k in data["entries"] if "|decode|" in k]
    assert decode
    for key in decode:
        data["entries"][key]["config"] = [1, 16, 1, 4, 3, 8, 0]
    path.write_text(json.dumps(data))
    timer = FakeTimer()
    with pytest.warns(RuntimeWarning, match="stale entry .*a prefill config where a decode one belongs"):
        out = run(plan_of(), TuneCache(path), timer)
    assert timer.calls > 0 and out["mixed.weight"].decode.kernel == "decode"


def test_cached_only_times_nothing(tmp_path):
    timer = FakeTimer()
    out = run(plan_of(), TuneCache(tmp_path / "t.json"), timer, cached_only=True)
    assert timer.calls == 0 and out["mixed.weight"] is None


def test_every_candidate_failing_raises(tmp_path):
    def broken(fn):
        raise RuntimeError("no")

    with pytest.raises(TuneError, match="mixed.weight"):
        run(plan_of(), False, broken)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_tuning_needs_a_gpu():
    with pytest.raises(TuneError, match="needs a CUDA GPU"):
        tune_plan(plan_of(), progress=False)


def test_compile_tune_paths(tmp_path):
    from torch import nn

    model = nn.Sequential(nn.Linear(1024, 128, bias=False))
    plan = random_tile_plan({"0.weight": dict(n=128, k=1024, tile=(64, 64), kinds="mixed")})
    timer = FakeTimer()
    with pytest.raises(PlanError, match=r"layer 0\.weight: .*other weights"):
        rt.compile(model, plan, tune=False)  # a random plan is not made from this model's weights
    model[0].weight.data.copy_(plan.layers["0.weight"].to_dense())  # now the model is the plan's
    fast = rt.compile(model, plan, batch_size=16, prefill_len=32, tune=True, time_fn=timer, cache=tmp_path / "c.json")
    assert timer.calls > 0 and fast[0].block == (32, 64) and fast[0].decode_cfg[2] == 2
    cached = rt.compile(model, plan, batch_size=16, prefill_len=32, tune="cached", cache=tmp_path / "c.json")
    assert cached[0].decode_cfg == fast[0].decode_cfg and cached[0].tuning.source == "cache"
    default = rt.compile(model, plan, tune=False)
    assert default[0].tuning.source == "default"


# --- candidates and pruning ----------------------------------------------------------------------
def test_candidate_tables_per_generation():
    a, h = candidate_space("sm_80"), candidate_space("sm_90")
    assert h.smem_bytes > a.smem_bytes and max(h.decode_split_k) > max(a.decode_split_k)
    with pytest.raises(ValueError, match="no candidate table"):
        candidate_space("sm_70")


def test_prune_rules():
    space = candidate_space("sm_80")
    cfg = KernelConfig("decode", 16, 64, 64, 1, 4, 2, 8)
    assert prune_reason(cfg, (4096, 4096), (128, 128), F16, space) is None
    assert "does not divide" in prune_reason(cfg, (4096, 4096), (96, 128), F16, space)
    assert "exceeds the layer" in prune_reason(KernelConfig("decode", 16, 128, 64, 1, 4, 2, 8), (32, 4096), (128, 128), F16, space)
    big = KernelConfig("prefill", 128, 128, 128, 1, 8, 4, 8)
    assert smem_estimate(big, F16) == 4 * (128 * 128 + 128 * 128) * 2
    assert "shared memory" in prune_reason(big, (4096, 4096), (128, 128), F16, space)
    assert "K per split" in prune_reason(KernelConfig("decode", 16, 64, 64, 8, 4, 2, 8), (4096, 1024), (64, 64), F16, space)
    assert "blocks per split" in prune_reason(
        KernelConfig("decode", 16, 64, 256, 8, 4, 2, 8), (4096, 2048), (64, 256), F16, space,
    )


def test_candidates_respect_tile_and_block():
    cands = candidates("decode", (4096, 4096), (64, 64), 16, F16, "sm_90")
    assert cands and all(64 % c.block_n == 0 and 64 % c.block_k == 0 for c in cands)
    assert all(c.kernel == "decode" and c.block_m == 16 for c in cands)
    small = candidates("decode", (4096, 4096), (64, 64), 2, F16, "sm_90")
    # M <= 4: multiply-and-sum (block_m = 2) and the padded tl.dot kernel (16) both get timed
    assert {c.block_m for c in small} == {2, 16}
    pre = candidates("prefill", (4096, 4096), (128, 128), 2048, F16, "sm_80", block=(64, 64))
    assert pre and {(c.block_n, c.block_k) for c in pre} == {(64, 64)} and {c.block_m for c in pre} == {64, 128}


@pytest.mark.parametrize("tile", [(16, 16), (32, 32), (16, 32)])
def test_plans_of_small_tiles_tune(tile):
    """Blocks must divide the tile: 16- and 32-wide tiles have candidates of their own (the GPU run found
    every all-2:4 candidate of a 16 x 16 plan pruned)."""
    plan = random_tile_plan({"mixed.weight": dict(n=128, k=256, tile=tile, kinds="mixed"),
                             "sparse.weight": dict(n=64, k=128, tile=tile, kinds="sparse")})
    out = run(plan, False, FakeTimer())
    for t in out.values():
        assert tile[0] % t.block[0] == 0 and tile[1] % t.block[1] == 0
    wide = {(c.block_n, c.block_k) for c in candidates("decode", (4096, 4096), (128, 128), 16, F16, "sm_90")}
    assert min(bn * bk for bn, bk in wide) >= 16 * 64  # 128-wide tiles: no 16 x 16 to 32 x 32 compiles


def test_cache_key_parts(monkeypatch):
    monkeypatch.delenv("PATCHC_GROUPS_PER_LOAD", raising=False)
    k1 = cache_key("dev", (8, 16), "h", F16, "decode", 16)
    monkeypatch.setenv("PATCHC_GROUPS_PER_LOAD", "2" if "groups=1" in k1 else "1")  # the other 2:4 load
    assert k1 != cache_key("dev", (8, 16), "h", F16, "decode", 16)
    monkeypatch.delenv("PATCHC_GROUPS_PER_LOAD")
    assert k1 != cache_key("dev", (8, 16), "h", torch.bfloat16, "decode", 16)
    assert k1 != cache_key("dev", (8, 16), "h", F16, "prefill", 16)
    assert k1 != cache_key("dev2", (8, 16), "h", F16, "decode", 16)
    assert torch.__version__ in k1


def test_cache_default_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATCHC_CACHE_DIR", str(tmp_path))
    assert rt.default_cache_path() == tmp_path / "tune.json"
    c = TuneCache()
    c.put("a", {"x": 1})
    assert TuneCache().get("a") == {"x": 1} and not math.isnan(len(c))


# --- decode buckets by M ---------------------------------------------------------------------------


def test_pick_decode_serves_each_m_from_its_bucket():
    from patchc.runtime.op import encode_buckets, pick_decode

    one = KernelConfig("decode", 1, 32, 64, 2, 4, 4, 8, "fixup")
    four = KernelConfig("decode", 4, 32, 64, 2, 4, 4, 8, "launch")
    dot = KernelConfig("decode", 16, 32, 64, 8, 4, 4, 8, "fixup")
    flat = encode_buckets([(1, one), (4, four), (16, dot)])
    assert flat[:8] == [1, 0, 1, 2, 4, 4, 8, 0] and len(flat) == 24
    assert [pick_decode(flat, m)[1] for m in (1, 2, 3, 4, 5, 16, 17, 500)] == [1, 4, 4, 4, 16, 16, 16, 16]
    assert [pick_decode(flat, m)[-1] for m in (1, 3, 16)] == [0, 1, 0]  # each bucket keeps its own reduction
    assert pick_decode([0, 16, 2, 4, 4, 8, 1], 3) == [0, 16, 2, 4, 4, 8, 1]  # one config for every M (no buckets)
    with pytest.raises(ValueError, match="7 ints or buckets of 8"):
        pick_decode(flat[:10], 1)
    with pytest.raises(ValueError, match="increasing"):
        encode_buckets([(4, four), (1, one)])


def test_tuned_buckets_read_the_weights_once_up_to_16_tokens(tmp_path):
    timer = FakeTimer()
    mixed = run(plan_of(), TuneCache(tmp_path / "t.json"), timer)["mixed.weight"]
    assert [m for m, _ in mixed.buckets] == [1, 4, 8, 16, 64]
    for m, cfg in mixed.buckets:
        assert (cfg.kernel, (cfg.block_n, cfg.block_k)) == ("decode", mixed.block)
        assert cfg.block_m >= min(m, 16), f"bucket M <= {m}: block_m {cfg.block_m} reads the weights twice"
    assert dict(mixed.buckets)[1].block_m == 1 and dict(mixed.buckets)[4].block_m == 4  # small-M decode blocks
    assert dict(mixed.buckets)[16] == mixed.decode  # the batch size's bucket is the decode config itself
    assert mixed.to_dict()["buckets"][0] == [1, dataclasses.asdict(dict(mixed.buckets)[1])]


def test_default_tuning_and_module_carry_the_buckets():
    from patchc.runtime.op import pick_decode

    plan = random_tile_plan({"0.weight": dict(n=128, k=1024, tile=(64, 64), kinds="mixed")})
    mod = rt.TileLinear.from_plan(plan.layers["0.weight"], batch_size=16)
    assert mod.tuning.source == "default" and [m for m, _ in mod.tuning.buckets] == [1, 4, 8, 16, 64]
    flat = mod.op_args()[-3]
    for m in range(1, 17):
        assert math.ceil(m / pick_decode(flat, m)[1]) == 1, f"M = {m} would read the weights more than once"


def test_cache_writers_in_two_processes_keep_every_entry(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "tune.json"
    code = ("import sys; from patchc.runtime.cache import TuneCache\n"
            "c = TuneCache(sys.argv[1])\n"
            "for i in range(60): c.put(f'{sys.argv[2]}-{i}', {'ms': float(i)})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), tag]) for tag in ("a", "b")]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 120 and entries["a-59"] == {"ms": 59.0} and entries["b-0"] == {"ms": 0.0}


def test_split_k_whose_workspace_exceeds_the_launch_bound_is_not_a_candidate(monkeypatch):
    from patchc.codegen import launch

    space = candidate_space("sm_90")
    cfg = KernelConfig("prefill", 64, 64, 64, 2, 4, 3, 8)
    assert prune_reason(cfg, (4096, 4096), (64, 64), F16, space, m=2048) is None  # exactly 64 MiB
    assert "workspace" in prune_reason(cfg, (4096, 4096), (64, 64), F16, space, m=2049)
    assert prune_reason(cfg, (4096, 4096), (64, 64), F16, space) is None  # M unknown: not checked
    big = candidates("prefill", (11008, 4096), (64, 64), 2048, F16, "sm_90")  # 86 MiB per split
    assert big and {c.split_k for c in big} == {1}
    assert {c.split_k for c in candidates("prefill", (4096, 4096), (64, 64), 512, F16, "sm_90")} == {1, 2}
    monkeypatch.setattr(launch, "MAX_WORKSPACE_BYTES", 3 * 16 * 4096 * 4)
    decode = candidates("decode", (4096, 4096), (64, 64), 16, F16, "sm_90")
    assert {c.split_k for c in decode} == {1, 2}  # the launcher's bound, read when pruning


def test_cache_survives_deeply_nested_json(tmp_path):
    """json.loads of a 100k-deep array raises RecursionError, which the cache documents never to raise."""
    path = tmp_path / "tune.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    cache = TuneCache(path)
    with pytest.warns(RuntimeWarning, match="RecursionError"):
        assert cache.get("k") is None
    cache.put("k", {"ms": 1.0})
    assert TuneCache(path).get("k") == {"ms": 1.0}


def test_cache_of_another_version_is_left_untouched(tmp_path):
    """A newer patchc's cache file must not be wiped by this one's next put: results stay in memory."""
    path = tmp_path / "tune.json"
    newer = json.dumps({"format": "patchc-tune-cache", "version": 99, "entries": {"theirs": {"ms": 2}}})
    path.write_text(newer)
    cache = TuneCache(path)
    with pytest.warns(RuntimeWarning, match="cache version 99.*results stay in memory"):
        assert cache.get("theirs") is None
    cache.put("mine", {"ms": 1.0})
    assert cache.get("mine") == {"ms": 1.0} and path.read_text() == newer


def test_dropped_entry_stays_dropped(tmp_path):
    """drop() then put() of another key: the merge with the file must not bring the dropped record back."""
    path = tmp_path / "tune.json"
    cache = TuneCache(path)
    cache.put("stale", {"ms": 1.0})
    cache.put("other", {"ms": 2.0})
    cache.drop("stale")
    assert TuneCache(path).get("stale") is None  # gone from the file at once
    cache.put("third", {"ms": 3.0})
    fresh = TuneCache(path)
    assert fresh.get("stale") is None and fresh.get("other") == {"ms": 2.0} and fresh.get("third") == {"ms": 3.0}


def test_layers_of_one_class_share_one_tuning():
    from patchc.codegen.reference import random_layer_plan
    from patchc.ir import TilePlan
    from patchc.runtime.tuner import tuning_class

    def layer(name, kinds, seed):
        return random_layer_plan(128, 1024, tile=(64, 64), kinds=kinds, name=name, seed=seed)

    # seeds 0 and 3 draw 13 and 12 of 32 tiles 2:4, at other places: one class; c is all 2:4, another
    plan = TilePlan(layers={"a.weight": layer("a.weight", 0.5, 0), "b.weight": layer("b.weight", 0.5, 3),
                            "c.weight": layer("c.weight", "sparse", 1)}, skipped={}, meta={})
    a_, b_ = plan.layers["a.weight"], plan.layers["b.weight"]
    assert tuning_class(a_) == tuning_class(b_) and not torch.equal(a_.kinds, b_.kinds)
    one, sparse, both = FakeTimer(), FakeTimer(), FakeTimer()
    run(TilePlan(layers={"a.weight": a_}, skipped={}, meta={}), False, one)
    run(TilePlan(layers={"c.weight": plan.layers["c.weight"]}, skipped={}, meta={}), False, sparse)
    out = run(plan, False, both)
    a, b = out["a.weight"], out["b.weight"]
    assert (b.source, b.fqn, b.notes[-1]) == ("shared", "b.weight", "tuning of a.weight")
    assert (b.block, b.decode, b.prefill, b.buckets, b.threshold) == (a.block, a.decode, a.prefill, a.buckets, a.threshold)
    assert out["c.weight"].source == "tuned" and both.calls == one.calls + sparse.calls  # a and c timed, b not
    alone = FakeTimer()
    run(plan, False, alone, share=False)
    assert alone.calls > both.calls


def test_a_layer_with_few_24_tiles_does_not_share_an_all_dense_layers_none():
    from patchc.codegen.reference import random_layer_plan
    from patchc.ir import TilePlan
    from patchc.runtime.tuner import tuning_class

    dense = random_layer_plan(128, 1024, tile=(64, 64), kinds="dense", name="d.weight", seed=0)
    few = random_layer_plan(128, 1024, tile=(64, 64), kinds=torch.eye(2, 16, dtype=torch.int8), name="f.weight", seed=1)
    assert int((few.kinds == 1).sum()) == 2 and tuning_class(dense) != tuning_class(few)
    out = run(TilePlan(layers={"d.weight": dense, "f.weight": few}, skipped={}, meta={}), False, FakeTimer())
    assert out["d.weight"] is None and out["f.weight"].source == "tuned"


def test_all_24_layers_search_only_the_best_ranked_blocks(monkeypatch):
    """All-2:4 layers rank every block by its default configs and search the best two in full: the same
    block as searching all of them (on a cost where the block's default predicts its best), for fewer timings."""
    import patchc.runtime.tuner as tuner

    plan = random_tile_plan({"sparse.weight": dict(n=256, k=1024, tile=(64, 64), kinds="sparse")})
    ranked, everything = FakeTimer(), FakeTimer()
    chosen = run(plan, False, ranked)["sparse.weight"]
    monkeypatch.setattr(tuner, "ALL_24_BLOCKS_SEARCHED", 99)
    full = run(plan, False, everything)["sparse.weight"]
    assert chosen.block == full.block == (32, 64) and chosen.decode == full.decode
    assert ranked.calls < everything.calls


def test_a_time_limit_keeps_what_was_found_and_caches_only_whole_searches(tmp_path, monkeypatch):
    """Each timing takes one (fake) second. Cut inside the first layer: it keeps the best configs found so far
    (source "partial"), the regimes searched in full before the cut are cached and the cut one is not, the
    next layer gets the default configs (None) without one more timing; a second run with time reads the
    finished regimes from the cache and tunes the rest."""
    import patchc.runtime.timing as timing

    clock = [0.0]
    monkeypatch.setattr(timing.time, "monotonic", lambda: clock[0])
    plan, cache_path = plan_of(), tmp_path / "tune.json"
    whole = FakeTimer()
    full = run(plan, TuneCache(tmp_path / "whole.json"), whole)
    mixed_calls = FakeTimer()
    run(random_tile_plan({"mixed.weight": dict(n=128, k=1024, tile=(64, 64), kinds="mixed")}), False, mixed_calls)

    class Ticking(FakeTimer):
        def __call__(self, fn):
            clock[0] += 1.0
            return super().__call__(fn)

    timer = Ticking()
    limit = mixed_calls.calls - 5  # the mixed layer's last searches are cut
    cut = run(plan, TuneCache(cache_path), timer, time_limit=limit)
    assert timer.calls == limit  # not one timing after the deadline
    assert cut["mixed.weight"].source == "partial" and "time limit reached" in cut["mixed.weight"].notes
    assert cut["sparse.weight"] is None and cut["dense.weight"] is None  # defaults / F.linear
    entries = json.loads(cache_path.read_text())["entries"]
    whole_entries = json.loads((tmp_path / "whole.json").read_text())["entries"]
    assert entries and set(entries) < set(whole_entries)  # what was stored is whole: the full run's own records
    assert all(entries[k] == whole_entries[k] for k in entries)
    # the cut search was not stored: a second run without a limit ends where the full one did
    again = Ticking()
    resumed = run(plan, TuneCache(cache_path), again)
    assert 0 < again.calls < whole.calls
    assert {k: (v and (v.decode, v.prefill, v.block, v.threshold, v.buckets)) for k, v in resumed.items()} == \
        {k: (v and (v.decode, v.prefill, v.block, v.threshold, v.buckets)) for k, v in full.items()}
