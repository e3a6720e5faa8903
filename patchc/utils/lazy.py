"""A package's public names imported on first use (PEP 562), so that importing it costs nothing.

`patchc --help` and a mistyped flag should answer at once; importing torch alone takes seconds. So the
packages the command line passes through (`patchc`, `patchc.job`, `patchc.models`, `patchc.bench`) name
what they export in a table, and each name is imported the first time it is read.

Example:
    >>> __getattr__, __dir__ = lazy_exports(__name__, names_of("patchc.job.prune", "run_prune"))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def names_of(module: str, *names: str) -> dict[str, tuple[str, str]]:
    """Table entries for `names` exported under their own names from `module`."""
    return {name: (module, name) for name in names}


def lazy_exports(package: str, table: dict[str, tuple[str, str | None]]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for `package`: name -> (module, attribute, or None for the module itself).
    A name outside the table that is a subpackage (`patchc.ir`) is imported as one."""

    def __getattr__(name: str):
        if name in table:
            module_name, attr = table[name]
            module = importlib.import_module(module_name)
            return module if attr is None else getattr(module, attr)
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"{package}.{name}":  # the module exists but an import inside it failed
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*table, *importlib.import_module(package).__dict__})

    return __getattr__, __dir__


__all__ = ["lazy_exports", "names_of"]
