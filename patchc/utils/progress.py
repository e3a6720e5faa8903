"""What a user sees while patchc works: progress bars (tqdm where it is installed, the plain iterable where
not: `make gpu` runs on a bare GPU image with only torch, triton and numpy guaranteed), transformers' own
bars off where unwanted, patchc's log lines on stderr for `patchc -v`, and its warnings as one line each.

Example:
    >>> list(progress(range(3), desc="steps", disable=True))
    [0, 1, 2]
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def progress(iterable: Iterable[T], **kwargs: Any) -> Iterable[T]:
    """`tqdm.auto.tqdm(iterable, **kwargs)`, or `iterable` itself without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, **kwargs)


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' own progress bars (loading weights) off for the duration, as they were after.

    A job reloads the dense model for every baseline: one bar per reload is noise, and `--no-progress`
    asks for none. Without transformers installed there is nothing to silence.

    Example:
        >>> with quiet_loading():
        ...     model = transformers.AutoModel.from_pretrained("/path/to/model")  # doctest: +SKIP
    """
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def logs_shown(verbosity: int) -> Iterator[None]:
    """The `patchc.*` loggers' lines on stderr at INFO (verbosity 1) or DEBUG (2+), for the duration.

    Scoped, so a command run from a notebook or a test leaves that program's logging as it was. At 0 nothing
    is attached: Python's last-resort handler still prints warnings.

    Example:
        >>> with logs_shown(1):
        ...     logging.getLogger("patchc.models.offload").info("--offload: prefetching the next block")
    """
    if verbosity <= 0:
        yield
        return
    logger = logging.getLogger("patchc")
    handler = logging.StreamHandler(sys.stderr)  # the stderr of now (a test's capture), not of import time
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def warnings_as_lines(prefix: str) -> Iterator[None]:
    """patchc's own warnings printed as `<prefix>: warning: <message>` on stderr for the duration, as its errors
    are; other libraries' keep Python's form (file, line and source line), which says whose they are.

    Example:
        >>> with warnings_as_lines("patchc eval"):
        ...     run_eval()   # prints "patchc eval: warning: --offload on cpu: ..."   # doctest: +SKIP
    """
    shown = warnings.showwarning
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # patchc/, not a venv beside it

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not os.path.abspath(str(filename)).startswith(package):
            return shown(message, category, filename, lineno, file, line)
        print(f"{prefix}: warning: {message}", file=file or sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
