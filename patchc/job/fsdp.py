"""FSDP2 for mask training: each transformer block's frozen weights and mask logits sharded together.

The exported graph reads every weight through a `get_attr` node, which FSDP2 cannot hook. So
`shard_program` first regroups the graph, one module per block:

    before:  W = get_attr[model.layers.3.mlp.up_proj.weight] -> patchc_masks.<key>(W) -> linear
    after:   out = patchc_shards.block_3()  -> getitem(out, i) -> linear

`BlockShard.forward` returns the block's W * M (and a copy of W for a tied weight read elsewhere),
so FSDP2's forward hooks all-gather the block's weights and logits just before the block's first
matmul and free them right after (`reshard_after_forward=True`); backward gathers them again and
reduce-scatters the logits' gradients. The exported module itself becomes the FSDP2 root and
shards what is left (embeddings, norms, biases). Every rank then holds about 1/N of the weights,
the logits and the Adam state, and never the whole model: the dense teacher of a distillation loss is
the same program with its masks off (`DenseTeacher`), and `harden_sharded` gathers one block at a time.

Example (under `torchrun --nproc_per_node=2`):
    >>> prog = shard_program(patchc.transform(ep, cfg))
    >>> patchc.train_masks(prog, batches, loss_fn, checkpoint="run/masks.ckpt",
    ...                    checkpoint_io=ShardedCheckpointIO())
    >>> plan = harden_sharded(prog)
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import fx, nn

from patchc.ir import TilePlan
from patchc.masking.harden import assemble_plan, budget_tiles, harden_layer
from patchc.masking.param_mask import hybrid_masks
from patchc.passes.insert_masks import MASKS_ATTR
from patchc.passes.program import MaskedProgram
from patchc.utils.names import block_index

SHARDS_ATTR = "patchc_shards"


class BlockShard(nn.Module):
    """The masked weights of one transformer block with their masks: the unit FSDP2 shards.

    `forward(*x)` -> (W_i * M_i for each mask, W_j for each weight also read unmasked, E[sum(M)] per
    HybridMask, *x); the expected kept counts are kept in `self.kept` for the regulariser, because
    outside this forward the logits are sharded. `x`, the block's input activation, passes through
    unchanged so FSDP2 can hook the end of the block's backward.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.weights = nn.Module()
        self.masks = nn.ModuleDict()
        self.raw: list[str] = []
        self.kept: dict[str, torch.Tensor] = {}

    def add(self, key: str, weight: nn.Parameter, mask: nn.Module, read_unmasked: bool) -> None:
        self.weights.register_parameter(key, weight)
        self.masks[key] = mask
        if read_unmasked:
            self.raw.append(key)

    def hybrids(self) -> list:
        return hybrid_masks(self.masks.values())

    def forward(self, *through: torch.Tensor) -> tuple[torch.Tensor, ...]:
        masked = [mask(getattr(self.weights, key)) for key, mask in self.masks.items()]
        # A copy: the gathered weight's storage is freed when FSDP2 reshards after this forward.
        raw = [getattr(self.weights, key).detach().clone() for key in self.raw]
        kept = {m.name: m.expected_kept() for m in self.hybrids()}
        if any(m.mode != "ones" for m in self.hybrids()):  # a teacher's forward (masks off) leaves the masks' own
            self.kept = kept
        return (*masked, *raw, *kept.values(), *through)


def _group_name(fqn: str) -> str:
    block = block_index(fqn)
    return "other" if block is None else f"block_{block}"


def _param_at(gm: fx.GraphModule, target: str) -> nn.Parameter | None:
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return None


def _detach_param(gm: fx.GraphModule, param: nn.Parameter) -> None:
    """Unregister `param` from every module of the exported graph (a tied weight has several owners)."""
    owners = [name for name, p in gm.named_parameters(remove_duplicate=False) if p is param]
    for name in owners:
        owner_name, _, leaf = name.rpartition(".")
        (gm.get_submodule(owner_name) if owner_name else gm)._parameters.pop(leaf)


def group_blocks(prog: MaskedProgram) -> dict[str, BlockShard]:
    """Rewrite the program's graph so each block's masked weights are read through one `BlockShard`.

    Returns {group name: shard}, e.g. {"block_0": ..., "block_1": ..., "other": ...} ("other":
    masked weights outside the transformer blocks). `prog.weight(fqn)` follows the moved weights. A program
    with one graph per sequence length (Qwen3.5, Mamba-2 hybrids) keeps its first graph's length only: a graph
    exported for another length would look for the weights in the first, which no longer holds them.
    """
    gm, graph = prog.graph_module, prog.graph_module.graph
    if hasattr(gm, SHARDS_ATTR):
        raise ValueError("shard_program: this program is already sharded")
    if prog.seq_graphs is not None:  # one graph per length: the weights leave the one that later graphs copy
        prog.seq_graphs.fix_length(f"shard the program of a model that exports one graph per length "
                                   f"({prog.seq_graphs.source.reason}) at the length it trains at "
                                   f"(`patchc prune --fsdp` exports it at --block-len)")
    order = {node: i for i, node in enumerate(graph.nodes)}
    mask_nodes = [n for n in graph.nodes if n.op == "call_module" and str(n.target).startswith(MASKS_ATTR + ".")]
    groups: dict[str, list[fx.Node]] = {}
    for node in mask_nodes:
        if node.args[0].op != "get_attr":
            raise ValueError(f"shard_program: the mask of {node.meta.get('patchc_mask')} does not read its weight "
                             "straight from a parameter; this graph cannot be sharded per block")
        groups.setdefault(_group_name(node.meta["patchc_mask"]), []).append(node)
    readers = [n for n in graph.nodes if n.op == "get_attr"]
    gm.add_module(SHARDS_ATTR, nn.Module())
    shards = {name: _regroup(prog, name, nodes, readers, order) for name, nodes in groups.items()}
    graph.lint()
    gm.recompile()
    return shards


def _regroup(prog: MaskedProgram, name: str, mask_nodes: list[fx.Node], readers: list[fx.Node],
             order: dict[fx.Node, int]) -> BlockShard:
    """Move one group's weights and masks into a `BlockShard` and read them from its output."""
    gm, graph = prog.graph_module, prog.graph_module.graph
    shard = BlockShard(name)
    container = getattr(gm, MASKS_ATTR)
    aliases: dict[str, list[fx.Node]] = {}
    for node in mask_nodes:
        fqn, key = node.meta["patchc_mask"], str(node.target).split(".", 1)[1]
        param = gm.get_parameter(node.args[0].target)
        aliases[key] = [r for r in readers if _param_at(gm, r.target) is param]
        unmasked = any(user is not node for r in aliases[key] for user in r.users)
        shard.add(key, param, getattr(container, key), unmasked)
        _detach_param(gm, param)
        delattr(container, key)
        prog.relocate(fqn, shard.weights, key)
    getattr(gm, SHARDS_ATTR).add_module(name, shard)
    readers_of = {r for rs in aliases.values() for r in rs}
    users = [u for n in [*mask_nodes, *readers_of] for u in n.users if u not in mask_nodes]
    first = min(users, key=order.__getitem__)
    x = _block_input(prog, {n.meta["patchc_mask"] for n in mask_nodes}, first, order)
    with graph.inserting_before(first):
        call = graph.call_module(f"{SHARDS_ATTR}.{name}", (x,) if x is not None else ())
    outputs = [*mask_nodes, *(aliases[key] for key in shard.raw)]
    with graph.inserting_after(call):
        if x is not None:  # the block's later reads of its input go through the shard (see `_block_input`)
            through = graph.call_function(operator.getitem, (call, len(outputs) + len(shard.hybrids())))
            after = {n for n in graph.nodes if order.get(n, -1) >= order[first]}
            x.replace_all_uses_with(through, delete_user_cb=after.__contains__)
        for i, produced in enumerate(outputs):
            item = graph.call_function(operator.getitem, (call, i))
            for node in produced if isinstance(produced, list) else [produced]:
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
    for node in mask_nodes:
        graph.erase_node(node)
    for reader in readers_of:
        graph.erase_node(reader)
    return shard


def _block_input(prog: MaskedProgram, fqns: set[str], first: fx.Node, order: dict[fx.Node, int]) -> fx.Node | None:
    """The activation read by the group's first matmul, when it exists before the group's first use.

    Passed through `BlockShard.forward`, it lets FSDP2 hook its gradient: once every use of it in the
    block has run backward, the block's logit gradients are complete, so FSDP2 reduce-scatters them
    and frees the block's gathered weights there rather than at the end of backward.
    """
    sites = [s for s in prog.sites if s.fqn in fqns and s.matmul in order and s.input_node in order]
    if not sites:
        return None
    x = min(sites, key=lambda s: order[s.matmul]).input_node
    return x if order[x] < order[first] else None


def default_mesh(device: torch.device | str):
    """A 1-D mesh over every rank of the default process group, on `device`'s type ("cpu": gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard_program needs a process group: run under torchrun (or call "
                           "torch.distributed.init_process_group first)")
    return init_device_mesh(torch.device(device).type, (dist.get_world_size(),))


def shard_program(prog: MaskedProgram, mesh=None, *, reshard_after_forward: bool = True) -> MaskedProgram:
    """Shard `prog` with FSDP2, one unit per transformer block (weights + logits); returns `prog`.

    Build the optimizer after this call (its parameters are the sharded logits). `mesh`: a 1-D
    DeviceMesh (default: all ranks, on the weights' device type).

    Example:
        >>> prog = shard_program(patchc.transform(ep, cfg))
        >>> opt = torch.optim.Adam(prog.mask_parameters(), lr=1e-3)
    """
    from torch.distributed.fsdp import fully_shard

    gm = prog.graph_module
    mesh = mesh if mesh is not None else default_mesh(next(gm.parameters()).device)
    # torch 2.13 warns that a BlockShard output which is a view would skip FSDP2's backward hook if
    # an op changed it in place; the exported graph that reads them is functional, with no in-place op
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPBlockShard\) returned a view tensor")
    shards = group_blocks(prog)
    for shard in shards.values():
        fully_shard(shard, mesh=mesh, reshard_after_forward=reshard_after_forward)
        for mask in shard.hybrids():  # the low-memory mode redraws W * M in backward: from the gathered block
            mask.regather = shard.unshard
    fully_shard(gm, mesh=mesh, reshard_after_forward=reshard_after_forward)  # root: embeddings, norms, biases
    prog.fsdp_shards = shards
    prog.kept_source = functools.partial(_expected_kept, list(shards.values()))
    return prog


def _expected_kept(shards: list[BlockShard], fresh: bool) -> dict[str, torch.Tensor]:
    """Each mask's E[sum(M)]: from its block's last forward, or gathered now (a collective) when `fresh`."""
    out: dict[str, torch.Tensor] = {}
    if not fresh:
        if any(not shard.kept for shard in shards):
            raise RuntimeError("regularizer() of a sharded program needs a forward first (the logits are "
                               "sharded outside their block's forward)")
        for shard in shards:
            out.update(shard.kept)
        return out
    with torch.no_grad():
        for shard in shards:
            shard.unshard()
            out.update({m.name: m.expected_kept() for m in shard.hybrids()})
            shard.reshard()
    return out


class DenseTeacher(nn.Module):
    """The dense model's outputs, read through a sharded program with every mask off ("ones" mode).

    A distillation loss needs the dense model's logits each step. Run through the program's own shards, they
    cost one more all-gather per block instead of the whole dense model on every rank.

    Example:
        >>> loss_fn = make_lm_loss(bundle, DenseTeacher(prog), LossSpec("kd"))
    """

    def __init__(self, prog: MaskedProgram) -> None:
        super().__init__()
        object.__setattr__(self, "prog", prog)  # not a child: the program's logits are not the teacher's

    def forward(self, *args, **kwargs):
        with self.prog.mask_mode("ones"):
            return self.prog(*args, **kwargs)


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[nn.Module]:
    """An FSDP2 module's whole parameters for the block, resharded after (a collective: every rank enters)."""
    module.unshard()
    try:
        yield module
    finally:
        module.reshard()


@torch.no_grad()
def harden_sharded(prog: MaskedProgram, exact_budget: bool = False, rank: int | None = None) -> TilePlan | None:
    """`patchc.harden` of a sharded program, one block gathered at a time: every rank calls it, and none holds
    more than one block's whole weights and logits (beside the root's: embeddings, norms, biases). With
    `exact_budget` the tile logits alone (one per tile) are gathered first. `rank`: the one rank that builds
    the plan (in host memory) and returns it, the others return None; None: every rank.

    Example:
        >>> plan = harden_sharded(shard_program(prog), exact_budget=True)   # equal to patchc.harden(prog)
    """
    shards = getattr(prog, "fsdp_shards", None)
    if shards is None:
        raise ValueError("harden_sharded: the program is not sharded; use patchc.harden(prog)")
    build = rank is None or dist.get_rank() == rank
    chosen = budget_tiles(prog) if exact_budget else {}  # every rank: the tile logits' gathers are collectives
    layers = {}
    with gathered(prog.graph_module):  # the biases a layer's plan carries
        for shard in shards.values():
            with gathered(shard):
                layers.update({m.name: harden_layer(prog, m, chosen.get(m.name)) for m in shard.hybrids() if build})
    return assemble_plan(prog, layers, exact_budget) if build else None


def gather_program(prog: MaskedProgram) -> MaskedProgram:
    """Gather the whole weights and logits on every rank (a collective) and keep them: for hardening.

    Call it on every rank once training is over; the program then runs forwards unsharded and
    `patchc.harden(prog)` reads whole logits (`harden_sharded` needs one block at a time). Do not train it
    further. FSDP2 reshards on `prog.state_dict()` (it hands out shards): use `full_state_dict` for whole
    tensors, and call this again before reading the masks.
    """
    shards = getattr(prog, "fsdp_shards", None)
    if shards is None:
        return prog
    for module in (*shards.values(), prog.graph_module):
        keep = getattr(module, "set_reshard_after_forward", None)  # else a later forward reshards; harden needs none
        if keep is not None:
            keep(False)
        module.unshard()
    prog.kept_source = None
    return prog


def full_state_dict(prog: MaskedProgram) -> dict[str, torch.Tensor]:
    """`prog.state_dict()` with every shard gathered into a whole tensor (a collective: every rank calls it).

    Example:
        >>> state = full_state_dict(prog)      # on each rank; rank 0 may torch.save it
    """
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in prog.state_dict().items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(prog: MaskedProgram, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of training state this rank holds: {"logits", "weights", "optimizer", "total"}.

    Counts this rank's shards under FSDP2, everything otherwise (frozen weights: the exported
    module's parameters; optimizer: the tensors of its state, e.g. Adam's two moments).
    """
    logits = {id(p): p for p in prog.mask_parameters()}
    weights = {id(p): p for p in prog.graph_module.parameters() if not p.requires_grad}
    out = {"logits": sum(_local(p).nbytes for p in logits.values()),
           "weights": sum(_local(p).nbytes for p in weights.values()),
           "optimizer": 0}
    if optimizer is not None:
        out["optimizer"] = sum(_local(v).nbytes for state in optimizer.state.values() for v in state.values()
                               if isinstance(v, torch.Tensor) and v.dim() > 0)
    out["total"] = sum(out.values())
    return out


__all__ = ["BlockShard", "DenseTeacher", "full_state_dict", "gather_program", "gathered", "group_blocks",
           "harden_sharded", "shard_program", "state_bytes"]
