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
the logits and the Adam state.

Example (under `torchrun --nproc_per_node=2`):
    >>> prog = shard_program(patchc.transform(ep, cfg))
    >>> patchc.train_masks(prog, batches, loss_fn, checkpoint="run/masks.ckpt",
    ...                    checkpoint_io=ShardedCheckpointIO())
    >>> plan = patchc.harden(gather_program(prog))
"""

from __future__ import annotations

import functools
import json
import operator
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx, nn

from patchc.masking.param_mask import hybrid_masks
from patchc.masking.train import (CHECKPOINT_FORMAT, CheckpointIO, TrainResult, _config_diff, _config_tag,
                                  optimizer_kind)
from patchc.passes.insert_masks import MASKS_ATTR
from patchc.passes.program import MaskedProgram
from patchc.utils.files import write_bytes_atomic
from patchc.utils.names import block_index

SHARDS_ATTR = "patchc_shards"
SHARDED_VERSION = 1
META = "patchc.json"


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
        self.kept = {m.name: m.expected_kept() for m in self.hybrids()}
        return (*masked, *raw, *self.kept.values(), *through)


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
    shards = group_blocks(prog)
    for shard in shards.values():
        fully_shard(shard, mesh=mesh, reshard_after_forward=reshard_after_forward)
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


def gather_program(prog: MaskedProgram) -> MaskedProgram:
    """Gather the whole weights and logits on every rank (a collective) and keep them: for hardening.

    Call it on every rank once training is over; the program then runs forwards unsharded and
    `patchc.harden(prog)` reads whole logits. Do not train it further. FSDP2 reshards on
    `prog.state_dict()` (it hands out shards): use `full_state_dict` for whole tensors, and call this
    again before reading the masks.
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


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _joined():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _joined() else 0


class ShardedCheckpointIO(CheckpointIO):
    """`train_masks`'s checkpoint as a folder written by every rank with torch.distributed.checkpoint.

    Each rank writes its shards of the logits and of the Adam state (DCP), rank 0 the history and
    settings (`patchc.json`). A save goes to `<path>.next` and replaces `<path>` only when complete
    (the previous one waits in `<path>.prev` meanwhile), so a crash never leaves half a checkpoint.
    Pass the same path on every rank. DCP reshards on load: a run may resume on another number of
    ranks, or in one process without FSDP.

    Example:
        >>> patchc.train_masks(prog, batches, loss_fn, checkpoint=out / "masks.ckpt", resume=True,
        ...                    checkpoint_io=ShardedCheckpointIO())
    """

    def _complete(self, path: str | os.PathLike) -> Path | None:
        for folder in (Path(path), Path(f"{path}.prev")):
            if (folder / META).is_file():
                return folder
        return None

    def exists(self, path: str | os.PathLike) -> bool:
        return self._complete(path) is not None

    def save(self, path: str | os.PathLike, prog: MaskedProgram, optimizer: torch.optim.Optimizer,
             result: TrainResult) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = Path(path)
        staging, previous = Path(f"{path}.next"), Path(f"{path}.prev")
        if path.exists() and not path.is_dir():
            raise ValueError(f"{path}: a file is in the way of the sharded checkpoint folder; move it away")
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a save that died half way
        _barrier()
        model_state, optim_state = get_state_dict(prog, optimizer)
        dcp.save({"program": model_state, "optimizer": optim_state}, checkpoint_id=str(staging), no_dist=not _joined())
        if _rank() == 0:
            meta = {"format": CHECKPOINT_FORMAT, "sharded": SHARDED_VERSION, "config": _config_tag(prog),
                    "settings": prog.cfg.to_dict(), "optimizer_kind": optimizer_kind(optimizer),
                    "history": result.history, "step": result.step}
            write_bytes_atomic(staging / META, json.dumps(meta).encode())
            if path.exists():
                shutil.rmtree(previous, ignore_errors=True)
                os.replace(path, previous)
            os.replace(staging, path)
            shutil.rmtree(previous, ignore_errors=True)
        _barrier()

    def load(self, path: str | os.PathLike, prog: MaskedProgram, optimizer: torch.optim.Optimizer) -> TrainResult:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        folder = self._complete(path)
        if folder is None:
            raise FileNotFoundError(f"{path}: no complete sharded checkpoint ({META} missing)")
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{folder / META}: not a readable patchc checkpoint ({exc})") from exc
        if meta.get("format") != CHECKPOINT_FORMAT or meta.get("sharded") != SHARDED_VERSION:
            raise ValueError(f"{folder}: not a patchc sharded checkpoint of version {SHARDED_VERSION}")
        if meta["config"] != _config_tag(prog):
            raise ValueError(f"{folder}: checkpoint was made with another PatchConfig: {_config_diff(meta, prog)}")
        if meta.get("optimizer_kind") != optimizer_kind(optimizer):
            raise ValueError(f"{folder}: checkpoint was trained with optimizer {meta.get('optimizer_kind')} (now "
                             f"{optimizer_kind(optimizer)}): resume with the same MaskOptimConfig (memory mode)")
        model_state, optim_state = get_state_dict(prog, optimizer)
        state = {"program": model_state, "optimizer": optim_state}
        with warnings.catch_warnings():  # DCP warns that one process loads alone: intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), no_dist=not _joined())
        set_state_dict(prog, optimizer, model_state_dict=state["program"], optim_state_dict=state["optimizer"])
        return TrainResult(history=list(meta["history"]), step=int(meta["step"]))


__all__ = ["BlockShard", "ShardedCheckpointIO", "full_state_dict", "gather_program", "group_blocks", "shard_program", "state_bytes"]
