"""`patchc.codegen.interpreter`: under TRITON_INTERPRET=1 a kernel's helper calls reuse the patches of
their launch (Triton patches `triton.language` once per launch, not once per helper call), and integer ops
skip the overflow checks no assert reads, with the same results, under this Triton and the older one GPU
machines have."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import older_triton_env, older_triton_params

pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")]

# Launches a kernel whose programs call a helper 6 times each, counting Triton's `_patch_builtin` calls
# (its `_patch_lang` makes 4 per call: tl, tl.tensor, tl.math, tensor_descriptor_base), with the reuse
# off and then on; prints both counts and whether the outputs agree with torch.
SCRIPT = r"""
import torch, triton, triton.language as tl
from triton.runtime import interpreter

@triton.jit
def twice(v):
    return v * 2

@triton.jit
def kernel(x_ptr, y_ptr, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    for _ in tl.static_range(ROUNDS):
        v = twice(v) - v
    tl.store(y_ptr + offs, twice(v))

calls = [0]
builtin = interpreter._patch_builtin
def counted(*args, **kwargs):
    calls[0] += 1
    return builtin(*args, **kwargs)
interpreter._patch_builtin = counted

def run():
    x = torch.arange(32, dtype=torch.float32)
    y = torch.empty_like(x)
    calls[0] = 0
    kernel[(4,)](x, y, BLOCK=8, ROUNDS=5)
    return calls[0], torch.equal(y, 2 * x)

before = run()
from patchc.codegen.interpreter import reuse_launch_patches, _state
installed = reuse_launch_patches()
after = run()
print(triton.__version__, installed, before, after, _state["patched"] is None)
"""


# Launches a kernel of int32 index and value arithmetic (the last add wraps around), counting the signed
# `<=` compares the interpreter builds (the overflow check makes one per int32 add or mul; the kernel none),
# with the checks on and then skipped; prints both counts, the outputs and torch's own int32 result.
OVERFLOW_SCRIPT = r"""
import json, torch, triton, triton.language as tl
from triton.runtime import interpreter

@triton.jit
def kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, v * 3 + 2147483000, mask=offs < n)

compares = [0]
sle = interpreter.InterpreterBuilder.create_icmpSLE
def counted(self, *args):
    compares[0] += 1
    return sle(self, *args)
interpreter.InterpreterBuilder.create_icmpSLE = counted

def run():
    x = torch.arange(-300, 300, 20, dtype=torch.int32)
    y = torch.full_like(x, -1)
    compares[0] = 0
    kernel[(4,)](x, y, x.numel(), BLOCK=8)
    return compares[0], y.tolist(), (x * 3 + 2147483000).tolist()

before = run()
from patchc.codegen.interpreter import skip_unasserted_overflow_checks
installed = skip_unasserted_overflow_checks()
print(json.dumps([triton.__version__, installed, before, run()]))
"""


def _run(script: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _counts(env: dict[str, str]) -> list[str]:
    return _run(SCRIPT, env).split()


def _check(words: list[str]) -> None:
    version, installed, before, after, reset = words[0], words[1], " ".join(words[2:4]), " ".join(words[4:6]), words[6]
    assert installed == "True", f"Triton {version}: the reuse did not install"
    # 4 programs x 6 helper calls each re-patch the language: 25 patchings, 100 module walks; then one
    assert before == "(100, True)" and after == "(4, True)", (version, before, after)
    assert reset == "True", "the launch's record of patched modules outlived the launch"


def test_helper_calls_reuse_the_launchs_patches_and_give_the_same_output():
    _check(_counts(older_triton_env(None, TRITON_INTERPRET="1")))


@pytest.mark.parametrize("triton_dir", older_triton_params())
def test_the_same_under_an_older_triton(triton_dir):
    _check(_counts(older_triton_env(triton_dir, TRITON_INTERPRET="1")))


def _check_overflow(out: str) -> None:
    version, installed, (checks_on, got_on, want), (checks_off, got_off, _) = json.loads(out)
    assert installed, f"Triton {version}: the overflow checks were not skipped"
    assert checks_on >= 4 * 4 and checks_off == 0, (version, checks_on, checks_off)  # 4 programs x 4 int32 ops
    assert got_on == got_off == want  # wraps around as int32 does, checked or not
    assert any(v < 0 for v in want[-5:])  # the last values did wrap


@pytest.mark.parametrize("triton_dir", [pytest.param(None, id="this-triton"), *older_triton_params()])
def test_integer_ops_skip_the_overflow_checks_no_assert_reads(triton_dir):
    _check_overflow(_run(OVERFLOW_SCRIPT, older_triton_env(triton_dir, TRITON_INTERPRET="1")))


def test_a_failed_launch_leaves_no_record_behind():
    """An error inside a launch (here the kernel's own `tl.arange(0, 5)`) must not leave later launches thinking
    the language is patched: Triton undoes the launch's patches however it ends."""
    import triton
    import triton.language as tl

    from patchc.codegen.interpreter import _state, reuse_launch_patches

    @triton.jit
    def bad_kernel(x_ptr):
        tl.store(x_ptr + tl.arange(0, 4), tl.load(x_ptr + tl.arange(0, 5)))  # arange of 5: not a power of 2

    assert reuse_launch_patches()
    with pytest.raises(Exception, match="power of 2|arange"):
        bad_kernel[(1,)](torch.zeros(8))
    assert _state["patched"] is None
