"""Progress bars: tqdm where it is installed, the plain iterable where not (`make gpu` runs on a bare
GPU image with only torch, triton and numpy guaranteed).

Example:
    >>> list(progress(range(3), desc="steps", disable=True))
    [0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def progress(iterable: Iterable[T], **kwargs: Any) -> Iterable[T]:
    """`tqdm.auto.tqdm(iterable, **kwargs)`, or `iterable` itself without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, **kwargs)
