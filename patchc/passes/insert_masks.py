"""Rewrite passes: splice a mask module (or an input observer) into annotated matmuls.

    before:  W = get_attr[fqn] ──> permute ──> addmm(b, x, ·)
    after:   W = get_attr[fqn] ──> call_module[patchc_masks.<name>](W) ──> permute ──> addmm(b, x, ·)

Only the use on the path to the annotated matmul is rewired, so a weight that is read elsewhere
(a tied embedding) keeps its original value there. A weight read by several matmuls gets one mask
node, shared.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from patchc.passes.find_linears import LinearSite

MASKS_ATTR = "patchc_masks"
OBSERVERS_ATTR = "patchc_observers"


def module_key(fqn: str) -> str:
    """A submodule-safe key for a weight FQN ("layers.0.mlp.up_proj.weight" -> "layers_0_mlp_up_proj_weight")."""
    return re.sub(r"[^0-9A-Za-z_]", "_", fqn)


def _container(gm: fx.GraphModule, attr: str) -> nn.Module:
    if not hasattr(gm, attr):
        gm.add_module(attr, nn.Module())
    return getattr(gm, attr)


class InsertMasks(PassBase):
    """Insert one `call_module` mask node per masked weight, between the weight and its matmul.

    Example:
        >>> InsertMasks(sites, {"fc.weight": HybridMask(...)})(gm)
    """

    def __init__(self, sites: list[LinearSite], masks: dict[str, nn.Module]) -> None:
        super().__init__()
        self.sites, self.masks = sites, masks

    def call(self, gm: fx.GraphModule) -> PassResult:
        container = _container(gm, MASKS_ATTR)
        masked_nodes: dict[str, fx.Node] = {}
        for site in self.sites:
            key = module_key(site.fqn)
            if site.fqn not in masked_nodes:
                container.add_module(key, self.masks[site.fqn])
                with gm.graph.inserting_after(site.weight_node):
                    node = gm.graph.call_module(f"{MASKS_ATTR}.{key}", (site.weight_node,))
                node.meta["val"] = site.weight_node.meta.get("val")
                node.meta["patchc_mask"] = site.fqn
                masked_nodes[site.fqn] = node
            site.consumer.replace_input_with(site.weight_node, masked_nodes[site.fqn])
        gm.graph.lint()
        gm.recompile()
        return PassResult(gm, modified=bool(self.sites))


class _Observer(nn.Module):
    def __init__(self, fqn: str, callback: Callable[[str, torch.Tensor], None]) -> None:
        super().__init__()
        self.fqn, self.callback = fqn, callback

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.callback(self.fqn, x.detach())
        return x


class _ExpertObserver(nn.Module):
    """Split a grouped matmul's input by its offsets: expert e's tokens go to "<fqn>.<e>"."""

    def __init__(self, names: list[str], callback: Callable[[str, torch.Tensor], None]) -> None:
        super().__init__()
        self.names, self.callback = names, callback

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ends = [int(v) for v in offs.tolist()]
        start = 0
        for name, end in zip(self.names, ends):
            self.callback(name, x[start:end].detach())
            start = end
        return x


class _AxesObserver(nn.Module):
    """An einsum's activation with its K axis last (rows = every other axis); with an expert axis,
    expert e's rows go to "<fqn>.<e>"."""

    def __init__(self, names: list[str], axes: tuple[int, int | None],
                 callback: Callable[[str, torch.Tensor], None]) -> None:
        super().__init__()
        self.names, self.axes, self.callback = names, axes, callback

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k_axis, e_axis = self.axes
        if e_axis is None:
            self.callback(self.names[0], x.detach().movedim(k_axis, -1))
            return x
        per_expert = x.detach().movedim((e_axis, k_axis), (0, -1))
        for name, rows in zip(self.names, per_expert):
            self.callback(name, rows)
        return x


class InsertObservers(PassBase):
    """Route each annotated matmul's activation input through `callback(fqn, x)` (calibration).

    The observer returns its input unchanged and the matmul keeps reading the original node, so
    removing the observers (`RemoveObservers`) restores the graph exactly.
    """

    def __init__(self, sites: list[LinearSite], callback: Callable[[str, torch.Tensor], None]) -> None:
        super().__init__()
        self.sites, self.callback = sites, callback

    def call(self, gm: fx.GraphModule) -> PassResult:
        for i, site in enumerate(self.sites):
            owner = site.matmul.graph.owning_module  # gm, or the subgraph of a no_grad / autocast region
            key = f"{module_key(site.fqn)}_{i}"
            args: tuple = (site.input_node,)
            if site.x_axes is not None:
                observer: nn.Module = _AxesObserver(site.names, site.x_axes, self.callback)
            elif site.experts is None:
                observer = _Observer(site.fqn, self.callback)
            else:
                observer = _ExpertObserver(site.names, self.callback)
                args = (site.input_node, site.matmul.args[2])
            _container(owner, OBSERVERS_ATTR).add_module(key, observer)
            with site.matmul.graph.inserting_before(site.matmul):
                site.matmul.graph.call_module(f"{OBSERVERS_ATTR}.{key}", args)
        for module in _graph_modules(gm):
            module.recompile()
        return PassResult(gm, modified=bool(self.sites))


class RemoveObservers(PassBase):
    """Undo `InsertObservers`."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        removed = 0
        for module in _graph_modules(gm):
            nodes = [n for n in module.graph.nodes
                     if n.op == "call_module" and str(n.target).startswith(OBSERVERS_ATTR + ".")]
            for node in nodes:
                module.graph.erase_node(node)
            if hasattr(module, OBSERVERS_ATTR):
                delattr(module, OBSERVERS_ATTR)
            module.recompile()
            removed += len(nodes)
        return PassResult(gm, modified=bool(removed))


def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """`gm` and the subgraphs in it (those of no_grad / autocast regions), skipping patchc's own modules."""
    return [m for name, m in gm.named_modules() if isinstance(m, fx.GraphModule)
            and not name.startswith((MASKS_ATTR, OBSERVERS_ATTR))]
