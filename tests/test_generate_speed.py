"""Fast offline generation: one compile per distinct specialisation, shared across layers; parallel
workers that change nothing in the output; failures that name the layer; no FP-fusion warning.

Compiles run in one subprocess without TRITON_INTERPRET (this suite's interpreter tests set it) and with
TRITON_ALWAYS_COMPILE=1, so Triton's own cache cannot make two runs agree by handing back the same bytes
(the two worker counts; a layer generated alone then reads the cache). The SASS of a cubin compiled again
to the same bytes is read back from patchc's own cache (`patchc.codegen.sass.disassemble_many`): each distinct
cubin is disassembled once, all of a generation's in one nvdisasm call per target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# a and b: same shape, block counts and flags but different tile placements (the CSR lists are runtime
# arguments, so they must share every compile); c: another shape (shares only what N and K do not enter:
# the split-K reduction). d: all dense (no kernel).
SCRIPT = r"""
import dataclasses, json, os, sys, torch
from pathlib import Path
from patchc.codegen import generate
from patchc.codegen.compile_pool import CompileError, CompileJob, compile_all
from patchc.codegen.reference import random_tile_plan
out = Path(sys.argv[1])
mixed = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.uint8)
plan = random_tile_plan({
    "a.weight": dict(n=128, k=256, tile=(64, 64), kinds=mixed, dtype=torch.float16),
    "b.weight": dict(n=128, k=256, tile=(64, 64), kinds=mixed.flip(1), dtype=torch.float16),
    "c.weight": dict(n=64, k=128, tile=(32, 32), kinds="mixed", dtype=torch.float16, bias=True),
    "d.weight": dict(n=64, k=64, tile=(32, 32), kinds="dense", dtype=torch.float16),
})
generate(plan, out / "w1", workers=1, show_progress=False)
generate(plan, out / "w2", workers=2)
os.environ["TRITON_ALWAYS_COMPILE"] = "0"  # compiled just above: what b alone gets is patchc's, not Triton's
generate(plan, out / "b_alone", workers=1, layers=["b.weight"], show_progress=False)
generate(plan, out / "c_bf16", workers=1, layers=["c.weight"], show_progress=False, dtype=torch.bfloat16)
good = CompileJob("splitk_reduce", (("part_ptr", "*fp32"), ("y_ptr", "*fp16"), ("bias_ptr", "*fp16"),
                  ("M", "i32"), ("N", "i32")), (("SPLIT_K", 2), ("HAS_BIAS", False), ("BLOCK", 1024)), 4, 1, 90)
bad = dataclasses.replace(good, constexprs=(("SPLIT_K", 2), ("HAS_BIAS", False), ("BLOCK", 1000)))
errors = {}
for workers in (1, 2):
    try:
        compile_all({good: ["layer 'ok.weight' (splitk_reduce_s2)"], bad: ["layer 'broken.weight' (splitk_reduce_s2)",
                     "layer 'other.weight' (splitk_reduce_s2)"]}, workers=workers, show_progress=False)
    except CompileError as exc:
        errors[workers] = str(exc)
try:
    generate(plan, out / "none", layers=["b.weight", "nope.weight"], show_progress=False)
except KeyError as exc:
    errors["unknown"] = str(exc)
(out / "errors.json").write_text(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("generate_speed")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_ALWAYS_COMPILE"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"generate failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return out, proc.stderr


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path; manifests without their creation time."""
    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = f.read_bytes()
        if f.name == "manifest.json":
            doc = json.loads(data)
            doc.pop("created")
            data = json.dumps(doc, sort_keys=True).encode()
        out[str(f.relative_to(folder))] = data
    return out


def _variants(folder: Path, fqn: str) -> dict[str, dict]:
    return {v["name"]: v for v in json.loads((folder / fqn / "manifest.json").read_text())["variants"]}


def _specialisation(v: dict) -> str:
    """What the compile depends on, read from the manifest (independent of the compile-cache key)."""
    return json.dumps([v["function"], v["args"], v["constexprs"], v["num_warps"], v["num_stages"], v["fp_fusion"]])


def test_equal_specialisations_share_one_compile_and_different_ones_do_not(runs):
    out, _ = runs
    w1 = out / "w1"
    index = json.loads((w1 / "manifest.json").read_text())
    entries = [v for fqn in ("a.weight", "b.weight", "c.weight") for v in _variants(w1, fqn).values()]
    distinct = {_specialisation(v) for v in entries}
    assert index["kernels"] == {"variants": len(entries), "compiled": len(distinct)}
    a, b, c = (_variants(w1, fqn) for fqn in ("a.weight", "b.weight", "c.weight"))
    assert a.keys() == b.keys()
    for name in a:  # other tile placements, same specialisation: one compile, identical binaries
        assert a[name]["compile_key"] == b[name]["compile_key"]
        assert a[name]["cubin_sha256"] == b[name]["cubin_sha256"]
        assert (w1 / "a.weight" / f"{name}.ptx").read_bytes() == (w1 / "b.weight" / f"{name}.ptx").read_bytes()
    for name in ("decode_m1", "decode_m4", "decode", "prefill"):  # N, K differ: nothing shared
        assert a[name]["compile_key"] != c[name]["compile_key"], name
        assert a[name]["cubin_sha256"] != c[name]["cubin_sha256"], name
    by_key: dict[str, set[str]] = {}
    for v in entries:
        by_key.setdefault(v["compile_key"], set()).add(_specialisation(v))
    assert all(len(specs) == 1 for specs in by_key.values()), "one compile key for two different specialisations"


def test_a_layer_gets_the_files_a_generate_of_that_layer_alone_writes(runs):
    out, _ = runs
    alone = _files(out / "b_alone" / "b.weight")
    assert alone == _files(out / "w1" / "b.weight")
    assert {Path(p).suffix for p in alone} == {".py", ".ptx", ".cubin", ".json"}


def test_two_workers_write_byte_identical_output(runs):
    out, stderr = runs
    w1, w2 = _files(out / "w1"), _files(out / "w2")
    assert w1.keys() == w2.keys() and len(w1) > 20
    assert [p for p in w1 if w1[p] != w2[p]] == []
    assert "compiling" in stderr, "generate(workers=2) showed no progress bar"


def test_kernels_compile_for_the_dtype_asked_and_small_tiles_are_named(runs):
    """`dtype=`: an fp16 plan's kernels for bf16 serving (the signature says so); the summary names the
    32 x 32 tiles that cannot meet the decode targets, and the tile size from which they hold."""
    from patchc.codegen.generate import summary

    out, _ = runs
    manifest = json.loads((out / "c_bf16" / "c.weight" / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and json.loads((out / "w1" / "c.weight" / "manifest.json").read_text())["dtype"] == "float16"
    assert "bf16" in (out / "c_bf16" / "c.weight" / "decode_m1.ptx").read_text()
    assert "bf16" not in (out / "w1" / "c.weight" / "decode_m1.ptx").read_text()
    assert "bf16" in json.dumps(manifest["variants"][0]["args"]) and "fp16" not in json.dumps(manifest["variants"][0]["args"])
    assert "targets missed with 32x32 tiles" in summary(out / "c_bf16") and "from 64x64 tiles up" in summary(out / "c_bf16")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_failed_compile_names_the_layers_that_need_it(runs, workers):
    out, _ = runs
    message = json.loads((out / "errors.json").read_text()).get(workers)
    assert message is not None, f"workers={workers}: a bad job compiled without error"
    assert "layer 'broken.weight' (splitk_reduce_s2)" in message and "other.weight" in message
    assert "ok.weight" not in message, "a job that compiled is blamed"
    assert "power of 2" in message or "arange" in message, f"Triton's reason is missing: {message[-500:]}"


def test_an_unknown_layer_name_is_refused_by_name(runs):
    out, _ = runs
    message = json.loads((out / "errors.json").read_text()).get("unknown")
    assert message is not None and "'nope.weight'" in message and "not in the plan" in message
    assert not (out / "none" / "b.weight").exists(), "generate wrote layers before refusing the list"


def test_fp_fusion_is_explicit_and_triton_does_not_warn(runs):
    from patchc.codegen.compile_pool import CompileJob

    out, stderr = runs
    assert "FP_FUSION" not in stderr and "fp fusion" not in stderr.lower()
    index = json.loads((out / "w1" / "manifest.json").read_text())
    assert index["compile_options"] == {"enable_fp_fusion": True}
    assert all(v["fp_fusion"] is True for v in _variants(out / "w1", "a.weight").values())
    src = (out / "w1" / "a.weight" / "decode.py").read_text()
    assert '"enable_fp_fusion": True' in src
    job = CompileJob("splitk_reduce", (("M", "i32"),), (("SPLIT_K", 2),), 4, 1, 90)
    off = CompileJob("splitk_reduce", (("M", "i32"),), (("SPLIT_K", 2),), 4, 1, 90, fp_fusion=False)
    assert job.key != off.key and off.options["enable_fp_fusion"] is False


def test_bad_worker_counts_are_refused(tmp_path):
    from patchc.codegen import generate
    from patchc.codegen.compile_pool import compile_all
    from patchc.codegen.reference import random_tile_plan

    for workers in (0, -2, 1.5):
        with pytest.raises(ValueError, match="workers must be a positive int"):
            compile_all({}, workers=workers)
    plan = random_tile_plan({"fc.weight": dict(n=32, k=32, tile=(16, 16), kinds="mixed")})
    with pytest.raises(ValueError, match="workers must be a positive int"):
        generate(plan, tmp_path / "k", workers=0)
    assert not (tmp_path / "k").exists()  # refused before the folder is made


@pytest.mark.parametrize("shape,tile,block,kinds", [
    ((96, 80), (32, 16), (16, 16), "mixed"),
    ((64, 172), (16, 16), None, 0.4),  # partial edge tiles (stories260K's down_proj)
    ((256, 320), (128, 64), (64, 64), "rows_no_dense"),
    ((200, 136), (64, 32), (32, 16), "rows_no_sparse"),
    ((128, 128), (64, 64), None, "sparse"),
])
def test_skeleton_has_packs_layout(shape, tile, block, kinds):
    from patchc.codegen import pack
    from patchc.codegen.reference import random_layer_plan
    from patchc.codegen.skeleton import pack_skeleton

    layer = random_layer_plan(*shape, tile=tile, kinds=kinds, dtype=torch.bfloat16, bias=True, seed=3)
    packed, skel = pack(layer, block=block), pack_skeleton(layer, block=block)
    for field in ("kinds", "dense_rowptr", "dense_cols", "sparse_rowptr", "sparse_cols"):
        assert torch.equal(getattr(packed, field), getattr(skel, field)), field
    assert (packed.per_row, packed.weight_bytes, packed.block) == (skel.per_row, skel.weight_bytes, skel.block)
    assert {k: (v.shape, v.dtype) for k, v in packed.tensors().items()} == \
           {k: (v.shape, v.dtype) for k, v in skel.tensors().items()}
    assert skel.dense.device.type == "meta"


def test_skeleton_refuses_what_pack_refuses():
    from patchc.codegen import PackError
    from patchc.codegen.reference import random_layer_plan
    from patchc.codegen.skeleton import pack_skeleton

    layer = random_layer_plan(64, 64, tile=(32, 32), kinds="mixed", seed=0)
    with pytest.raises(PackError, match=r"block \(64, 32\) does not divide the plan tile \(32, 32\)"):
        pack_skeleton(layer, block=(64, 32))
    with pytest.raises(PackError, match="entirely dense"):
        pack_skeleton(random_layer_plan(64, 64, tile=(32, 32), kinds="dense", seed=0))
