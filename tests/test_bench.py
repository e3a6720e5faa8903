"""`patchc bench` (the GPU proof harness): its dry run on CPU, its checks catching broken kernels, its records.

The dry run is the GPU harness itself on tiny shapes under the Triton interpreter: if it breaks here it
would break on the rare GPU session too.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # set before triton is imported: it picks interpreted vs compiled at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from patchc.bench import BenchOptions, exit_status
from patchc.bench.check import check_case, error_bound
from patchc.bench.layers import make_layer, peak_bandwidth, tile_kinds, weight_bytes
from patchc.bench.options import PART_WEIGHTS, LayerCase, check_cases, speed_cases
from patchc.bench.record import append_jsonl, record_run, slug
from patchc.job.cli import main
from tests.conftest import in_fresh_thread, older_triton_env, older_triton_params

ROOT = Path(__file__).resolve().parents[1]
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU form of the harness")
CHECKED_VARIANTS = {"auto", "runtime", "gemv", "gemv_splitk", "gemv_splitk_launch", "dot", "dot_prefill", "prefill",
                    "prefill_splitk", "unpacked"}  # all


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    status = in_fresh_thread(main, ["bench", "--dry-run", "--out", str(out), "--no-progress"])
    (jsonl,) = out.glob("*.jsonl")
    return status, json.loads(jsonl.read_text().splitlines()[-1]), out


@needs_cpu
@pytest.mark.slow
@pytest.mark.interpreter
def test_dry_run_checks_every_variant_and_passes(dry_run):
    status, record, out = dry_run
    assert status == 0, record["check"]["failed"]
    rows = record["check"]["rows"]
    assert {r["variant"] for r in rows} == CHECKED_VARIANTS
    assert all(r["ok"] and r["err"] <= r["bound"] for r in rows)
    assert not record["check"]["skipped"]
    # every case ran every M it asked for, bf16 included (M <= 4: the interpreter's tl.dot is wrong in bf16)
    for case in check_cases(BenchOptions(dry_run=True)):
        assert {r["M"] for r in rows if r["case"] == case.label} == set(case.ms), case.label
    assert record["env"]["dry_run"] and record["env"]["git_sha"] and record["env"]["groups_per_load"] in (1, 2)


@needs_cpu
@pytest.mark.slow
@pytest.mark.interpreter
def test_dry_run_times_against_dense_and_runs_the_model(dry_run):
    _, record, out = dry_run
    speed = record["speed"]["rows"]
    assert speed and all(r["dense_ms"] > 0 and r["tile_ms"] > 0 for r in speed)
    assert all(r["ceiling"] > 1.3 for r in speed if r["M"] <= 16)  # 35% and all-2:4 layers move fewer bytes
    # each row names the kernel that served it (untuned: the decode buckets, then the hybrid prefill)
    assert all(r["route"] == ("decode" if r["M"] <= 64 else "prefill") for r in speed)
    # and its config: the decode rows split K and add the splits up in the kernel (the default), and are timed
    # again adding them in a second launch
    assert all(r["config"]["split_k"] > 1 and r["config"]["reduce"] == "fixup" for r in speed if r["M"] <= 4)
    assert all(r["other_reduce"] == "launch" and r["other_reduce_ms"] > 0 for r in speed if r["M"] <= 4)
    e2e = record["e2e"]["rows"]
    assert {r["batch"] for r in e2e} == {1, 16} and all(r["logits_ok"] for r in e2e)
    # one prompt's prefill timed for both models, in the same run
    assert all(r["prefill_tokens"] == 64 and r["dense_prefill_ms"] > 0 and r["long_prefill_ms"] > 0
               and r["prefill_speedup"] == r["dense_prefill_ms"] / r["long_prefill_ms"] for r in e2e)
    md = next(out.glob("*.md")).read_text()
    assert "DRY RUN" in md and "| gemv |" in md and "| unpacked |" in md and "End to end" in md
    assert "| decode " in md and "-way fixup (launch " in md  # the kernel column: splits, how added, the other
    assert "Fused MoE experts" in md and "| configs | kernel |" in md and "| 64 tokens: " in md


@needs_cpu
@pytest.mark.slow
@pytest.mark.interpreter
def test_dry_run_checks_and_times_the_grouped_experts(dry_run):
    """Every token count of the experts case is checked against fp64 and timed against the dense loop (on CPU
    torch._grouped_mm is not tried); decode rows carry the routed experts' bytes ceiling."""
    _, record, _ = dry_run
    rows = record["experts"]["rows"]
    assert [r["tokens"] for r in rows] == [1, 5] and not record["experts"]["failed"]
    assert all(r["ok"] and r["err"] <= r["bound"] and r["baseline"] == "F.linear loop" for r in rows)
    assert rows[0]["rows"] == 2 and rows[1]["rows"] == 10  # top-2 of 4 experts
    assert all(r["ceiling"] > 1.2 and r["dense_ms"] > 0 and r["tile_ms"] > 0 for r in rows)


@needs_cpu
@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("triton_dir", older_triton_params())
def test_dry_run_checks_pass_under_an_older_triton(triton_dir, tmp_path, request):
    """The correctness part under the Triton a GPU machine with torch 2.11 has (3.6), whose kernels take
    their own 2:4 load (`configs.GROUPS_PER_LOAD`): a kernel that only this Triton runs right fails here,
    not in the rare GPU session. Two of the three mixed (35%) cases (15 s, against 21 s for the three): one
    checks every variant by its explicit config, the other 16 x 16 tiles in bf16; `--full` adds them in fp16."""
    from patchc.codegen.configs import groups_per_load

    version = triton_dir.name.removeprefix("triton-")
    cases = ["35%"] if request.config.getoption("--full") else ["35% t32x32", "35% t16x16 bf16"]
    proc = subprocess.run([sys.executable, "-m", "patchc", "bench", "--dry-run", "--parts", "check", "--case", *cases,
                           "--out", str(tmp_path), "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=older_triton_env(triton_dir, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"  # stdout: the failed rows' table
    (jsonl,) = tmp_path.glob("*.jsonl")
    record = json.loads(jsonl.read_text().splitlines()[-1])
    assert record["env"]["triton"] == version and record["env"]["groups_per_load"] == groups_per_load(version)
    rows = record["check"]["rows"]
    assert {r["variant"] for r in rows} == CHECKED_VARIANTS
    assert {r["case"] for r in rows} == {c.label for c in check_cases(BenchOptions(dry_run=True, cases=tuple(cases)))}
    assert len({r["case"] for r in rows}) == (3 if len(cases) == 1 else 2)
    assert all(r["ok"] and r["err"] <= r["bound"] for r in rows) and not record["check"]["skipped"]


def _flipping_first_nibble(pack):
    """`pack` whose layers come out with one metadata bit flipped: i1 of the first group, another position."""

    def broken_pack(*args, **kwargs):
        packed = pack(*args, **kwargs)
        meta = packed.meta.clone()
        meta.view(-1)[0] ^= 0b0100
        return dataclasses.replace(packed, meta=meta)

    return broken_pack


@needs_cpu
@pytest.mark.interpreter
def test_check_catches_a_misplaced_24_value(monkeypatch):
    """Flip one metadata nibble of the packed layer: one kept value moves in its group; the check must fail."""
    import patchc.codegen as codegen

    monkeypatch.setattr(codegen, "pack", _flipping_first_nibble(codegen.pack))
    case = LayerCase((64, 96), "2:4", (32, 32), "fp16", (1, 17), explicit=False)
    rows = [r for r in check_case(case, "cpu", seed=0) if r["variant"] == "auto"]
    assert rows and not any(r["ok"] for r in rows), rows


@needs_cpu
@pytest.mark.interpreter
def test_experts_check_catches_a_misplaced_24_value(monkeypatch):
    """The same flipped nibble in one packed expert: the experts part marks its rows failed, and the run exits 1."""
    from patchc.bench import experts
    from patchc.bench.layers import Deadline, cpu_timer

    import patchc.codegen.layout as layout

    monkeypatch.setattr(layout, "pack", _flipping_first_nibble(layout.pack))
    case = experts.ExpertCase("tiny", 4, (32, 32), 4, "2:4", "fp16", (2,), (2,), (16, 16))  # every expert routed
    result = experts.run_experts([case], "cpu", cpu_timer(reps=1), 0, Deadline(60), show=False)
    assert result["failed"] and not result["rows"][0]["ok"]
    assert exit_status({"experts": result}) == 1


@needs_cpu
@pytest.mark.interpreter
def test_check_reports_a_failing_kernel_instead_of_crashing(monkeypatch):
    import patchc.codegen as codegen

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(codegen, "tile_linear", broken)
    rows = check_case(LayerCase((64, 96), 0.35, (32, 32), "fp16", (1,)), "cpu", seed=0)
    auto = [r for r in rows if r["variant"] == "auto"]
    assert auto and not auto[0]["ok"] and "out of resources" in auto[0]["error"]
    assert [r["ok"] for r in rows if r["variant"] == "runtime"] == [True]  # the runtime's op is not tile_linear
    assert exit_status({"check": {"failed": auto}}) == 1


@needs_cpu
@pytest.mark.interpreter
def test_speed_times_copies_of_the_layer_in_turn_so_its_weights_come_from_hbm(monkeypatch):
    """With `cold_copies` copies (on a GPU: twice the L2 of weights), each timed call runs every copy of the
    layer once, of the dense weight and of patchc's layer alike, and the time is divided by their number."""
    from patchc.bench import speed
    from patchc.runtime.dispatch import TileLinear

    monkeypatch.setattr(speed, "cold_copies", lambda nbytes, device: 3)
    seen, real_forward, real_linear = [], TileLinear.forward, speed.F.linear
    monkeypatch.setattr(TileLinear, "forward", lambda self, x: seen.append(("tile", id(self))) or real_forward(self, x))
    monkeypatch.setattr(speed.F, "linear",
                        lambda x, w, *a: seen.append(("dense", w.data_ptr())) or real_linear(x, w, *a))

    calls = []

    def timer(fn):
        seen.clear()
        fn()
        calls.append(list(seen))
        return 6.0

    rows = speed.time_case(LayerCase((64, 96), 0.35, (32, 32), "fp16", (1,)), "cpu", timer, False, 0)
    assert [r["copies"] for r in rows] == [3] and rows[0]["dense_ms"] == rows[0]["tile_ms"] == 2.0
    dense, tile, other = calls  # one timing each (the last: split-K added the other way), every copy once
    assert {kind for kind, _ in dense} == {"dense"} and len({ptr for _, ptr in dense}) == 3
    assert {kind for kind, _ in tile} == {"tile"} and len({who for _, who in tile}) == 3
    assert {kind for kind, _ in other} == {"tile"} and len({who for _, who in other}) == 3


def test_error_bound_is_twice_cublas_plus_one_rounding():
    assert error_bound(1e-3, 4.0, torch.float16) == pytest.approx(2e-3 + 4.0 * 2**-11)
    assert error_bound(0.0, 1.0, torch.bfloat16) == pytest.approx(2**-8)


@pytest.mark.parametrize("kinds,expected", [(0.35, 0.35), (0.25, 0.25), ("2:4", 0.5), ("dense", 0.0)])
def test_layers_hit_their_sparsity_exactly(kinds, expected):
    layer = make_layer(LayerCase((256, 512), kinds, (64, 64), "fp16", ()), seed=3)
    assert 1 - layer.density == pytest.approx(expected, abs=1 / 64)  # 32 tiles: one tile is 1/64 of sparsity
    hybrid, dense = weight_bytes(layer, 2)
    assert dense == 256 * 512 * 2 and hybrid == pytest.approx(dense * (1 - 0.875 * expected), rel=0.02)


def test_tile_kinds_rejects_bad_sparsity():
    with pytest.raises(ValueError, match="sparsity in"):
        tile_kinds(64, 64, (32, 32), 0.7, torch.Generator())


def test_options_validate_with_clear_messages():
    with pytest.raises(ValueError, match="unknown"):
        BenchOptions(parts=("speeed",))
    with pytest.raises(ValueError, match="budget_s"):
        BenchOptions(budget_s=0)
    opts = BenchOptions(parts=("check", "e2e"), budget_s=100)
    assert opts.share("check") + opts.share("e2e") == pytest.approx(100)
    full = check_cases(BenchOptions())
    assert {c.shape for c in full} >= {(4096, 4096), (11008, 4096), (4096, 11008), (1000, 3000)}
    assert {c.tile for c in full} == {(128, 128), (64, 64)} and {c.dtype for c in full} == {"fp16", "bf16"}
    assert {c.kinds for c in full} == {"dense", "2:4", 0.25, 0.35, 0.45}


def test_case_filter_keeps_the_cases_it_names_and_refuses_one_that_keeps_none(capsys, tmp_path):
    only = BenchOptions(cases=("4096x11008", "t64x64 bf16"))
    kept = check_cases(only)
    assert kept and all("4096x11008" in c.label or "t64x64 bf16" in c.label for c in kept)
    assert len(kept) < len(check_cases(BenchOptions()))
    assert {c.shape for c in speed_cases(only)} == {(4096, 11008)}  # no bf16 speed case: the shape's alone
    with pytest.raises(ValueError, match=r"keeps none of the speed part's cases \(4096x4096 45% .*leave speed out"):
        BenchOptions(cases=("bf16",))
    assert check_cases(BenchOptions(cases=("bf16",), parts=("check",)))  # without the speed part it is fine
    with pytest.raises(ValueError, match="empty filter"):
        BenchOptions(cases=(" ",))
    out = tmp_path / "results"
    assert main(["bench", "--dry-run", "--case", "nothing", "--out", str(out), "--no-progress"]) == 2
    assert "--case 'nothing' keeps none of the check part's cases (96x160 2:4" in capsys.readouterr().err
    assert not out.exists()  # refused before anything ran or was written


def test_records_append_and_name_the_device(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"old": 1}')  # no trailing newline: the next line must not glue onto it
    append_jsonl(path, {"new": 2})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"old": 1}, {"new": 2}]
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert peak_bandwidth("NVIDIA H200") == 4.8e12 and peak_bandwidth("cpu") is None


def test_a_benchmarks_record_follows_its_environment(tmp_path, capsys):
    path = tmp_path / "kd_loss.jsonl"
    assert record_run(path, {"bench": "kd_loss", "rows": [{"now": 1.0}]}) == path
    assert record_run(path, {"bench": "kd_loss", "rows": []}) == path
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["rows"] == [{"now": 1.0}] and second["rows"] == [] and first["bench"] == "kd_loss"
    assert {"date", "device", "torch", "triton", "git_sha", "source_digest"} <= first.keys()
    assert first["device"].startswith("cpu") and not first["dry_run"]
    assert capsys.readouterr().out == f"appended to {path}\n" * 2


@needs_cpu
def test_without_a_gpu_the_bench_says_so(capsys):
    assert main(["bench", "--parts", "check", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "patchc bench: error:" in err and "needs a CUDA GPU" in err and "--dry-run" in err


def test_harness_imports_without_tqdm_and_refuses_a_late_interpreter():
    """`make gpu` runs on a bare image: patchc.bench must import without tqdm; a dry run in a process that
    imported triton compiled first gets a clear error instead of failing every kernel."""
    code = ("import sys; sys.modules['tqdm'] = None\n"
            "import triton, patchc.bench\n"
            "from patchc.bench.driver import BenchError, _use_interpreter\n"
            "try:\n    _use_interpreter()\nexcept BenchError as e:\n    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "REFUSED" in out.stdout and "TRITON_INTERPRET=1" in out.stdout


@needs_cpu
@pytest.mark.interpreter
def test_a_part_that_raises_is_recorded_and_the_others_kept(monkeypatch, tmp_path):
    from patchc.bench import driver as bench_run

    def broken_e2e(*args, **kwargs):
        raise RuntimeError("CUDA graph capture failed")

    monkeypatch.setattr(bench_run, "run_speed", lambda *a, **k: {"rows": [], "skipped": ["x"]})
    monkeypatch.setattr(bench_run, "run_e2e", broken_e2e)
    opts = BenchOptions(parts=("e2e", "speed"), dry_run=True, out_dir=tmp_path)
    record = bench_run.run(opts, progress=False)
    assert record["speed"]["skipped"] == ["x"] and "e2e" not in record  # the part after the failure still ran
    assert "CUDA graph capture failed" in record["errors"]["e2e"] and exit_status(record) == 1
    (md,) = tmp_path.glob("*.md")
    assert "FAILED: part e2e raised" in md.read_text() and "CUDA graph capture failed" in md.read_text()
    assert "errors" in json.loads(next(tmp_path.glob("*.jsonl")).read_text())


@needs_cpu
@pytest.mark.interpreter
def test_sigterm_mid_run_records_the_parts_done(tmp_path):
    """`timeout` sends SIGTERM: the record must still be written, with the parts finished before it."""
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "import patchc.bench.driver as bench_run\n"
        "bench_run.run_speed = lambda *a, **k: {'rows': [], 'skipped': ['kept']}\n"
        "def killed(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "bench_run.run_e2e = killed\n"
        "from patchc.bench import BenchOptions, exit_status\n"
        f"record = bench_run.run(BenchOptions(parts=('speed', 'e2e', 'experts'), dry_run=True, out_dir=Path({str(tmp_path)!r})), progress=False)\n"
        "sys.exit(10 + exit_status(record))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 11, proc.stderr[-2000:]
    record = json.loads(next(tmp_path.glob("*.jsonl")).read_text())
    assert record["interrupted"] == "e2e" and record["speed"]["skipped"] == ["kept"] and "experts" not in record
    assert "INTERRUPTED during part e2e" in next(tmp_path.glob("*.md")).read_text()


def test_run_cases_logs_a_line_per_case_without_a_bar(capsys):
    from patchc.bench.layers import Deadline, run_cases

    cases = [LayerCase((64, 64), 0.35, (32, 32), "fp16", (1,)), LayerCase((64, 96), "2:4", (32, 32), "fp16", (1,))]
    rows, skipped = run_cases(cases, lambda c: [{"M": 1, "speedup": 1.5, "case": c.label}], Deadline(60), "bench speed",
                              show=False)
    out = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and not skipped
    assert out[0].startswith("bench speed: 64x64 35% t32x32 fp16: M=1 1.50x (") and len(out) == 2


def test_check_compiles_every_variant_ahead_with_the_configs_it_runs(monkeypatch):
    """On a GPU the check part hands every (M, variant) config to the parallel compile first; the configs
    are the ones `tile_linear` resolves when it then runs them."""
    import patchc.runtime.timing as timing
    from patchc.bench.check import compile_case_ahead, variants
    from patchc.bench.layers import make_input
    from patchc.codegen import pack
    from patchc.codegen.configs import resolve_config

    seen = []
    monkeypatch.setattr(timing, "compile_parallel", lambda warmers, threads: seen.extend(w.args[-1] for w in warmers))
    case = LayerCase((96, 160), 0.35, (32, 32), "fp16", (1, 4, 17), explicit=True)
    packed = pack(make_layer(case, seed=0, bias=True), block=(32, 32))
    xs = {m: make_input(m, 160, torch.float16, "cpu", m) for m in case.ms}
    compile_case_ahead(case, packed, xs, "sm_90", threads=4)
    want = [resolve_config(c, packed, m, "sm_90") for m in case.ms for c in variants(m, True).values() if c != "runtime"]
    # M=1 and 4: auto, gemv, gemv_splitk (added in the kernel and by a second launch), dot; M=17: auto, dot,
    # the decode kernel at a prefill tile, 2 prefills, unpacked
    assert seen == want and len(seen) == 16
    seen.clear()
    compile_case_ahead(case, packed, xs, "sm_90", threads=1)
    assert seen == []


def test_source_digest_names_the_code_not_the_checkout(tmp_path):
    import shutil

    from patchc.bench.record import source_digest

    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "patchc", copy / "patchc", ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == source_digest(ROOT)  # another folder, no .git: the same code
    (copy / "patchc" / "bench" / "record.py").write_text((copy / "patchc" / "bench" / "record.py").read_text() + "#\n")
    assert source_digest(copy) != source_digest(ROOT)


def test_a_part_that_overran_shrinks_the_later_ones(monkeypatch, tmp_path):
    """Each part gets its weight's share of the time left when it starts, among the parts still to run."""
    from patchc.bench import driver as bench_run
    clock = [1000.0]
    given = {}

    def part(name, spent):
        def fn(*args, **kwargs):
            deadline = next(a for a in (*args, *kwargs.values()) if isinstance(a, bench_run.Deadline))
            given[name] = deadline.left()
            clock[0] += spent
            return {"rows": [], "skipped": [], "failed": []}
        return fn

    monkeypatch.setattr(bench_run.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sys.modules["patchc.bench.layers"].time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(bench_run, "run_checks", part("check", 150.0))  # its share is 75 s: 75 s over
    monkeypatch.setattr(bench_run, "run_speed", part("speed", 10.0))
    monkeypatch.setattr(bench_run, "run_experts", part("experts", 0.0))
    opts = BenchOptions(parts=("check", "speed", "experts"), dry_run=True, budget_s=200, out_dir=tmp_path)
    monkeypatch.setattr(bench_run, "pick_device", lambda dry_run: "cpu")
    bench_run.run(opts, progress=False)
    w = PART_WEIGHTS
    total = w["check"] + w["speed"] + w["experts"]
    assert given["check"] == pytest.approx(200 * w["check"] / total)
    assert given["speed"] == pytest.approx(50 * w["speed"] / (w["speed"] + w["experts"]))  # 50 s were left
    assert given["experts"] == pytest.approx(40)  # the last part gets all that is left
    assert opts.share("speed") == pytest.approx(200 * w["speed"] / total)  # the static share is unchanged


def test_speed_times_every_case_with_defaults_before_tuning_any(monkeypatch):
    """With tuning, a first pass times every case on the default configs, then a second tunes them, timing
    only patchc again (dense and cuSPARSELt come from the first pass); a deadline in the second pass leaves
    every case with its default-config number."""
    import patchc.bench.speed as speed
    import patchc.runtime.timing as timing
    from patchc.bench.layers import Deadline

    clock = [0.0]
    monkeypatch.setattr(sys.modules["patchc.bench.layers"].time, "monotonic", lambda: clock[0])
    events = []

    limits = []

    class Layer:
        def __init__(self, n, source):
            self.n, self.tuning = n, types.SimpleNamespace(source=source)

        def __call__(self, x):
            return torch.zeros(x.shape[0], self.n)

        def route(self, m):
            return "decode" if m <= 16 else "prefill"

        def config(self, m):
            return types.SimpleNamespace(kernel="decode", block_m=16, split_k=1, reduce="fixup", num_warps=4,
                                         num_stages=1)

    def runtime_layer(layer, dtype, device, tune, time_limit=None):
        events.append(tune)
        limits.append(time_limit)
        clock[0] += tuning_s if tune else 0.0
        return Layer(layer.shape[0], "partial" if tuning_s > 10 else "tuned")

    def timer(fn):
        timer_calls.append(fn)
        clock[0] += 2.0
        return 1.0

    monkeypatch.setattr(speed, "runtime_layer", runtime_layer)
    ahead = []
    monkeypatch.setattr(timing, "compile_ahead", lambda mods, ms: ahead.append(ms))
    cases = [LayerCase((64, 64), 0.35, (32, 32), "fp16", (1, 4)), LayerCase((64, 96), "2:4", (32, 32), "fp16", (1,))]
    timer_calls, tuning_s = [], 1.0
    out = speed.run_speed(cases, "cpu", timer, True, 0, Deadline(60), None, show=False)
    assert ahead == [[1, 4], [1], [1, 4], [1]]  # each module's kernels for every M, compiled before timing
    assert events == [False, False, True, True]  # every case untuned before any is tuned
    assert [(r["case"], r["M"], r["tuned"]) for r in out["rows"]] == [
        (cases[0].label, 1, False), (cases[0].label, 4, False), (cases[1].label, 1, False),
        (cases[0].label, 1, True), (cases[0].label, 4, True), (cases[1].label, 1, True)]
    assert len(timer_calls) == 3 * 2 + 3  # first pass: dense + patchc per row (no cuSPARSELt on CPU); then patchc
    assert all(r["dense_ms"] == 1.0 for r in out["rows"]) and not out["skipped"]
    assert [r["tuning"] for r in out["rows"]] == ["default"] * 3 + ["tuned"] * 3
    assert limits == [None, None, 60 - 12, 60 - 12 - 1 - 4]  # tuning stops at the part's deadline

    # tuning the first case takes 50 s: the 60 s deadline passes before the second is tuned
    events.clear()
    timer_calls, tuning_s = [], 50.0
    out = speed.run_speed(cases, "cpu", timer, True, 0, Deadline(60), None, show=False)
    assert events == [False, False, True] and out["skipped"] == [f"{cases[1].label} (tuned)"]
    assert [r["tuned"] for r in out["rows"]] == [False, False, False, True, True]
    assert out["rows"][-1]["tuning"] == "partial"
    # the default-config pass stops at its share of the part, leaving the rest to tuning
    events.clear()
    clock[0], tuning_s = 0.0, 1.0
    out = speed.run_speed(cases, "cpu", timer, True, 0, Deadline(15), None, show=False)  # first pass: 6 s
    assert events == [False, True, True] and out["skipped"] == [cases[1].label]


@needs_cpu
@pytest.mark.interpreter
def test_the_lease_script_runs_its_steps_and_keeps_their_records(tmp_path):
    """benchmarks/gpu_lease.sh (a whole GPU lease in one command), in its CPU form: a step runs under its cap
    and leaves its log and the bench's records; an unknown step is refused by name. Its bench step is
    `python -m patchc bench --dry-run` as typed, without TRITON_INTERPRET: `import patchc` has imported
    triton compiled, so the command must start itself again interpreted (it used to refuse)."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "DRY": "1", "PYTHON": sys.executable}
    script = str(ROOT / "benchmarks" / "gpu_lease.sh")
    out = subprocess.run(["bash", script, str(tmp_path), "bench"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "bench: exit 0 after" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "bench.log").exists() and json.loads(next(tmp_path.glob("cpu*.jsonl")).read_text())["experts"]
    out = subprocess.run(["bash", script, str(tmp_path), "offload"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert "offload: exit 0 after" in out.stdout, out.stdout + out.stderr
    assert json.loads((tmp_path / "offload.jsonl").read_text())["offload"]["same_logits"]
    bad = subprocess.run(["bash", script, str(tmp_path), "bench-all"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown step 'bench-all'" in bad.stderr


def test_end_to_end_runs_every_sparsity_on_default_configs_before_tuning():
    from patchc.bench.e2e import runs

    assert runs(BenchOptions(), cuda=True) == [(False, 0.45), (False, 0.35), (True, 0.45), (True, 0.35)]
    assert runs(BenchOptions(tune=False), cuda=True) == [(False, 0.45), (False, 0.35)]
    assert runs(BenchOptions(), cuda=False) == [(False, 0.45), (False, 0.35)]  # tuning needs a GPU
    assert runs(BenchOptions(dry_run=True), cuda=False) == [(False, 0.45)]
