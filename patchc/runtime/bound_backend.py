"""`patchc.backend(plan, **options)`: the patch backend (`patchc.runtime.backend`) with its options bound.

``torch.compile`` takes ``mode=`` or ``options=``, not both, so with ``backend="patch"`` a plan and inductor's
mode must share ``options``; transformers' ``CompileConfig`` (``generate(..., compile_config=...)``) also
deep-copies whatever it is given. A bound backend leaves ``mode`` free and is its own deep copy.

Example:
    >>> cm = torch.compile(model, backend=patchc.backend(plan, strict=True), mode="reduce-overhead")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

from torch import fx

from patchc.runtime.backend import OPTION_KEYS, patch_backend


class PatchBackend:
    """The patch backend with its options bound (`patchc.backend`): ``torch.compile(model, backend=
    patchc.backend(plan), mode="reduce-overhead")``, where ``options=`` would have to carry the mode.

    A deep copy is the same backend: transformers' ``CompileConfig``, which deep-copies its fields, then serves
    the plan `unserved(plan)` is asked about, and packs no copy of it.

    Example:
        >>> model.generate(ids, cache_implementation="static",
        ...                compile_config=CompileConfig(backend=patchc.backend(plan)))  # doctest: +SKIP
    """

    __name__ = "patch"

    def __init__(self, plan: Any | None = None, *args: Any, **options: Any) -> None:
        if isinstance(plan, fx.GraphModule) or args:  # `backend=patchc.backend`: torch called it with a graph
            raise TypeError("patchc.backend takes the plan and options, and its result is the backend: "
                            "torch.compile(model, backend=patchc.backend(plan))")
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"patchc.backend: unknown option(s) {unknown}; known: {list(OPTION_KEYS)}")
        self.options = {**options, "plan": plan} if plan is not None else options

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
        if kwargs.get("options"):
            raise ValueError("patchc.backend: options are bound when it is made (patchc.backend(plan, strict=True)); "
                             "torch.compile's options= would replace them")
        return patch_backend(gm, example_inputs, mode=kwargs.get("mode"), options=self.options)

    def __deepcopy__(self, memo: dict) -> PatchBackend:
        return self


__all__ = ["PatchBackend"]
