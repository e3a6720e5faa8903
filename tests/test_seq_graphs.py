"""Models that export only at a fixed sequence length: one graph per length, one set of masks.

A toy LM whose forward loops in Python over chunks of its sequence stands in for Gated DeltaNet /
Mamba-2 (the real ones are in tests/test_families.py: qwen3_5, granitemoehybrid), so the dynamic
export really fails and `export_causal_lm` falls back on its own, not through its table of known layers.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import patchc
from patchc.config import PatchConfig
from patchc.models.hf_export import export_causal_lm
from patchc.models.per_length import PerLengthExport

TILE = (8, 8)


class ChunkedLM(nn.Module):
    """Embedding -> per chunk of 4 tokens: a causal running sum carried across chunks -> MLP -> head."""

    CHUNK = 4

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=64)
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        h = self.embed(input_ids)
        t = h.shape[1]
        pad = (-t) % self.CHUNK
        h = nn.functional.pad(h, (0, 0, 0, pad))
        state = h.new_zeros(h.shape[0], h.shape[2])
        outs = []
        for i in range(h.shape[1] // self.CHUNK):  # a Python loop over the chunks: export fixes T
            chunk = self.mix(h[:, i * self.CHUNK:(i + 1) * self.CHUNK])
            running = state[:, None] + chunk.cumsum(1)
            state = running[:, -1]
            outs.append(running)
        y = torch.cat(outs, 1)[:, :t]
        return self.head(y + self.down(torch.relu(self.up(y))))


@pytest.fixture
def chunked():
    torch.manual_seed(0)
    model = ChunkedLM().eval()
    exported = export_causal_lm(model, seq=8)
    return model, exported


def test_dynamic_export_failure_falls_back_to_one_graph_per_length(chunked):
    model, exported = chunked
    assert isinstance(exported, PerLengthExport) and exported.length == 8
    assert exported.reason  # the dynamic export's error, first line
    ids = torch.randint(0, 32, (3, 8))
    torch.testing.assert_close(exported.first.module()(ids, use_cache=False), model(ids), rtol=0, atol=0)
    with pytest.raises(Exception):  # the graph holds at its own length only
        exported.first.module()(torch.randint(0, 32, (3, 12)), use_cache=False)


def test_the_first_graph_is_at_the_training_length_not_the_example():
    model = ChunkedLM().eval()
    exported = export_causal_lm(model, seq=8, fixed_len=12)
    assert exported.length == 12
    prog = patchc.transform(exported, PatchConfig(tile=TILE, sparsity=0.35))
    prog(torch.randint(0, 32, (2, 12)))
    assert sorted(prog.seq_graphs.graphs) == [12]  # the job's block length builds no second graph
    assert export_causal_lm(model, seq=8, fixed_len=1000).length == 64  # clamped to the model's positions


def test_an_xlstm_is_exported_at_the_training_length_first(monkeypatch):
    """xLSTM loops over 64-token chunks in Python and over single tokens below a chunk: a dynamic export at the
    16-token example runs 16 recurrent steps symbolically (100 s for two tiny layers) only to fail. Like the
    other chunked mixers it is exported at the training length alone."""
    from patchc.models import hf_export

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "xLSTMConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no xLSTM")
    cfg = transformers.xLSTMConfig(vocab_size=32, hidden_size=64, embedding_dim=64, num_heads=4, num_blocks=1,
                                   num_hidden_layers=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    lengths = []
    monkeypatch.setattr(hf_export, "_export_ids", lambda m, ids, dims: lengths.append((ids.shape[1], 1 in dims)))
    exported = export_causal_lm(model, fixed_len=128)
    assert lengths == [(128, False)] and isinstance(exported, PerLengthExport)
    assert "xLSTMBackend loops over sequence chunks" in exported.reason


class WindowedLM(ChunkedLM):
    """A branch on the length (DeepSeek-V4's compressed attention has one): a dynamic export traced at 8
    holds only for lengths up to WINDOW, so it must not be handed out as a graph for every length."""

    WINDOW = 12

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        h = self.mix(self.embed(input_ids))
        if h.shape[1] > self.WINDOW:  # long inputs: only the last WINDOW positions feed the running sum
            h = torch.cat([h[:, : -self.WINDOW] * 0.5, h[:, -self.WINDOW:]], 1)
        y = h.cumsum(1)
        return self.head(y + self.down(torch.relu(self.up(y))))


class _Plain(WindowedLM):
    WINDOW = 1000  # past the model's 64 positions: no branch is ever taken, one dynamic graph


def test_a_graph_that_holds_for_some_lengths_only_falls_back_to_one_graph_per_length():
    torch.manual_seed(0)
    model = WindowedLM().eval()
    exported = export_causal_lm(model, seq=8, fixed_len=16)
    assert isinstance(exported, PerLengthExport) and exported.length == 16
    assert "lengths 2..12 of 1..64" in exported.reason
    prog = patchc.transform(exported, PatchConfig(tile=TILE))
    with prog.mask_mode("ones"):
        for t in (5, 12, 16, 40):  # both sides of the branch
            ids = torch.randint(0, 32, (2, t))
            torch.testing.assert_close(prog(ids), model(ids), rtol=0, atol=0)
    assert isinstance(export_causal_lm(_Plain().eval(), seq=8), torch.export.ExportedProgram)


def test_a_graph_traced_at_the_training_length_is_its_graph_without_a_second_export(monkeypatch):
    """Traced at 8 (its branch holds for lengths 2..12), the dynamic export is the training length's graph:
    one export, not two; every other length gets its own."""
    import patchc.models.hf_export as hf_export

    exports = []
    export = hf_export._export_ids
    monkeypatch.setattr(hf_export, "_export_ids", lambda model, ids, dims: exports.append(ids.shape[1]) or
                        export(model, ids, dims))
    torch.manual_seed(0)
    model = WindowedLM().eval()
    exported = export_causal_lm(model, seq=8, fixed_len=8)
    assert isinstance(exported, PerLengthExport) and exported.length == 8 and exports == [8]
    assert "lengths 2..12 of 1..64" in exported.reason
    prog = patchc.transform(exported, PatchConfig(tile=TILE))
    with prog.mask_mode("ones"):
        for t in (8, 5, 16):  # both sides of the branch
            ids = torch.randint(0, 32, (2, t))
            torch.testing.assert_close(prog(ids), model(ids), rtol=0, atol=0)
    assert sorted(prog.seq_graphs.graphs) == [5, 8, 16] and exports == [8, 5, 16]


def test_every_length_shares_the_weights_and_the_masks(chunked):
    model, exported = chunked
    prog = patchc.transform(exported, PatchConfig(tile=TILE, sparsity=0.35, init_std=0.5))
    assert set(prog.layers) == {"mix.weight", "up.weight", "down.weight", "head.weight"}
    short, long = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 13))
    with prog.mask_mode("ones"):
        for ids in (short, long):  # the ones mask is the model at every length
            torch.testing.assert_close(prog(ids), model(ids), rtol=0, atol=0)
    assert sorted(prog.seq_graphs.graphs) == [8, 13]
    first, second = (prog.seq_graphs.graphs[n][0] for n in (8, 13))
    assert second.get_parameter("up.weight") is first.get_parameter("up.weight")
    assert second.patchc_masks.up_weight is first.patchc_masks.up_weight is prog.masks["up_weight"]
    assert not any(p.requires_grad for p in second.parameters() if p.dim() and p.shape == model.up.weight.shape)

    prog.train()
    prog(short).sum().backward()
    grad_short = prog.masks["up_weight"].nm_logits.grad.clone()
    prog(long).sum().backward()  # accumulates into the same logits
    assert not torch.equal(prog.masks["up_weight"].nm_logits.grad, grad_short)

    prog.eval()
    plan = patchc.harden(prog)
    pruned = plan.apply(copy.deepcopy(model))
    with torch.no_grad():
        for ids in (short, long):
            torch.testing.assert_close(pruned(ids), prog(ids), rtol=1e-6, atol=1e-6)

    prog.double()  # every graph follows, and the weights stay shared
    assert second.get_parameter("up.weight") is first.get_parameter("up.weight")
    assert first.get_parameter("up.weight").dtype == torch.float64
    with torch.no_grad():
        assert prog(long).dtype == torch.float64


def test_observers_reach_graphs_built_while_observing_and_leave_none_behind(chunked):
    _, exported = chunked
    prog = patchc.transform(exported, PatchConfig(tile=TILE))
    seen: list[tuple[str, int]] = []
    with torch.no_grad(), prog.observe_inputs(lambda fqn, x: seen.append((fqn, x.shape[-2]))):
        prog(torch.randint(0, 32, (2, 8)))
        prog(torch.randint(0, 32, (2, 6)))  # a new graph, exported inside the block
    assert ("up.weight", 8) in seen and ("up.weight", 6) in seen
    for gm, _ in prog.seq_graphs.graphs.values():
        assert not any("observers" in str(n.target) for n in gm.graph.nodes)
    with pytest.raises(ValueError, match="token ids"):
        prog(input_ids=None)


def test_grouping_for_fsdp_keeps_a_per_length_program_at_its_length(chunked):
    """--fsdp shards the graph of the length mask training runs at (tests/test_fsdp_per_length.py trains one
    on two ranks): after the rewrite the program computes what it did there, and refuses other lengths."""
    from patchc.job.fsdp import group_blocks

    plain, grouped = (patchc.transform(chunked[1], PatchConfig(tile=TILE)) for _ in range(2))
    group_blocks(grouped)
    ids = torch.randint(0, 32, (3, chunked[1].length), generator=torch.Generator().manual_seed(5))
    with plain.mask_mode("hard"), grouped.mask_mode("hard"), torch.no_grad():
        torch.testing.assert_close(grouped(ids), plain(ids), rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"runs at sequence length 8 only, got 12: shard the program"):
            grouped(torch.zeros(3, 12, dtype=torch.long))


def test_weights_smaller_than_the_tile_stay_dense_with_a_reason():
    cfg = PatchConfig(tile=(16, 16))
    assert cfg.selects("layers.0.linear_attn.in_proj_b.weight", (4, 64)) == "shape (4, 64) is smaller than the tile (16, 16)"
    assert cfg.selects("layers.0.mlp.up_proj.weight", (16, 64)) is None
    model = ChunkedLM()
    prog = patchc.transform(export_causal_lm(model, seq=8), PatchConfig(tile=(32, 16)))
    assert set(prog.layers) == {"up.weight", "head.weight"}  # (32, 16) and (32, 16); mix / down have 16 rows
    assert "smaller than the tile" in prog.skipped["mix.weight"]
    with pytest.raises(ValueError, match=r"the tile \(64, 64\) is larger than 4 of them: choose a smaller tile"):
        patchc.transform(export_causal_lm(model, seq=8), PatchConfig(tile=(64, 64)))


@pytest.mark.parametrize("dynamic", [False, pytest.param(None, marks=pytest.mark.full)], ids=["static", "auto"])
def test_a_model_exported_per_length_compiles_at_every_length(monkeypatch, dynamic):
    """Qwen3.5's Gated DeltaNet loops over 64-token chunks (the export needs a graph per length): dynamo
    recompiles across the chunk count on its own, and each graph still serves every planned linear.
    (When tests/test_families.py ran in the same process, its export of the model is reused.) The full form
    compiles as torch.compile does by default, the second graph with symbolic shapes: 12 s of dynamo
    tracing the two chunks, against 1.7 s for a static graph, which checks the same serving."""
    from tests.test_families import TILE, exported

    monkeypatch.setenv("PATCHC_CPU_IMPL", "reference")
    case, ep = exported("qwen3_5")
    plan = patchc.harden(patchc.transform(ep, PatchConfig(tile=TILE, sparsity=0.35, init_std=0.5)))
    model = plan.apply(copy.deepcopy(case.model))
    served = [name for name, layer in plan.layers.items() if layer.n_sparse]
    torch._dynamo.reset()
    replaced: list[int] = []
    cm = torch.compile(model, backend="patch", dynamic=dynamic, options={
        "plan": plan, "strict": True, "tune": False, "graph_callback": lambda gm, n: replaced.append(n)})
    with torch.no_grad():
        for length in (8, 70):  # one chunk, then two
            ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
            torch.testing.assert_close(cm(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       atol=1e-5, rtol=1e-5)
    assert len(replaced) == 2 and all(n == len(served) for n in replaced), (replaced, served)
    torch._dynamo.reset()
