"""Where the real material lives: `../shared` beside the repository (models, text), or $PATCHC_SHARED.

It is read at run time, never copied into the project.

Example:
    >>> STORIES260K_DIR / "stories260K.bin"
    PosixPath('.../shared/models/stories260K/stories260K.bin')
"""

from __future__ import annotations

import os
from pathlib import Path


def shared_dir() -> Path:
    """Where the shared real material (models, data) lives: $PATCHC_SHARED, else <repo root>/../shared.

    The repo root is the directory holding the `patchc` package (this file is patchc/models/shared.py).

    Example:
        >>> shared_dir() / "models" / "stories260K" / "stories260K.bin"
    """
    env = os.environ.get("PATCHC_SHARED")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2].parent / "shared"


SHARED_DIR: Path = shared_dir()
STORIES260K_DIR: Path = SHARED_DIR / "models" / "stories260K"
