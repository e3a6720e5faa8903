"""Triton's interpreter (TRITON_INTERPRET=1), made to patch `triton.language` once per launch.

Under the interpreter every call of a `@triton.jit` helper from a kernel re-patches the language first
(`triton.runtime.interpreter._patch_lang`: `inspect.getmembers` over `tl`, `tl.tensor`, `tl.math`, ...,
about 0.3 ms a call; so in Triton 3.6 to 3.9, each checked). The launch itself has already patched those
modules and undoes it when it ends; a helper's patches are never undone, so they only ever re-install what
the launch put there. patchc's kernels call small helpers for every block (the 2:4 expansion, the split-K partials),
and that re-patching was a third of the time they take in the interpreter (`patchc bench --dry-run
--parts check`: 32 s, then 21 s on 2 AVX2 cores; every error the same to the bit).

`reuse_launch_patches()` makes a helper call inside a launch skip the re-patching when the launch already
patched every language module the helper's globals see; anything else goes to Triton's own function.
It changes nothing on a GPU (no interpreter runs) and leaves an interpreter it does not recognise alone.

`skip_unasserted_overflow_checks()`: every 32-bit integer add, sub and mul of a kernel (offsets, indices)
also computes its overflow check, the operands cast to int64, the op again, two compares and an `and`, for
a `device_assert` that drops the result unless the options say `debug` (compiled code drops those ops
too). The interpreter's options never say it (Triton 3.6 to 3.9: fixed `InterpreterOptions()`), so it ran
them all for nothing: 40% of `patchc bench --dry-run` (55 s, then 32 s on 2 AVX2 cores; every error the
same to the bit). Switching the check off where `debug` is off changes no result.

Example:
    >>> reuse_launch_patches()   # once; patchc.codegen.launch does both when TRITON_INTERPRET=1
    True
    >>> skip_unasserted_overflow_checks()
    True
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

_state: dict[str, Any] = {"installed": False, "patched": None}  # patched: ids of the modules this launch patched


class _Unchanged:
    """The scope of a re-patching that was skipped: nothing to restore."""

    def restore(self) -> None:
        pass


def _language_modules(fn: Any) -> set[int]:
    import triton.language as tl

    return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}


def reuse_launch_patches() -> bool:
    """Install the skip (idempotent); False, changing nothing, where Triton's interpreter lacks the
    `_patch_lang` / `GridExecutor.__call__` pair it wraps."""
    if _state["installed"]:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if not callable(patch_lang) or executor is None or not callable(getattr(executor, "__call__", None)):
        return False
    launch = executor.__call__

    def patch_once(fn: Any) -> Any:
        langs, patched = _language_modules(fn), _state["patched"]
        if patched is not None and langs and langs <= patched:
            return _Unchanged()
        scope = patch_lang(fn)
        if patched is not None:
            patched |= langs
        return scope

    def launch_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer, _state["patched"] = _state["patched"], set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state["patched"] = outer

    interpreter._patch_lang = patch_once
    executor.__call__ = launch_once
    _state["installed"] = True
    return True


def skip_unasserted_overflow_checks() -> bool:
    """Turn off the interpreter's integer-overflow checks when its `debug` option is off (their asserts are
    dropped then); False, changing nothing, where the options lack either field or `debug` is on."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    known = dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow")
    if not known or getattr(options, "debug", True):
        return False
    if options.sanitize_overflow:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


__all__ = ["reuse_launch_patches", "skip_unasserted_overflow_checks"]
