"""Offline generation compiles every kernel for sm_80 and sm_90 without a GPU; checks on the PTX text.
Each check runs under this Triton and under each older one beside it (`OLDER_TRITONS`: 3.6, which the
GPU machines have; for sm_90 only, but with `pytest --full`).

The compile runs in a subprocess without TRITON_INTERPRET (the interpreter tests of this suite set it,
and kernels decorated under it cannot be compiled).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import OLDER_TRITONS, older_triton_env

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("mixed.weight", "sparse.weight", "wide.weight", "wide24.weight")  # SCRIPT's layers with kernels

LAYERS = """{
    "mixed.weight": dict(n=256, k=320, tile=(128, 64), kinds="mixed", dtype=torch.float16, bias=True),
    "sparse.weight": dict(n=192, k=256, tile=(64, 128), kinds="sparse", dtype=torch.bfloat16),
    "dense.weight": dict(n=64, k=64, tile=(32, 32), kinds="dense", dtype=torch.float16),
    # a 7B model's 4096 x 4096 layer, mixed and all-2:4 (rows this long keep the weight loops loops)
    "wide.weight": dict(n=4096, k=4096, tile=(128, 128), kinds="mixed", dtype=torch.float16),
    "wide24.weight": dict(n=4096, k=4096, tile=(128, 128), kinds="sparse", dtype=torch.float16),
}"""  # the plan's layers, as source: the compiling subprocess and the interpreter test build the same plan
SCRIPT = r"""
import sys, torch
from patchc.codegen import generate
from patchc.codegen.reference import random_tile_plan
plan = random_tile_plan(""" + LAYERS + """)
# workers=1: compiled in this process, since pytest's other worker has the other core (test_generate_speed
# covers the worker pool)
for target in sys.argv[2:]:
    generate(plan, sys.argv[1] + "/" + target, target=target, workers=1, show_progress=False)
"""


@pytest.fixture(scope="module", params=[None, *OLDER_TRITONS], ids=lambda p: p.name if p else "this-triton")
def triton_dir(request) -> Path | None:
    """Which Triton compiles: None, the venv's own; else an older one's folder (`OLDER_TRITONS`)."""
    return request.param


def _targets(older: bool, config: pytest.Config) -> tuple[str, ...]:
    """What a compile here is for: both targets under this Triton; under an older one (or its kernel layout)
    sm_90, the H100 / H200 of the GPU sessions, and sm_80 too in the full form (`pytest --full`: 13 s more)."""
    return ("sm_80", "sm_90") if not older or config.getoption("--full") else ("sm_90",)


@pytest.fixture(autouse=True)
def _skip_targets_not_compiled(request):
    params = getattr(request.node, "callspec", None)
    params = params.params if params else {}
    if "target" in params and params["target"] not in _targets(params.get("triton_dir") is not None, request.config):
        pytest.skip(f"{params['target']} under an older Triton is the full form of this check: `make test-full`")


@pytest.fixture(scope="module")
def generated(triton_dir, tmp_path_factory, request) -> Path:
    out = tmp_path_factory.mktemp("kernels")
    env = older_triton_env(triton_dir)
    env.pop("TRITON_INTERPRET", None)
    env.pop("TRITON_DEFAULT_FP_FUSION", None)  # generate() sets FP fusion itself: Triton must not warn
    targets = _targets(triton_dir is not None, request.config)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), *targets], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"generate failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "FP_FUSION" not in proc.stderr, f"Triton warned about FP fusion:\n{proc.stderr[-2000:]}"
    return out


def _manifest(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_every_kernel_compiles(generated, triton_dir, target):
    import triton

    index = _manifest(generated / target / "manifest.json")
    assert index["format"] == "patchc.kernels" and index["target"] == target
    assert index["triton"] == (triton_dir.name.removeprefix("triton-") if triton_dir else triton.__version__)
    assert index["layers"]["dense.weight"]["route"] == "F.linear"
    for fqn in ("mixed.weight", "sparse.weight"):
        entry = index["layers"][fqn]
        assert entry["route"] == "patchc"
        man = _manifest(generated / target / entry["manifest"])
        assert man["layer"] == fqn and man["target"] == target
        names = [v["name"] for v in man["variants"]]
        assert {"decode_m1", "decode_m4", "decode", "prefill", "unpack"} <= set(names)
        assert entry["variants"] == names
        for v in man["variants"]:
            ptx = (generated / target / fqn / v["files"]["ptx"]).read_text()
            cubin = (generated / target / fqn / v["files"]["cubin"]).read_bytes()
            src = (generated / target / fqn / v["files"]["py"]).read_text()
            assert f".target sm_{target[3:]}" in ptx and f".entry {v['entry']}" in ptx
            assert cubin[:4] == b"\x7fELF"
            assert "CONSTEXPRS = " in src and "@triton.jit" in src
            assert v["grid"] and v["args"] and v["num_warps"] >= 1
            if v["kernel"] != "splitk_reduce":
                assert v["constexprs"]["N"] == man["shape"][0] and v["constexprs"]["K"] == man["shape"][1]
                if v.get("split_k", 1) > 1:  # partial sums added in the kernel (counters) or by a named one
                    assert (v["reduce"] in names) != ("counters" in v) and ("counters" in v) == v["constexprs"]["FIXUP"]


@pytest.mark.parametrize("target,instr", [("sm_80", "mma.sync"), ("sm_90", "wgmma")])
def test_prefill_uses_tensor_cores(generated, target, instr):
    for fqn in ("mixed.weight", "sparse.weight"):
        ptx = (generated / target / fqn / "prefill.ptx").read_text()
        assert instr in ptx, f"{target} prefill of {fqn} has no {instr}"


def test_all_24_layer_has_no_dense_loop(generated):
    man = _manifest(generated / "sm_90" / "sparse.weight" / "manifest.json")
    for v in man["variants"]:
        if v["kernel"] == "unpack":
            assert v["constexprs"]["HAS_DENSE"] is False and v["constexprs"]["HAS_SPARSE"] is True
        elif v["kernel"] != "splitk_reduce":
            per_row = -(-man["shape"][1] // man["block"][1])
            assert v["constexprs"]["HAS_DENSE"] is False and v["constexprs"]["SPARSE_PER_ROW"] == per_row


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_compressed_loads_are_vectorised(generated, target):
    """All-2:4 layer (no dense loop, no bias): the weight traffic is values + meta.

    Without a tl.dot (decode_m1) Triton issues plain vector loads: values must be 16 bytes a load,
    ld.global.v4.b32 (or v2.b64, as Triton 3.6 writes the two 2:4 groups per load it is given).
    With tl.dot (decode, prefill) the pipeliner turns the block loads into 16-byte cp.async copies.
    """
    ptx = (generated / target / "sparse.weight" / "decode_m1.ptx").read_text()
    assert re.search(r"ld\.global(\.nc)?(\.L1::\w+)?(\.L2::\w+)?\.(v4\.[bfu]32|v2\.[bfu]64)", ptx), \
        "values are not loaded 16 bytes at a time"
    for stem in ("decode", "prefill"):
        ptx = (generated / target / "sparse.weight" / f"{stem}.ptx").read_text()
        assert re.search(r"cp\.async\.cg\.shared\.global\S*\s*\[[^\]]+\],\s*\[[^\]]+\],\s*(16|0x10)\b", ptx) \
            or re.search(r"ld\.global(\.nc)?\S*\.v[24]", ptx), f"{stem}: no 16-byte loads"


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_no_kernel_spills(generated, target):
    """The static profile (cuobjdump of the cubin) is in every manifest entry: no spills, registers <= 255, and
    no local memory (a stack slot ptxas parks a value in) touched inside a weight loop."""
    from patchc.codegen.sass import cuobjdump

    if cuobjdump() is None:
        pytest.skip("this Triton ships no cuobjdump: no static profile to check")
    for fqn in ("mixed.weight", "sparse.weight", "wide.weight", "wide24.weight"):
        for v in _manifest(generated / target / fqn / "manifest.json")["variants"]:
            prof, where = v["profile"], f"{target} {fqn} {v['name']}"
            assert prof["spill_bytes"] == 0, f"{where} spills: {prof}"
            assert all(lp["local"] == 0 for lp in v.get("loops") or []), f"{where}: local memory in a loop {v['loops']}"
            assert 0 < prof["registers"] <= 255


@pytest.mark.parametrize("target,opcode", [("sm_80", "hmma"), ("sm_90", "hgmma")])
def test_sass_uses_tensor_cores_and_wide_loads(generated, target, opcode):
    """Same checks as on the PTX, on the machine code ptxas made of it."""
    from patchc.codegen.sass import cuobjdump

    if cuobjdump() is None:
        pytest.skip("this Triton ships no cuobjdump: no SASS to check")
    for fqn in ("mixed.weight", "sparse.weight"):
        profiles = {v["name"]: v["profile"] for v in _manifest(generated / target / fqn / "manifest.json")["variants"]}
        assert profiles["prefill"][opcode] > 0 and profiles["decode"][opcode] > 0, f"{target} {fqn}: no {opcode}"
        assert profiles["prefill"]["ldgsts"] > 0, f"{target} {fqn}: prefill loads are not pipelined (no LDGSTS)"
        assert profiles["decode_m1"]["ldg128"] > 0, f"{target} {fqn}: decode_m1 has no 128-bit loads"
        # the unpack kernel copies at memory speed: 128-bit loads and stores, few instructions a byte
        unpack = profiles["unpack"]
        assert unpack["ldg128"] > 0 and unpack["stg128"] > 0 and unpack["w_instr_per_byte"] < 0.1, (target, fqn, unpack)


# The decode-kernel issue's static targets (patchc.codegen.sass.LOOP_TARGETS), enforced on the SASS of a
# 4096 x 4096 fp16 layer with 128 x 128 tiles, mixed and all-2:4, for sm_80 and sm_90 (the full matrix of
# shapes, dtypes and tiles: benchmarks/static_profile.py --issue-matrix).
DECODE_VARIANTS = ("decode_m1", "decode_m4", "decode")  # every decode variant serving some M <= 16


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_decode_loops_meet_the_static_targets(generated, target, variant):
    from patchc.codegen.sass import LOOP_TARGETS, cuobjdump, target_misses

    if cuobjdump() is None:
        pytest.skip("this Triton ships no cuobjdump: no SASS to read")
    for fqn, kinds in (("wide.weight", ["dense", "2:4"]), ("wide24.weight", ["2:4"])):
        entry = _variant(generated, fqn, variant, target)
        loops = entry["loops"]
        assert loops is not None and [lp["loop"] for lp in loops] == kinds, f"{target} {fqn} {variant}: {loops}"
        where = f"{target} {fqn} {variant}"
        assert entry["m_min"] <= 16 and entry["target_misses"] == [], f"{where}: {entry['target_misses']} {loops}"
        for lp in loops:  # the same numbers checked directly, so a broken target_misses cannot hide a miss
            assert lp["warp_instr_per_byte"] <= LOOP_TARGETS[lp["loop"]], f"{where}: {lp}"
            assert lp["shuffles"] == 0 and lp["ldg128"] >= 1, f"{where}: {lp}"
            assert lp["barriers"] <= (2 if entry["m_max"] <= 4 else 4), f"{where}: {lp}"
        assert target_misses(entry["m_min"], [dict(lp, barriers=3) for lp in loops], entry["profile"]) != [] \
            or entry["m_min"] > 4


def test_sass_is_read_back_for_the_same_cubin_and_tool_only(generated, tmp_path, monkeypatch):
    """cuobjdump takes ~0.6 s a cubin: a kernel generated again reads its SASS back from the cache folder. Another
    cubin, or the cache turned off (PATCHC_SASS_CACHE=0), runs the tool; a read-only folder only skips keeping it."""
    from patchc.codegen import sass

    if sass.cuobjdump() is None:
        pytest.skip("this Triton ships no cuobjdump: no SASS to cache")
    runs = []
    run = sass._run
    monkeypatch.setattr(sass, "_run", lambda *args: runs.append(args) or run(*args))
    monkeypatch.setenv("PATCHC_SASS_CACHE", str(tmp_path / "cache"))
    decode, prefill = (generated / "sm_90" / "mixed.weight" / f"{v}.cubin" for v in ("decode_m1", "prefill"))
    first = sass.disassemble(decode)
    assert sass.disassemble(decode) == first and len(runs) == 1 and "Function : decode_kernel" in first
    assert sass.disassemble(prefill) != first and len(runs) == 2
    monkeypatch.setenv("PATCHC_SASS_CACHE", "0")
    assert sass.disassemble(decode) == first and len(runs) == 3
    (tmp_path / "ro").write_text("a file where the cache folder would be")
    monkeypatch.setenv("PATCHC_SASS_CACHE", str(tmp_path / "ro"))
    assert sass.disassemble(decode) == first and len(runs) == 4


def test_kernels_disassembled_together_read_as_each_alone(generated, monkeypatch):
    """nvdisasm's start-up is most of a call's ~0.5 s: every cubin of one target goes into a single call, cut
    back into one text each. Each reads as cuobjdump reads that cubin alone (instructions, branch targets, so
    the loops, and the function's name); a batch nvdisasm cannot read falls back to cuobjdump for each."""
    from patchc.codegen import sass

    if sass.cuobjdump() is None or sass.nvdisasm() is None:
        pytest.skip("this Triton ships no cuobjdump / nvdisasm: no SASS to read")
    runs = []
    run = sass._run
    monkeypatch.setattr(sass, "_run", lambda *args, tool=None: runs.append((tool, *args)) or run(*args, tool=tool))
    monkeypatch.setenv("PATCHC_SASS_CACHE", "0")
    cubins = sorted(generated.rglob("*.cubin"))
    targets = {c.relative_to(generated).parts[0] for c in cubins}
    assert len(cubins) >= 10
    together = sass.disassemble_many(cubins)
    assert sum(r[0] == sass.nvdisasm() for r in runs) == len(targets)  # one call per target, none per kernel
    assert not any("-sass" in r for r in runs)
    picked = [next(c for c in cubins if c.name == name) for name in ("decode_m1.cubin", "prefill.cubin")]
    picked += [c for c in cubins if "splitk" in c.name][:1]
    for cubin in picked:
        alone, text = run("-sass", cubin), together[cubins.index(cubin)]
        assert sass.sass_instructions(text) == sass.sass_instructions(alone), cubin
        assert sass.loops(text) == sass.loops(alone) and sass.instruction_mix(text) == sass.instruction_mix(alone)
        assert re.findall(r"Function : (\w+)", text) == re.findall(r"Function : (\w+)", alone)
    runs.clear()
    monkeypatch.setattr(sass, "nvdisasm", lambda: "/bin/false")  # a batch it cannot read
    same_target = [c for c in cubins if c.parent.parent == picked[0].parent.parent][:2]
    alone = sass.disassemble_many(same_target)
    assert sum("-sass" in r for r in runs) == 2 and all("Function :" in text for text in alone)
    assert [sass.sass_instructions(t) for t in alone] == [sass.sass_instructions(together[cubins.index(c)])
                                                          for c in same_target]


def test_code_addresses_of_kernels_read_together_are_counted_from_each_kernels_start():
    """Kernel 2 of a batch starts at 0x1b00: its branch, call, convergence and return targets are rebased;
    other operands (a warp mask, constants) and addresses outside the kernel are left as they are."""
    from patchc.codegen.sass import _rebased

    def text(line: str) -> str:
        return line.split("*/", 1)[1].strip()

    assert text(_rebased(0x10, "@P1 BRA 0x2290", 0x1B00, 0x1000)) == "@P1 BRA 0x790 ;"
    assert text(_rebased(0x20, "BSSY B0, 0x2020", 0x1B00, 0x1000)) == "BSSY B0, 0x520 ;"
    assert text(_rebased(0x30, "RET.REL.NODEC R20 0x1b00", 0x1B00, 0x1000)) == "RET.REL.NODEC R20 0x0 ;"
    assert text(_rebased(0x40, "@!P1 CALL.REL.NOINC 0x1c00", 0x1B00, 0x1000)) == "@!P1 CALL.REL.NOINC 0x100 ;"
    assert text(_rebased(0x50, "WARPSYNC 0x1b10", 0x1B00, 0x1000)) == "WARPSYNC 0x1b10 ;"
    assert text(_rebased(0x60, "IADD3 R1, R1, 0x1b20, RZ", 0x1B00, 0x1000)) == "IADD3 R1, R1, 0x1b20, RZ ;"
    assert text(_rebased(0x70, "BRA 0x9000", 0x1B00, 0x1000)) == "BRA 0x9000 ;"
    assert _rebased(0x80, "EXIT", 0, 0x100).startswith("        /*0080*/")


def test_unrolled_code_has_no_targets_and_unknown_code_is_a_miss_that_says_why():
    """Straight-line SASS (no backward branch) reads a fixed tile or two: no loop targets apply. Loops other
    than the expected ones, or no cuobjdump, leave the cost unknown: a miss naming which."""
    from patchc.codegen.sass import target_misses, weight_loops

    line = "        /*{:04x}*/                   {} ;"
    straight = "\n".join(line.format(16 * i, op) for i, op in enumerate(["LDG.E.128 R4, [R2.64]", "HGMMA", "EXIT"]))
    looped = straight + "\n" + line.format(48, "BRA 0x0")  # one backward branch: one loop
    args = (True, True, (128, 64), 2, 4)  # a hybrid kernel: a dense and a 2:4 loop expected
    assert weight_loops(straight, *args) == [] and weight_loops(looped, *args) is None
    assert weight_loops(None, *args) is None
    profile = {"spill_bytes": 0}
    assert target_misses(1, [], profile) == []
    assert target_misses(1, None, profile) == ["the SASS does not have the dense / 2:4 loops expected: its cost is unknown"]
    assert target_misses(1, None, None) == ["no SASS profile (this Triton ships no cuobjdump)"]
    assert target_misses(17, None, None) == []  # from M = 17 on nothing is targeted



def test_a_loop_over_split_k_partial_sums_is_no_weight_loop_and_a_stack_slot_misses_only_in_a_loop():
    """split-K's fixup loops over the partial sums with .cg loads (LDG...STRONG.GPU): not a weight loop. A
    stack slot ptxas parks a value in across the loops costs a store and a load a program; inside a weight
    loop it costs them every iteration, and that misses, as spills do."""
    from patchc.codegen.sass import target_misses, weight_loops

    line = "        /*{:04x}*/                   {} ;"
    ops = ["LDG.E.128 R4, [R2.64]", "HGMMA", "BRA 0x0",  # the 2:4 loop
           "LDG.E.128.STRONG.GPU R8, [R6.64]", "FADD R1, R1, R8", "BRA 0x30", "EXIT"]  # the fixup's
    sass = "\n".join(line.format(16 * i, op) for i, op in enumerate(ops))
    found = weight_loops(sass, False, True, (128, 64), 2, 4)
    assert [lp["loop"] for lp in found] == ["2:4"] and found[0]["instructions"] == 3 and found[0]["local"] == 0
    ok = {"loop": "2:4", "warp_instr_per_byte": 0.1, "barriers": 2, "ldg128": 1, "local": 0}
    assert target_misses(1, [ok], {"spill_bytes": 0, "stack_bytes": 8}) == []
    assert target_misses(1, [ok | {"local": 2}], {"spill_bytes": 0, "stack_bytes": 8}) == [
        "2:4 loop touches local memory (2 LDL / STL per iteration)"]
    assert target_misses(1, [ok], {"spill_bytes": 16, "stack_bytes": 16}) == ["spills 16 B"]


def test_two_groups_per_load_compiles_under_this_triton_too(tmp_path, request):
    """The kept-value load Triton 3.6 is given (`configs.GROUPS_PER_LOAD`), forced here with
    PATCHC_GROUPS_PER_LOAD=2: it compiles (for sm_90; sm_80 too with `pytest --full`) and its 2:4 decode loops
    stay below the issue rate an H100 needs to be memory bound. Its layout is made for 3.6 (`make compat` holds
    it to the static targets there); this Triton orders its axes otherwise: up to 8 barriers, 0.16 w-instr/B."""
    from patchc.codegen.sass import ISSUE_CEILING, cuobjdump

    script = SCRIPT.split("plan = ")[0] + (
        'plan = random_tile_plan({"wide24.weight": dict(n=4096, k=4096, tile=(128, 128), kinds="sparse", '
        'dtype=torch.bfloat16)})\n'
        'for target in sys.argv[2:]:\n    generate(plan, sys.argv[1] + "/" + target, target=target, workers=1)\n')
    env = older_triton_env(None, PATCHC_GROUPS_PER_LOAD="2")
    env.pop("TRITON_INTERPRET", None)
    targets = _targets(older=True, config=request.config)  # 3.6's layout, compiled here
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path), *targets], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"generate failed:\n{proc.stderr[-4000:]}"
    if cuobjdump() is None:
        pytest.skip("this Triton ships no cuobjdump: no SASS to read")
    for target in targets:
        for name in DECODE_VARIANTS:
            loops = _variant(tmp_path, "wide24.weight", name, target)["loops"]
            assert [lp["loop"] for lp in loops] == ["2:4"], f"{target} {name}: {loops}"
            assert loops[0]["warp_instr_per_byte"] <= ISSUE_CEILING and loops[0]["barriers"] <= 8, (target, name, loops)


def test_generate_summary_reports_each_variants_worst_loop(generated):
    from patchc.codegen.generate import summary

    text = summary(generated / "sm_90")
    lines = text.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:5]}
    assert set(rows) == {"decode_m1", "decode_m4", "decode", "prefill"}
    # sparse.weight (K = 256: rows of 4 packed 128 x 64 blocks, split in 4) leaves each program one block and
    # no loop: named below the table, not counted as a miss
    unrolled = _variant(generated, "sparse.weight", "decode_m1")
    assert unrolled["loops"] == [] and unrolled["target_misses"] == [] and unrolled["split_k"] == 4
    assert lines[5].startswith("1 layer(s) have decode kernels without a weight loop") and len(lines) == 8
    prefill_loops = [lp for fqn in GENERATED for lp in _variant(generated, fqn, "prefill")["loops"]]
    kflop = {kind: max(lp["warp_instr_per_kflop"] for lp in prefill_loops if lp["loop"] == kind)
             for kind in ("dense", "2:4")}
    assert lines[6] == (f"prefill, bound by compute: at most dense {kflop['dense']:.2f}, 2:4 {kflop['2:4']:.2f} "
                        "warp-instructions per kFLOP of its products (sm_90 issues ~0.98 while its tensor cores run "
                        "at peak)")
    worst_unpack = max(_variant(generated, fqn, "unpack")["profile"]["w_instr_per_byte"] for fqn in GENERATED)
    regs = max(_variant(generated, fqn, "unpack")["profile"]["registers"] for fqn in GENERATED)
    assert lines[7] == (f"unpack (the other prefill route: W * M for cuBLAS), 4 layer(s): at most {worst_unpack:.3f} "
                        f"warp-instructions per byte a 2:4 block moves, {regs} registers, 0 spill bytes")
    assert rows["decode_m1"][-1] == "ok" and rows["prefill"][-1] == "-" and int(rows["decode_m1"][-2]) >= 1
    worst = 0.0
    for fqn in GENERATED:
        for v in _manifest(generated / "sm_90" / fqn / "manifest.json")["variants"]:
            if v["name"] == "decode_m1":
                worst = max([worst] + [lp["warp_instr_per_byte"] for lp in v["loops"] or [] if lp["loop"] == "2:4"])
    assert rows["decode_m1"][1] == "4" and float(rows["decode_m1"][6]) == round(worst, 3)


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_prefill_loops_wait_on_no_global_load_and_sm90_fits_the_issue_budget(generated, target):
    """The prefill's weight loops read everything through Triton's cp.async pipeline: no synchronous global load
    in either loop (the 2:4 metadata comes as 32-bit words; as bytes, every iteration of a program, its warps
    held at one barrier, waited on them). On sm_90 the loops issue within what an SM issues while its tensor
    cores run at peak (`sass.MMA_ISSUE_BUDGET`): 2:4 ~0.8 of it, dense ~0.45, at 128 tokens a program.
    7B-shaped layers, mixed and all-2:4."""
    from patchc.codegen.sass import MMA_ISSUE_BUDGET

    for fqn in ("wide.weight", "wide24.weight"):
        v = _variant(generated, fqn, "prefill", target)
        if v["loops"] is None:
            pytest.skip("this Triton ships no cuobjdump: no SASS to count")
        assert v["profile"]["spill_bytes"] == 0, (target, fqn, v["profile"])
        for lp in v["loops"]:
            assert lp["ldg"] == 0, (target, fqn, lp)
            if target == "sm_90":
                share = lp["warp_instr_per_kflop"] / MMA_ISSUE_BUDGET["sm_90"]
                assert share <= {"dense": 0.5, "2:4": 0.85}[lp["loop"]], (fqn, lp)


def _variant(generated: Path, fqn: str, name: str, target: str = "sm_90") -> dict:
    return next(v for v in _manifest(generated / target / fqn / "manifest.json")["variants"] if v["name"] == name)


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_manifest_states_each_variants_launch_assumptions(generated, target):
    """Every pointer compiled with the 16-byte hint, its dtype, the bias dtype, contiguity: in the manifest."""
    for fqn, dtype, bias in (("mixed.weight", "float16", "float16"), ("sparse.weight", "bfloat16", None)):
        man = _manifest(generated / target / fqn / "manifest.json")
        for v in man["variants"]:
            a, where = v["assumes"], f"{target} {fqn} {v['name']}"
            pointers = [arg["name"] for arg in v["args"] if arg["type"].startswith("*")]
            assert a["aligned_16"] == pointers and a["contiguous"] == pointers, where
            if v["kernel"] == "unpack":  # writes W * M; F.linear adds the bias
                assert a["dtypes"]["out_ptr"] == a["dtypes"]["vals_ptr"] == dtype and a["bias_dtype"] is None, where
                assert a["dtypes"]["meta_ptr"] == "uint8" and v["output"] == {"shape": man["shape"], "dtype": dtype}
                continue
            assert set(a["dtypes"]) == set(pointers) and a["bias_dtype"] == bias, where
            assert a["dtypes"]["y_ptr"] == dtype and a["dtypes"]["part_ptr"] == "float32", where
            if v["kernel"] != "splitk_reduce":
                assert a["dtypes"]["x_ptr"] == a["dtypes"]["vals_ptr"] == dtype, where
                assert a["dtypes"]["meta_ptr"] == "uint8" and a["dtypes"]["sparse_cols_ptr"] == "int32", where
            assert v["layer"] == fqn


def test_check_launch_passes_good_tensors_and_names_what_is_wrong(generated):
    import torch

    from patchc.codegen import check_launch

    entry = _variant(generated, "mixed.weight", "decode")
    h = torch.float16
    good = dict(x=torch.randn(4, 320, dtype=h), y=torch.empty(4, 256, dtype=h), part=torch.empty(2, 4, 256),
                bias=torch.randn(256, dtype=h), dense=torch.empty(3, 128, 64, dtype=h),
                vals=torch.empty(3, 128, 32, dtype=h), meta=torch.empty(3, 128, 8, dtype=torch.uint8),
                dense_rowptr=torch.zeros(3, dtype=torch.int32), sparse_cols=torch.zeros(3, dtype=torch.int32))
    check_launch(entry, **good)
    check_launch(entry, x_ptr=good["x"])  # the kernel's own argument names work too
    misaligned = torch.empty(4 * 320 + 1, dtype=h)[1:].view(4, 320)  # 2 bytes off, still contiguous
    with pytest.raises(ValueError, match=r"'decode' of layer 'mixed.weight': x starts 2 bytes past a 16-byte"):
        check_launch(entry, **(good | {"x": misaligned}))
    with pytest.raises(ValueError, match=r"bias is torch.float32, the cubin was compiled for float16"):
        check_launch(entry, **(good | {"bias": good["bias"].float()}))
    with pytest.raises(ValueError, match=r"x is not contiguous"):
        check_launch(entry, **(good | {"x": torch.randn(320, 4, dtype=h).t()}))
    with pytest.raises(ValueError, match=r"meta is torch.int8"):
        check_launch(entry, meta=torch.empty(4, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"compiled with a bias"):
        check_launch(entry, bias=None)
    with pytest.raises(ValueError, match=r"no pointer argument 'weights'"):
        check_launch(entry, weights=good["dense"])
    no_bias = _variant(generated, "sparse.weight", "prefill")
    with pytest.raises(ValueError, match=r"layer 'sparse.weight'.*without a bias"):
        check_launch(no_bias, bias=torch.randn(192, dtype=torch.bfloat16))
    check_launch(no_bias, x=torch.randn(2, 256, dtype=torch.bfloat16), bias=None)
    assert entry["reduce"] is None and entry["counters"]["arg"] == "count_ptr"  # split-K added in the kernel
    check_launch(entry, count=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"count is torch.int64"):
        check_launch(entry, count=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="regenerate"):
        check_launch({k: v for k, v in entry.items() if k != "assumes"}, x=good["x"])


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_split_k_fixup_publishes_partial_sums_before_counting_in(generated, target):
    """The in-kernel split-K reduction's ordering, read from the PTX: every thread's partial-sum stores,
    then a barrier, then one acq_rel atomic at GPU scope on the tile's counter, its result broadcast
    through a barrier; the last split reads the partial sums past L1 (.cg) and stores the counter back."""
    v = _variant(generated, "mixed.weight", "decode", target)
    assert v["constexprs"]["SPLIT_K"] > 1 and v["constexprs"]["FIXUP"]
    lines = (generated / target / "mixed.weight" / v["files"]["ptx"]).read_text().splitlines()
    ptx = [line.strip() for line in lines if line.strip() and not line.strip().startswith((".", "//", "$"))]
    atoms = [i for i, line in enumerate(ptx) if "atom.global" in line]
    assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in ptx[atoms[0]], [ptx[i] for i in atoms]
    before, after = ptx[: atoms[0]], ptx[atoms[0] + 1 :]
    last_store = max(i for i, line in enumerate(before) if "st.global" in line)
    assert any(line.startswith("bar.sync") for line in before[last_store:]), "no barrier between stores and atomic"
    assert any(line.startswith("bar.sync") for line in after[:4]), "the atomic's result is not broadcast"
    assert any("ld.global.cg" in line for line in after), "the partial sums are not read past L1"
    assert not any("ld.global.cg" in line for line in before), "the weights or x read past L1"


JIT_SCRIPT = r"""
# What Triton's JIT compiles for a launch at M = 1, done offline: its own binder and argument packing, then
# the compile, for sm_90 (the GPU run's M = 1 split-K reduce failed here: M had become the Python int 1).
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from patchc.codegen import kernels, launch as L
from patchc.codegen.configs import KernelConfig, resolve_config
from patchc.codegen.layout import kernel_buffers, pack, per_row_counts
from patchc.codegen.reference import random_layer_plan

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)

def jit_compile(fn, args, kwargs):
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    m_spec = spec[list(fn.arg_names).index("M")]
    assert m_spec == ("i32", None), f"{fn.__name__}: M is specialised as {m_spec}"
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)

layer = random_layer_plan(256, 512, tile=(64, 64), kinds="mixed", dtype=torch.float16, bias=True, seed=0)
packed = pack(layer, block=(64, 64))
x = torch.randn(1, 512, dtype=torch.float16)
for reduce in ("fixup", "launch"):  # split-K added in the kernel, or by a second one
    cfg = resolve_config(KernelConfig(kernel="decode", split_k=4, reduce=reduce), packed, 1, "sm_90")
    cfg, y, part, consts, args = L._prepare(x, kernel_buffers(packed), packed.bias, packed.shape, packed.block,
                                             per_row_counts(packed), cfg, False, 0, "fc")
    assert consts["FIXUP"] == (reduce == "fixup")
    jit_compile(kernels.decode_kernel, [*args, 1], {**consts, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
jit_compile(kernels.splitk_reduce_kernel, [part, y, packed.bias, 1],
            {"N": 256, "SPLIT_K": cfg.split_k, "HAS_BIAS": True, "BLOCK": L.REDUCE_BLOCK})
# fused experts: grouped decode (split-K) at one token and grouped prefill, as launch_grouped binds them
from patchc.codegen import grouped_kernels as G
from patchc.codegen.grouped_layout import stack_experts
experts = stack_experts([pack(random_layer_plan(128, 256, tile=(64, 64), kinds="mixed", dtype=torch.float16,
                                                seed=e, name=f"w.{e}"), block=(64, 64)) for e in range(4)])
offs = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
for m, kernel, split in ((1, "decode", 2), (64, "prefill", 1)):
    xe = torch.randn(m, 256, dtype=torch.float16)
    cfg = resolve_config(KernelConfig(kernel=kernel, split_k=split), experts, m, "sm_90")
    fn, grid, cfg, y, part, consts, args = L._prepare_grouped(xe, offs, kernel_buffers(experts), (128, 256), 4,
                                                              (64, 64), experts.per_row, cfg)
    assert fn is G.GROUPED_KERNELS[kernel] and args[-2:] == [offs, m]
    jit_compile(fn, args, {**consts, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
from patchc.codegen.grouped_kernels import GROUPED_KERNELS
for fn in (*kernels.KERNELS.values(), kernels.splitk_reduce_kernel, *GROUPED_KERNELS.values()):
    assert [p.name for p in fn.params if p.do_not_specialize] == ["M"], fn  # M is their only runtime int
print("ok")
"""


def test_the_jit_compiles_m_1_launches(triton_dir):
    """M = 1 through the JIT's own binding: M stays an i32 argument (Triton would make a Python int of it)
    and decode + split-K reduce compile, and so do the fused experts' kernels as `launch_grouped` binds them. The offline compiles above pass M as i32 and never saw this."""
    env = older_triton_env(triton_dir)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", JIT_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs a generated source in Triton's interpreter")
@pytest.mark.parametrize("fqn", ["mixed.weight", "sparse.weight"])
def test_generated_unpack_source_alone_writes_the_plans_weight(generated, fqn):
    """The unpack variant's .py, imported from the folder (under the interpreter) and launched as its manifest
    says (grid rule, constexprs, the packed buffers it lists), writes the plan's W * M bit for bit: the file
    holds every helper the kernel calls, and the manifest is enough to run it."""
    import importlib.util

    import torch
    import triton

    from patchc.codegen import pack
    from patchc.codegen.layout import BUFFER_NAMES, kernel_buffers
    from patchc.codegen.reference import layerplan_to_dense, random_tile_plan

    man = _manifest(generated / "sm_90" / fqn / "manifest.json")
    v = _variant(generated, fqn, "unpack")
    spec = importlib.util.spec_from_file_location(f"generated_unpack_{fqn.split('.')[0]}", generated / "sm_90" / fqn /
                                                  v["files"]["py"])
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    assert source.CONSTEXPRS == v["constexprs"] and source.KERNEL.__name__ == v["function"] == "unpack_kernel"

    layer = random_tile_plan(eval(LAYERS, {"torch": torch})).layers[fqn]
    packed = pack(layer, block=tuple(man["block"]))
    buffers = dict(zip(BUFFER_NAMES, kernel_buffers(packed)))  # the kernel's argument order after out_ptr
    assert {k: list(t.shape) for k, t in buffers.items()} == {k: man["buffers"][k]["shape"] for k in BUFFER_NAMES}
    out = torch.full(v["output"]["shape"], float("nan"), dtype=getattr(torch, v["output"]["dtype"]))
    grid = eval(v["grid"], {"cdiv": triton.cdiv}, dict(v["constexprs"]))
    source.KERNEL[grid](out, *buffers.values(), **source.CONSTEXPRS)
    assert torch.equal(out, layerplan_to_dense(layer, out.dtype))
