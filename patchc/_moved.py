"""Old module paths from before the stage folders, kept importable for one release with a DeprecationWarning.

`import patchc.tile_plan` (or `from patchc.tile_plan import TilePlan`) still works: a finder on
`sys.meta_path` answers the old name with the module that now holds the code, so both names are one
module object, and warns once per old name. `patchc.transform` and `patchc.harden` are not here: they
are the public functions of those names.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from patchc.tile_plan import TilePlan
    >>> TilePlan is patchc.TilePlan, caught[0].category.__name__
    (True, 'DeprecationWarning')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

# old path -> new path; remove after release 0.2
MOVED = {
    "patchc.tile_plan": "patchc.ir",
    "patchc.hybrid_mask": "patchc.masking.hybrid_mask",
    "patchc.training": "patchc.masking.train",
    "patchc.masks": "patchc.pruning.mask_files",
    "patchc.files": "patchc.utils.files",
    "patchc.env": "patchc.utils.env",
    "patchc.names": "patchc.utils.names",
    "patchc.data": "patchc.job.data",
    "patchc.evaluate": "patchc.job.evaluate",
    "patchc.encoder_eval": "patchc.job.encoder_eval",
    "patchc.report": "patchc.job.report",
    "patchc.cli": "patchc.job.cli",
}


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the new module itself (no copy: one module object under two names)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # stacklevel 2: the import machinery's own frames are skipped, so this names the user's import line
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there (the old path goes away in "
                      "patchc 0.2)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__  # the import system overwrites __spec__ with the old name's spec
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the module was executed under its new name already


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new)) if new else None


def install() -> None:
    """Put the finder on `sys.meta_path` once (idempotent: reloading patchc adds no second one)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
