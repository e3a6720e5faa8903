"""A model larger than the GPU, run there anyway: its transformer blocks wait in host memory and each is
copied onto the device for its own forward only.

    host:    model.layers.0 .. model.layers.N-1            (pinned where it can be: faster copies)
    device:  embeddings, final norm, head, ...             (everything outside the blocks)
    forward: copy block i to the device -> run it -> drop the copy -> block i + 1

The copy is dropped, never copied back: the host tensors stay the weights, so nothing a forward does to a
copy outlives it. A forward of LLaMA-2-70B in bf16 then holds the parts outside the blocks (1.0 GB) and one
block (1.7 GB) on the GPU instead of 138 GB, and moves every block's bytes over PCIe once per forward: for
scoring and sampling (`patchc eval --offload`, `patchc sample --offload`), not for training.

Example:
    >>> stream = stream_blocks(model, "cuda")          # doctest: +SKIP
    >>> logits = model(ids.cuda()).logits                # doctest: +SKIP
    >>> stream.remove()                                  # back in host memory, whole; doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from patchc.utils.names import block_path

STREAM_ATTR = "_patchc_stream"


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of each outermost transformer block (`block_path`: `layers.N`, `h.N`, `blocks.N`, ...);
    for a model without such blocks, the items of its outermost `nn.ModuleList`s (XLM keeps a layer's attention
    and FFN in parallel lists, `attentions.N` and `ffns.N`: each item streams on its own)."""
    found = [(path, m) for path, m in model.named_modules() if path and block_path(path) == path]
    if found:
        return found
    lists = [path for path, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    outer = [p for p in lists if not any(p.startswith(q + ".") for q in lists)]
    return [(f"{p}.{name}", child) for p in outer for name, child in model.get_submodule(p).named_children()]


class BlockStream:
    """The hooks `stream_blocks` installs on a model: each block onto `device` for its forward only.

    `resident`: the tensors outside the blocks, moved to the device once; a tensor that a block shares with
    them (a tied weight) is resident too. `on_device` names the blocks whose copies are on the device now (at
    most one, between a block's pre- and post-forward hooks).

    `poison` (tests): between its forwards a block's floating-point tensors hold NaN and the weights wait
    aside, so a weight read outside its block's forward, which on a GPU would be a device mismatch, turns the
    output NaN on a CPU too.
    """

    def __init__(self, model: nn.Module, device: str | torch.device, poison: bool = False) -> None:
        self.model = model
        self.device = torch.device(device)
        self.poison = poison
        self._aside: dict[int, torch.Tensor] = {}  # id(tensor) -> its weights, while poisoned
        self.blocks = blocks_of(model)
        if not self.blocks:
            raise ValueError(f"--offload: {type(model).__name__} has no transformer blocks patchc can find "
                             "(modules named layers.N, layer.N, h.N, blocks.N or block.N, or an nn.ModuleList's "
                             "items) to stream one at a time")
        inside = {id(t) for _, b in self.blocks for t in _tensors(b)} - _held_outside(model, self.blocks)
        self.resident = [t for t in _tensors(model) if id(t) not in inside]
        self.on_device: list[str] = []
        self.copies_made = 0
        self._hooks: list = []
        self._held: dict[str, list] = {}  # block path -> (tensor, its host data) while the block runs

    def install(self) -> BlockStream:
        """Move the resident tensors to the device, pin the blocks' host tensors, hook every block."""
        resident = {id(t) for t in self.resident}
        for t in self.resident:
            t.data = t.data.to(self.device)
        for path, block in self.blocks:
            for t in _tensors(block):
                if id(t) not in resident and id(t) not in self._aside:
                    t.data = _pinned(t.data.to("cpu"), self.device)
                    if self.poison and t.is_floating_point():
                        self._aside[id(t)], t.data = t.data, torch.full_like(t.data, float("nan"))
            self._hooks.append(block.register_forward_pre_hook(self._loader(path, block, resident)))
            self._hooks.append(block.register_forward_hook(self._unloader(path, block, resident), always_call=True))
        setattr(self.model, STREAM_ATTR, self)
        return self

    def remove(self) -> None:
        """Unhook the blocks and bring the resident tensors back to host memory: the model is whole on the host."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for t in self.resident:
            t.data = t.data.to("cpu")
        for _, block in self.blocks:
            for t in _tensors(block):
                if id(t) in self._aside:
                    t.data = self._aside.pop(id(t))
        if getattr(self.model, STREAM_ATTR, None) is self:
            delattr(self.model, STREAM_ATTR)

    def park(self) -> None:
        """The resident tensors to host memory (`patchc.job.model.parked`); `unpark` brings them back."""
        for t in self.resident:
            t.data = t.data.to("cpu")

    def unpark(self) -> None:
        for t in self.resident:
            t.data = t.data.to(self.device)

    def _loader(self, path: str, block: nn.Module, resident: set[int]):
        def load(_module, _args):
            held = [(t, t.data) for t in _tensors(block) if id(t) not in resident]
            for t, host in held:
                t.data = self._aside.get(id(t), host).to(self.device, non_blocking=True, copy=True)
            self._held[path] = held
            self.on_device.append(path)
            self.copies_made += 1

        return load

    def _unloader(self, path: str, block: nn.Module, resident: set[int]):
        def unload(_module, _args, _output):
            for t, host in self._held.pop(path, ()):
                t.data = host  # the copy is dropped: the host tensor never stopped being the weight
            if path in self.on_device:
                self.on_device.remove(path)

        return unload


def device_share(model: nn.Module) -> tuple[int, int]:
    """(elements that stay on the device, elements of the largest block): what a streamed `model` holds there
    at once, beside its activations. Works on a model built on the meta device."""
    stream = BlockStream(model, "meta")
    resident = {id(t) for t in stream.resident}
    blocks = [sum(t.numel() for t in _tensors(b) if id(t) not in resident) for _, b in stream.blocks]
    return sum(t.numel() for t in stream.resident), max(blocks)


def stream_blocks(model: nn.Module, device: str | torch.device, poison: bool = False) -> BlockStream:
    """Run `model` on `device` with its blocks in host memory, one copied over for each block's forward.

    Returns the installed `BlockStream` (`.remove()` takes the hooks off). A model streamed already is
    returned as it is streamed. `poison`: NaN in the blocks between their forwards (`BlockStream`; tests).

    Example:
        >>> stream = stream_blocks(model, "cuda")   # doctest: +SKIP
        >>> model(ids.cuda())                      # one block on the GPU at a time; doctest: +SKIP
    """
    current = streaming(model)
    if current is not None:
        if current.device != torch.device(device):
            raise ValueError(f"the model is streamed to {current.device} already, not {device}")
        return current
    return BlockStream(model, device, poison).install()


def streaming(model: nn.Module) -> BlockStream | None:
    """The `BlockStream` installed on `model`, or None."""
    return getattr(model, STREAM_ATTR, None)


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Each parameter and buffer of `module` once (tied ones once)."""
    seen: set[int] = set()
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def _held_outside(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> set[int]:
    """ids of the tensors a module outside every block holds (a weight tied to one inside is among them)."""
    paths = tuple(path + "." for path, _ in blocks)
    held: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if not path or not (path + ".").startswith(paths):
            held.update(id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)
    return held


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` in page-locked memory when it will be copied to a GPU (twice the copy speed), else as it is."""
    if device.type != "cuda":
        return host
    try:
        return host.pin_memory()
    except RuntimeError:  # pinned memory is limited on some hosts: pageable copies still work
        return host


__all__ = ["BlockStream", "blocks_of", "device_share", "stream_blocks", "streaming"]
