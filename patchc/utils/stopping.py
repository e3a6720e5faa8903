"""Stopping between two steps: SIGTERM (a scheduler, a machine shutting down) or Ctrl-C that arrives while a
training loop runs lets it finish the step, write its checkpoint and then exit, instead of ending mid-step
and losing every step since the last checkpoint (which comes every few minutes at most on a large model:
`patchc/masking/cadence.py`). A second signal ends the process at once; outside a loop the first does.

    with exit_on_signals():                  # the job, around its work: installs the handlers
        ...
        with stoppable():                    # a training loop
            for t in steps:
                train_step(t)
                if (signum := stop_requested()) is not None:
                    save_checkpoint()
                    stop_now(signum)         # SystemExit(143) for SIGTERM, KeyboardInterrupt for Ctrl-C

Torch-free; handlers exist only in the main thread (elsewhere nothing is installed and nothing changes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

_state = {"installed": False, "loops": 0, "requested": None}
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_now(signum: int) -> None:
    """End the process as `signum` would have: KeyboardInterrupt for Ctrl-C, SystemExit(128 + n) otherwise.
    Both unwind the `finally` blocks (the run folder's claim is released, no file is left half-written)."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _on_signal(signum: int, _frame) -> None:
    if _state["loops"] and _state["requested"] is None:
        _state["requested"] = signum
        if os.environ.get("RANK", "0") == "0":  # torchrun forwards the signal to every rank: one notice
            print(f"patchc: {signal.Signals(signum).name}: stopping after this step, once its checkpoint is "
                  "written (send it again to stop at once)", file=sys.stderr, flush=True)
        return
    _state["requested"] = None  # acted on here: a loop that ends now must not stop a second time
    stop_now(signum)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """SIGTERM and Ctrl-C stop a `stoppable` loop between steps; elsewhere they end the block at once, as
    SystemExit(143) / KeyboardInterrupt in the main thread (SIGTERM would otherwise end the process without
    running any `finally`, leaving the run folder claimed).

    Example:
        >>> with exit_on_signals():
        ...     report = _run(...)
    """
    if threading.current_thread() is not threading.main_thread() or _state["installed"]:
        yield  # handlers live in the main thread; an outer block already installed them
        return
    previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    _state.update(installed=True, requested=None)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _state.update(installed=False, requested=None)


@contextlib.contextmanager
def stoppable() -> Iterator[bool]:
    """A loop that checks `stop_requested()` after each step; yields whether signals are handled at all
    (under torchrun every rank must then agree on the stop: `patchc.masking.train` does). A request the loop
    ended without acting on stops the process as it leaves the block: a signal is never lost."""
    _state["loops"] += 1
    try:
        yield _state["installed"]
    finally:
        _state["loops"] -= 1
    if _state["requested"] is not None and not _state["loops"]:  # the block ended normally
        signum, _state["requested"] = _state["requested"], None
        stop_now(signum)


def stop_requested() -> int | None:
    """The signal that asked the running loop to stop, or None."""
    return _state["requested"]


__all__ = ["exit_on_signals", "stoppable", "stop_requested", "stop_now"]
