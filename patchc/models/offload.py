"""A model larger than the GPU, run there anyway: its transformer blocks wait in host memory and each is
copied onto the device for its own forward only.

    host:    model.layers.0 .. model.layers.N-1            (pinned where it can be: faster copies)
    device:  embeddings, final norm, head, ...             (everything outside the blocks)
    forward: copy block i to the device -> run it -> drop the copy -> block i + 1
    prefetch (a GPU with room for it): block i + 1's copy starts on a side CUDA stream as block i starts to
             run, so PCIe and the GPU's compute overlap instead of taking turns

The copy is dropped, never copied back: the host tensors stay the weights, so nothing a forward does to a
copy outlives it. A forward of LLaMA-2-70B in bf16 then holds the parts outside the blocks (1.0 GB) and one
block (1.7 GB) on the GPU instead of 138 GB (one more with prefetch), and moves every block's bytes over PCIe
once per forward: for scoring and sampling (`patchc eval --offload`, `patchc sample --offload`), not for
training. A prefetched copy lives within one forward of the model: the weights may change between forwards
(`patchc eval` writes the plan into them), so the first block of each forward is copied as it starts.

Example:
    >>> stream = stream_blocks(model, "cuda")          # doctest: +SKIP
    >>> logits = model(ids.cuda()).logits                # doctest: +SKIP
    >>> stream.remove()                                  # back in host memory, whole; doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from patchc.utils.names import block_path

STREAM_ATTR = "_patchc_stream"
PREFETCH_ROOM = 4  # prefetch when free GPU memory holds this many blocks: the second copy takes a quarter at most

log = logging.getLogger(__name__)


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
    most one, between a block's pre- and post-forward hooks); `arriving` the block whose copy is prefetched.

    `prefetch`: as a block starts to run, start copying the block that followed it in this forward the last
    time (the list's next at first; XLM runs its two lists' items in turn), on a side CUDA stream. None: on a
    GPU whose free memory holds `PREFETCH_ROOM` of the largest block beside the resident parts. A block that
    does not come next after all (`misses`) is copied when it runs, as without prefetch.

    `poison` (tests): between its forwards a block's floating-point tensors hold NaN and the weights wait
    aside, so a weight read outside its block's forward, which on a GPU would be a device mismatch, turns the
    output NaN on a CPU too.
    """

    def __init__(self, model: nn.Module, device: str | torch.device, poison: bool = False,
                 prefetch: bool | None = None) -> None:
        self.model = model
        self.device = _indexed(device)
        self.poison = poison
        self.prefetch = prefetch
        self._aside: dict[int, torch.Tensor] = {}  # id(tensor) -> its weights, while poisoned
        self.blocks = blocks_of(model)
        if not self.blocks:
            raise ValueError(f"--offload: {type(model).__name__} has no transformer blocks patchc can find "
                             "(modules named layers.N, layer.N, h.N, blocks.N or block.N, or an nn.ModuleList's "
                             "items) to stream one at a time")
        inside = {id(t) for _, b in self.blocks for t in _tensors(b)} - _held_outside(model, self.blocks)
        self.resident = [t for t in _tensors(model) if id(t) not in inside]
        self._resident = {id(t) for t in self.resident}
        self.on_device: list[str] = []
        self.copies_made = self.prefetched = self.misses = 0
        self._hooks: list = []
        self._held: dict[str, list] = {}  # block path -> (tensor, its host data) while the block runs
        self._next = {path: after for (path, _), (after, _) in zip(self.blocks, self.blocks[1:])}
        self._last: str | None = None  # the block that ran last in this forward of the model; None outside one
        self._ahead: _Copies | None = None
        self._copier: torch.cuda.Stream | None = None

    def install(self) -> BlockStream:
        """Move the resident tensors to the device, pin the blocks' host tensors, hook every block."""
        for t in self.resident:
            t.data = t.data.to(self.device)
        for path, block in self.blocks:
            for t in self.streamed(block):
                if id(t) not in self._aside:
                    t.data = _pinned(t.data.to("cpu"), self.device)
                    if self.poison and t.is_floating_point():
                        self._aside[id(t)], t.data = t.data, torch.full_like(t.data, float("nan"))
            self._hooks.append(block.register_forward_pre_hook(self._loader(path, block)))
            self._hooks.append(block.register_forward_hook(lambda *_, path=path: self._unload(path), always_call=True))
        # a forward of the model bounds what is learned of the order and how long a prefetched copy may live
        self._hooks.append(self.model.register_forward_pre_hook(lambda *_: self._begin()))
        self._hooks.append(self.model.register_forward_hook(lambda *_: self._end(), always_call=True))
        if self.prefetch is None:
            self.prefetch = self._room_for_prefetch()
        if self.prefetch and self.device.type == "cuda":
            self._copier = torch.cuda.Stream(self.device)
        setattr(self.model, STREAM_ATTR, self)
        return self

    def streamed(self, block: nn.Module) -> list[torch.Tensor]:
        """`block`'s tensors that stream: all but the resident ones (a weight tied to one outside the blocks)."""
        return [t for t in _tensors(block) if id(t) not in self._resident]

    @property
    def arriving(self) -> str | None:
        return None if self._ahead is None else self._ahead.path

    def remove(self) -> None:
        """Unhook the blocks and bring the resident tensors back to host memory: the model is whole on the host."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._end()
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
        self._release()
        for t in self.resident:
            t.data = t.data.to("cpu")

    def unpark(self) -> None:
        for t in self.resident:
            t.data = t.data.to(self.device)

    def _loader(self, path: str, block: nn.Module):
        def load(_module, _args):
            copies = self._arrived(path)
            if copies is None:
                copies = [s.to(self.device, non_blocking=True, copy=True) for s in self._sources(path)]
                self.copies_made += 1
            held = [(t, t.data) for t in self.streamed(block)]
            for (t, _), copy in zip(held, copies):
                t.data = copy
            self._held[path] = held
            self.on_device.append(path)
            if self._last is not None:  # inside a forward of the model: learn the order, prefetch what comes next
                if self._last:
                    self._next[self._last] = path
                self._last = path
                if self.prefetch and path in self._next:
                    self._fetch(self._next[path])

        return load

    def _begin(self) -> None:
        self._release()
        self._last = ""  # inside a forward, before its first block

    def _end(self) -> None:
        self._release()
        self._last = None

    def _release(self) -> None:
        """Drop the prefetched copy, and any block copy still installed: a forward that a KeyboardInterrupt
        cut short (not an Exception, so torch skips the always-called post-hooks) left its block's."""
        self._drop()
        for path in list(self._held):
            self._unload(path)

    def _fetch(self, path: str) -> None:
        """Start copying block `path` to the device, on the side stream on a GPU so that the running block's
        kernels go on meanwhile. The copies are allocated on the current stream, which reuses the memory of
        the block before in its own order, and the side stream waits for it to get there: two blocks at most,
        however far ahead of the GPU the host runs."""
        sources = self._sources(path)
        if self._copier is None:
            self._ahead = _Copies(path, [s.to(self.device, copy=True) for s in sources], None)
        else:
            copies = [torch.empty_like(s, device=self.device) for s in sources]
            self._copier.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copier):
                for copy, source in zip(copies, sources):
                    copy.copy_(source, non_blocking=True)
            self._ahead = _Copies(path, copies, self._copier.record_event())
        self.copies_made += 1

    def _sources(self, path: str) -> list[torch.Tensor]:
        """Block `path`'s weights in host memory, in `streamed` order, even while a copy is installed: a block
        that runs twice in a row (ALBERT's shared layer, HRM's loops) prefetches itself, a block may share a
        weight with the one running, and a side-stream read of an installed copy would race its release when
        that forward ends."""
        installed = {id(t): host for held in self._held.values() for t, host in held}
        block = self.model.get_submodule(path)
        return [self._aside.get(id(t), installed.get(id(t), t.data)) for t in self.streamed(block)]

    def _arrived(self, path: str) -> list[torch.Tensor] | None:
        """The prefetched copies of block `path`, ready for the current stream, or None (another block's are
        dropped: it did not come next)."""
        if self._ahead is None:
            return None
        if self._ahead.path != path:
            self.misses += 1
            self._drop()
            return None
        ahead, self._ahead = self._ahead, None
        if ahead.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ahead.ready)
        self.prefetched += 1
        return ahead.copies

    def _drop(self) -> None:
        """Forget the prefetched copy; the current stream first waits for its copying to end, since it may
        reuse that memory at once."""
        if self._ahead is not None and self._ahead.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ahead.ready)
        self._ahead = None

    def _room_for_prefetch(self) -> bool:
        if self.device.type != "cuda":
            return False  # a copy on the host takes the cores the forward runs on: nothing to overlap
        largest = max(sum(t.nbytes for t in self.streamed(b)) for _, b in self.blocks)
        free, _ = torch.cuda.mem_get_info(self.device)
        room = free >= PREFETCH_ROOM * largest
        log.info("--offload: %s the next block (%.2f GB free on %s, %.2f GB a block)",
                 "prefetching" if room else "not prefetching", free / 1e9, self.device, largest / 1e9)
        return room

    def _unload(self, path: str) -> None:
        for t, host in self._held.pop(path, ()):
            t.data = host  # the copy is dropped: the host tensor never stopped being the weight
        if path in self.on_device:
            self.on_device.remove(path)


@dataclass
class _Copies:
    """A block's prefetched device copies, in `streamed` order; `ready`: recorded on the side stream after them."""

    path: str
    copies: list[torch.Tensor]
    ready: torch.cuda.Event | None


def device_share(model: nn.Module) -> tuple[int, int]:
    """(elements that stay on the device, elements of the largest block): what a streamed `model` holds there
    at once, beside its activations. Works on a model built on the meta device."""
    stream = BlockStream(model, "meta")
    blocks = [sum(t.numel() for t in stream.streamed(b)) for _, b in stream.blocks]
    return sum(t.numel() for t in stream.resident), max(blocks)


def stream_blocks(model: nn.Module, device: str | torch.device, poison: bool = False,
                  prefetch: bool | None = None) -> BlockStream:
    """Run `model` on `device` with its blocks in host memory, one copied over for each block's forward.

    Returns the installed `BlockStream` (`.remove()` takes the hooks off). A model streamed already is
    returned as it is streamed. `poison`: NaN in the blocks between their forwards; `prefetch`: copy the next
    block while one runs (None: on a GPU with room for it; `BlockStream`).

    Example:
        >>> stream = stream_blocks(model, "cuda")   # doctest: +SKIP
        >>> model(ids.cuda())                      # one block on the GPU at a time; doctest: +SKIP
    """
    current = streaming(model)
    if current is not None:
        if current.device != _indexed(device):
            raise ValueError(f"the model is streamed to {current.device} already, not {device}")
        return current
    return BlockStream(model, device, poison, prefetch).install()


def streaming(model: nn.Module) -> BlockStream | None:
    """The `BlockStream` installed on `model`, or None."""
    return getattr(model, STREAM_ATTR, None)


def _indexed(device: str | torch.device) -> torch.device:
    """`device` with its index: "cuda" is the GPU current now, which the side stream and its waits must share."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
