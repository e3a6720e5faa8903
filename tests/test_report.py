"""Reports: layer-name parsing, sparsity pictures, report.json / report.md, and `patchc report` redraws."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from patchc.job.report import write as rep
from patchc.job.report import (
    block_index,
    expert_index,
    pick_tile_map_layers,
    plan_stats,
    plot_plan,
    projection_type,
    redraw,
    render_markdown,
    short_name,
    write_report,
)
from patchc.ir import PATTERNS, TILE_DENSE, LayerPlan, TilePlan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fqn, proj, block",
    [
        # our llama / HF llama, qwen
        ("layers.0.self_attn.q_proj.weight", "q", 0),
        ("layers.11.self_attn.k_proj.weight", "k", 11),
        ("model.layers.3.self_attn.v_proj.weight", "v", 3),
        ("model.layers.3.self_attn.o_proj.weight", "o", 3),
        ("model.layers.3.mlp.gate_proj.weight", "gate", 3),
        ("model.layers.3.mlp.up_proj.weight", "up", 3),
        ("model.layers.27.mlp.down_proj.weight", "down", 27),
        # llama2.c
        ("layers.1.attention.wq.weight", "q", 1),
        ("layers.1.attention.wk.weight", "k", 1),
        ("layers.1.attention.wv.weight", "v", 1),
        ("layers.1.attention.wo.weight", "o", 1),
        ("layers.1.feed_forward.w1.weight", "gate", 1),
        ("layers.1.feed_forward.w3.weight", "up", 1),
        ("layers.1.feed_forward.w2.weight", "down", 1),
        # BERT / MiniLM
        ("model.encoder.layer.2.attention.self.query.weight", "q", 2),
        ("model.encoder.layer.2.attention.self.key.weight", "k", 2),
        ("encoder.layer.2.attention.self.value.weight", "v", 2),
        ("model.encoder.layer.2.attention.output.dense.weight", "o", 2),
        ("model.encoder.layer.2.intermediate.dense.weight", "up", 2),
        ("model.encoder.layer.5.output.dense.weight", "down", 5),
        # GPT-2
        ("transformer.h.4.attn.c_attn.weight", "qkv", 4),
        ("transformer.h.4.attn.c_proj.weight", "o", 4),
        ("transformer.h.4.mlp.c_fc.weight", "up", 4),
        ("transformer.h.4.mlp.c_proj.weight", "down", 4),
        # other families and things outside the blocks
        ("model.decoder.layers.0.fc1.weight", "up", 0),
        ("blocks.7.attn.out_proj.weight", "o", 7),
        ("gpt_neox.layers.0.attention.query_key_value.weight", "qkv", 0),
        # fused gate + up, MoE experts (a module each, or a plan's slice of a fused 3-D weight)
        ("model.layers.0.mlp.gate_up_proj.weight", "gate_up", 0),
        ("model.layers.2.mlp.experts.gate_up_proj.7", "gate_up", 2),
        ("model.layers.2.mlp.experts.down_proj.0", "down", 2),
        ("model.layers.1.block_sparse_moe.experts.3.w2.weight", "down", 1),
        ("model.layers.1.mlp.shared_expert.up_proj.weight", "up", 1),
        ("model.layers.0.shared_mlp.input_linear.weight", "gate_up", 0),  # Granite MoE
        # DeepSeek's MLA, T5 (whose FFN output is also called wo)
        ("model.layers.0.self_attn.q_b_proj.weight", "q", 0),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "kv", 0),
        ("encoder.block.1.layer.0.SelfAttention.o.weight", "o", 1),
        ("encoder.block.1.layer.1.DenseReluDense.wo.weight", "down", 1),
        ("decoder.block.0.layer.2.DenseReluDense.wi_0.weight", "gate", 0),
        # Mamba mixers (Granite 4 hybrid, Falcon-Mamba, Nemotron-H's attention layers keep their names)
        ("model.layers.3.mamba.in_proj.weight", "ssm_in", 3),
        ("model.layers.3.mamba.out_proj.weight", "ssm_out", 3),
        ("backbone.layers.0.mixer.out_proj.weight", "ssm_out", 0),
        ("backbone.layers.1.mixer.o_proj.weight", "o", 1),
        ("model.layers.0.self_attn.out_proj.weight", "o", 0),
        ("lm_head.weight", "other", None),
        ("model.embed_tokens.weight", "other", None),
        ("pooler.dense.weight", "other", None),
        ("output.weight", "other", None),
    ],
)
def test_projection_type_and_block_index(fqn: str, proj: str, block: int | None) -> None:
    assert projection_type(fqn) == proj
    assert block_index(fqn) == block


def test_experts_get_their_index_in_short_names() -> None:
    assert expert_index("model.layers.0.mlp.experts.12.up_proj.weight") == 12
    assert expert_index("model.layers.0.mlp.experts.down_proj.5") == 5
    assert expert_index("model.layers.0.mlp.down_proj.weight") is None
    assert short_name("model.layers.1.mlp.experts.gate_up_proj.2") == "block1_gate_up_e2"
    assert short_name("model.layers.1.block_sparse_moe.experts.0.w1.weight") == "block1_gate_e0"
    assert short_name("model.layers.1.mlp.shared_expert.down_proj.weight") == "block1_down"
    assert short_name("model.experts.head.3") == "model_experts_head_3"  # unknown: the whole name


def test_block_index_takes_the_first_match_and_whole_words() -> None:
    assert block_index("layers.2.sub.layers.9.w.weight") == 2
    assert block_index("players.3.q_proj.weight") is None  # "players" is not "layers"
    assert block_index("h.12") == 12
    assert projection_type("") == "other"


# ---------------------------------------------------------------------------------------------
# A synthetic plan: 2 blocks x 7 projections, random tile kinds
# ---------------------------------------------------------------------------------------------


def make_layer(fqn: str, shape: tuple[int, int], tile: tuple[int, int], kinds: torch.Tensor, seed: int) -> LayerPlan:
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    w = torch.randn(n, k, generator=g)
    mask = PATTERNS[torch.randint(0, 6, (n * k // 4,), generator=g)].view(n, k)
    dense = kinds.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:n, :k] == TILE_DENSE
    return LayerPlan.from_mask(fqn, w, kinds, mask | dense, tile=tile)


def synthetic_plan(blocks: int = 2, seed: int = 0, head: bool = False) -> TilePlan:
    """Llama-style names; each layer gets its own dense share so densest / sparsest are distinct."""
    g = torch.Generator().manual_seed(seed)
    tile = (8, 8)
    layers = {}
    for b in range(blocks):
        for i, p in enumerate(PROJ):
            shape = (40, 24) if p in ("gate_proj", "up_proj") else (24, 40) if p == "down_proj" else (24, 24)
            grid = (-(-shape[0] // tile[0]), -(-shape[1] // tile[1]))
            share = (b * len(PROJ) + i + 1) / (blocks * len(PROJ) + 1)
            kinds = (torch.rand(grid, generator=g) >= share).to(torch.uint8)  # 1 (2:4) with prob share
            section = "self_attn" if i < 4 else "mlp"
            fqn = f"model.layers.{b}.{section}.{p}.weight"
            layers[fqn] = make_layer(fqn, shape, tile, kinds, seed=100 * b + i)
    if head:
        kinds = torch.ones(4, 3, dtype=torch.uint8)
        layers["lm_head.weight"] = make_layer("lm_head.weight", (32, 24), tile, kinds, seed=999)
    return TilePlan(layers=layers, skipped={"model.embed_tokens.weight": "excluded by include()"},
                    meta={"config": {"sparsity": 0.35, "variant": "joint", "tile": [8, 8]}})


def assert_png(path: Path) -> None:
    assert path.exists() and path.stat().st_size > 1000, path
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plan_stats_are_parameter_weighted() -> None:
    plan = synthetic_plan(head=True)
    stats = plan_stats(plan)
    assert list(stats["per_block"]) == [0, 1]
    assert list(stats["per_projection"]) == ["q", "k", "v", "o", "gate", "up", "down", "other"]
    assert stats["target"] == 0.35
    assert stats["global"] == pytest.approx(plan.sparsity)
    # block 0 by hand: kept / total over its 7 layers
    layers = [plan.layers[f"model.layers.0.{'self_attn' if i < 4 else 'mlp'}.{p}.weight"] for i, p in enumerate(PROJ)]
    want = 1 - sum(layer.n_kept for layer in layers) / sum(layer.numel for layer in layers)
    assert stats["per_block"][0] == pytest.approx(want)
    assert stats["other"] == pytest.approx(0.5)  # the all-2:4 head
    assert stats["grid"][(1, "q")] == pytest.approx(1 - plan.layers["model.layers.1.self_attn.q_proj.weight"].density)


def test_pick_tile_map_layers_spans_the_density_range() -> None:
    plan = synthetic_plan()
    dens = {f: layer.density for f, layer in plan.layers.items()}
    picks = pick_tile_map_layers(plan, 3)
    assert len(picks) == 3
    assert dens[picks[0]] == max(dens.values()) and dens[picks[-1]] == min(dens.values())
    assert min(dens.values()) <= dens[picks[1]] <= max(dens.values())
    assert pick_tile_map_layers(plan, 0) == []
    assert len(pick_tile_map_layers(plan, 100)) == len(plan.layers)


def test_plot_plan_writes_pngs(tmp_path: Path) -> None:
    plan = synthetic_plan(head=True)
    paths = plot_plan(plan, tmp_path / "out", title="synthetic: PATCH joint at 30% sparsity")
    names = [p.name for p in paths]
    assert names[:3] == ["sparsity_per_block.png", "sparsity_per_projection.png", "sparsity_heatmap.png"]
    tile_maps = [n for n in names if n.startswith("tile_map_")]
    assert len(tile_maps) == 3 and len(set(tile_maps)) == 3
    for p in paths:
        assert p.parent == tmp_path / "out"
        assert_png(p)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]  # no temp files left


def test_moe_plan_gets_an_expert_picture_and_names_each_expert(tmp_path: Path) -> None:
    """Slices of fused 3-D expert weights (transformers 5's Mixtral names): typed gate_up / down,
    one heatmap cell per (block, expert), tile maps named by expert. A dense plan draws no expert map."""
    tile, layers = (8, 8), {}
    for b in range(2):
        for e in range(3):
            for p, shape in (("gate_up_proj", (48, 24)), ("down_proj", (24, 24))):
                fqn = f"model.layers.{b}.mlp.experts.{p}.{e}"
                kinds = torch.full((shape[0] // 8, 3), int(e != 1), dtype=torch.uint8)  # expert 1 dense
                layers[fqn] = make_layer(fqn, shape, tile, kinds, seed=10 * b + e)
    plan = TilePlan(layers=layers)
    stats = plan_stats(plan)
    assert list(stats["per_projection"]) == ["gate_up", "down"]
    assert sorted(stats["experts"]) == [(b, e) for b in range(2) for e in range(3)]
    assert stats["experts"][(0, 1)] == 0.0 and stats["experts"][(1, 2)] == pytest.approx(0.5)
    names = [p.name for p in plot_plan(plan, tmp_path, tile_maps=len(layers))]
    assert names[3] == "sparsity_per_expert.png"
    assert_png(tmp_path / "sparsity_per_expert.png")
    assert "tile_map_block1_gate_up_e2.png" in names and "tile_map_block0_down_e1.png" in names
    assert "sparsity_per_expert.png" not in [p.name for p in plot_plan(synthetic_plan(), tmp_path / "dense")]


@pytest.mark.parametrize("count", [0, 1, 5])
def test_plot_plan_tile_map_count(tmp_path: Path, count: int) -> None:
    paths = plot_plan(synthetic_plan(), tmp_path, tile_maps=count)
    assert len([p for p in paths if p.name.startswith("tile_map_")]) == count


def test_plot_plan_without_blocks_and_empty(tmp_path: Path) -> None:
    kinds = torch.tensor([[0, 1, 1]], dtype=torch.uint8)
    plan = TilePlan(layers={"fc.weight": make_layer("fc.weight", (8, 24), (8, 8), kinds, seed=1)})
    names = [p.name for p in plot_plan(plan, tmp_path)]
    assert names == ["sparsity_per_projection.png", "tile_map_fc.png"]  # no blocks: no per-block pictures
    assert plot_plan(TilePlan(), tmp_path / "empty") == []


def test_a_redraw_into_the_same_folder_leaves_no_earlier_plans_pictures(tmp_path: Path) -> None:
    kinds = torch.tensor([[0, 1, 1]], dtype=torch.uint8)
    plot_plan(synthetic_plan(), tmp_path, tile_maps=5)
    (tmp_path / "mine.png").write_bytes(PNG_MAGIC)
    (tmp_path / "notes.txt").write_text("keep")
    plan = TilePlan(layers={"fc.weight": make_layer("fc.weight", (8, 24), (8, 8), kinds, seed=1)})
    names = [p.name for p in plot_plan(plan, tmp_path)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names + ["mine.png", "notes.txt"])
    plot_plan(TilePlan(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.png", "notes.txt"]


def test_plot_plan_does_not_switch_the_pyplot_backend(tmp_path: Path) -> None:
    import matplotlib

    before = matplotlib.get_backend()
    plot_plan(synthetic_plan(), tmp_path, tile_maps=1)
    assert matplotlib.get_backend() == before


def test_tile_map_of_a_large_grid(tmp_path: Path) -> None:
    """A deep grid (like a 7B up_proj at 128) renders at a sane size without tile borders."""
    kinds = (torch.rand(86, 32, generator=torch.Generator().manual_seed(0)) > 0.3).to(torch.uint8)
    layer = make_layer("model.layers.0.mlp.up_proj.weight", (86 * 4, 32 * 4), (4, 4), kinds, seed=0)
    (path,) = [p for p in plot_plan(TilePlan(layers={layer.name: layer}), tmp_path) if p.name.startswith("tile_map")]
    assert_png(path)
    from PIL import Image

    with Image.open(path) as im:
        w, h = im.size
    assert 300 < w < 2500 and 300 < h < 2500


# ---------------------------------------------------------------------------------------------
# report.json / report.md
# ---------------------------------------------------------------------------------------------


def causal_report(out: Path | None = None) -> dict:
    out = out or Path("runs/x")
    return {
        "command": "patchc prune --sparsity 0.35 --out runs/x",
        "model": "stories260K",
        "kind": "causal",
        "data": {"train": ["tinystories_sample.txt"], "eval": ["tinystories_sample.txt"],
                 "train_tokens": 123456, "eval_tokens": 7890},
        "config": {"tile": [16, 16], "sparsity": 0.35, "variant": "joint", "prior": "sparsegpt"},
        "train": {"steps": 300, "batch_size": 8, "lr": 0.001, "seconds": 42.25,
                  "final": {"step": 300, "loss": 2.34567, "density": 0.6512}},
        "plan": {"path": str(out / "plan.patch"), "density": 0.6503, "sparsity": 0.3497, "n_layers": 35,
                 "skipped": {"tok_embeddings.weight": "excluded by include()"}},
        "metric": "perplexity",
        "evaluation": {"protocol": "perplexity over the held-out 10% of documents"},
        "results": [
            {"name": "dense", "method": "dense", "pattern": "-", "sparsity": 0.0, "perplexity": 12.0812,
             "cosine": None, "retrieval_agreement": None, "seconds": None},
            {"name": "PATCH joint", "method": "patch", "pattern": "hybrid", "sparsity": 0.349712,
             "perplexity": 13.8421, "cosine": None, "retrieval_agreement": None, "seconds": 42.25},
            {"name": "magnitude 2:4", "method": "magnitude", "pattern": "2:4", "sparsity": 0.5,
             "perplexity": 6735.24, "cosine": None, "retrieval_agreement": None, "seconds": None},
            {"name": "wanda 2:4", "method": "wanda", "pattern": "2:4", "sparsity": 0.5,
             "perplexity": 172.53, "cosine": None, "retrieval_agreement": None, "seconds": None},
        ],
        "speed": {"skipped": "no CUDA device"},
        "versions": {"patchc": "0.1.0", "torch": "2.13.0", "triton": "absent", "python": "3.11.2"},
        "device": "cpu (x86_64, 2 threads)",
        "date": "2026-03-01T12:00:00+00:00",
        "timings": {"load": 0.5, "train": 42.3, "evaluate": 3.14},
        "files": {"plan": str(out / "plan.patch"), "sparsity_per_block": str(out / "sparsity_per_block.png"),
                  "tile_map_block0_q": str(out / "tile_map_block0_q.png"), "report_json": str(out / "report.json")},
    }


def test_render_markdown_causal() -> None:
    md = render_markdown(causal_report())
    assert md.startswith("# patchc report: stories260K\n")
    assert "patchc prune --sparsity 0.35 --out runs/x" in md
    assert "perplexity (lower is better)" in md
    assert "|---|---|---:|---:|---:|---:|" in md  # names left, numbers right
    for row in ("| dense | - | 0.0% | 12.08 | – | – |",
                "| PATCH joint | hybrid | 35.0% | 13.84 | +14.6% | 42.2 |",  # 42.25 -> banker's rounding
                "| magnitude 2:4 | 2:4 | 50.0% | 6,735 | ×557 | – |",
                "| wanda 2:4 | 2:4 | 50.0% | 172.5 | ×14.3 | – |"):
        assert row in md, row
    assert "123,456 tokens" in md and "7,890 tokens" in md
    assert "cpu (x86_64, 2 threads)" in md
    assert "sparsity 34.97%, target 35.00%" in md and "35 layers planned in 16 × 16 tiles" in md
    assert "`tok_embeddings.weight`: excluded by include()" in md
    assert "300 steps, batch 8, lr 0.001, 42.2 s" in md or "300 steps, batch 8, lr 0.001, 42.3 s" in md
    report = causal_report()
    report["train"]["tile_lr"] = 0.03  # recorded since 2026-12-07: the tile logits train at their own lr
    assert "300 steps, batch 8, lr 0.001 (tile logits 0.03), 42." in render_markdown(report)
    assert "loss 2.346" in md
    assert "![sparsity per block](sparsity_per_block.png)" in md
    assert "![tile map block0 q](tile_map_block0_q.png)" in md
    assert md.index("sparsity_per_block.png") < md.index("tile_map_block0_q.png")
    assert "| train | 42.3 |" in md and "| total | 45.9 |" in md
    assert "torch 2.13.0" in md and "python 3.11.2" in md
    assert "no CUDA device" in md
    assert "rows read back" not in md
    resumed = render_markdown(causal_report() | {"resumed_rows": ["dense", "magnitude 2:4"]})
    assert "- **rows read back** from an earlier process of this run (rows.json): dense, magnitude 2:4" in resumed


def test_render_markdown_encoder() -> None:
    report = {
        "model": "all-MiniLM-L6-v2", "kind": "encoder", "metric": "cosine",
        "data": {"train": ["a.txt"], "eval": ["b.txt"], "train_tokens": 2000, "eval_tokens": 500,
                 "train_tokens_generated": 1500, "train_tokens_extra": 300, "eval_extra": ["c.txt"],
                 "eval_extra_tokens": {"c.txt": 512}},
        "results": [
            {"name": "dense", "method": "dense", "pattern": "-", "sparsity": 0.0, "perplexity": None,
             "cosine": 1.0, "retrieval_agreement": 1.0, "seconds": None, "cosine_extra": {"c.txt": 1.0}},
            {"name": "PATCH joint", "method": "patch", "pattern": "hybrid", "sparsity": 0.25,
             "perplexity": None, "cosine": 0.98765, "retrieval_agreement": 0.9512, "seconds": None,
             "cosine_extra": {"c.txt": 0.91234}},
        ],
    }
    md = render_markdown(report)
    assert "cosine to dense (higher is better)" in md and "retrieval agreement (higher is better)" in md
    assert "| c.txt (cosine) |" in md
    assert "| dense | - | 0.0% | 1.0000 | 1.000 | 1.0000 |" in md
    assert "| PATCH joint | hybrid | 25.0% | 0.9877 | 0.951 | 0.9123 |" in md
    assert "2,000 sentences" in md and "1,500 were written by the dense model" in md
    assert "also scored on its sentences: c.txt (512 sentences)" in md
    assert "300 training sentences from --train-extra files" in md
    assert "perplexity" not in md


def test_render_markdown_tolerates_a_minimal_report() -> None:
    md = render_markdown({})
    assert md.startswith("# patchc report")
    md = render_markdown({"results": [{"name": "x|y", "perplexity": None, "sparsity": None}]})
    assert "| x\\|y | – | – | – |" in md  # the pipe is escaped, missing numbers show as a dash


def test_write_report_roundtrip(tmp_path: Path) -> None:
    report = causal_report(tmp_path)
    report["plan"]["path"] = tmp_path / "plan.patch"  # a Path sneaks in: written as a string
    paths = write_report(report, tmp_path / "run")
    assert set(paths) == {"report_json", "report_md"}
    text = paths["report_json"].read_text()
    loaded = json.loads(text)
    assert loaded["results"] == causal_report(tmp_path)["results"]
    assert loaded["plan"]["path"] == str(tmp_path / "plan.patch")
    assert list(loaded) == list(report)  # keys keep the job's order (not sorted)
    assert text.startswith('{\n  "command"')  # indent 2
    assert paths["report_md"].read_text() == render_markdown(report)


def test_write_report_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_report(causal_report(tmp_path), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    changed = causal_report(tmp_path)
    changed["model"] = "changed"

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(rep.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_report(changed, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # old files intact, no temp files
    monkeypatch.undo()

    def broken_render(report, pictures=None):
        raise RuntimeError("render failed")

    monkeypatch.setattr(rep, "render_markdown", broken_render)
    with pytest.raises(RuntimeError):
        write_report(changed, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # json not written either


# ---------------------------------------------------------------------------------------------
# redraw (patchc report PLAN)
# ---------------------------------------------------------------------------------------------


def test_redraw_from_a_saved_plan(tmp_path: Path) -> None:
    plan = synthetic_plan()
    plan.save(tmp_path / "plan.patch")
    paths = redraw(tmp_path / "plan.patch")
    assert [p.name for p in paths][:3] == ["sparsity_per_block.png", "sparsity_per_projection.png", "sparsity_heatmap.png"]
    assert all(p.parent == tmp_path for p in paths)
    for p in paths:
        assert_png(p)
    assert not (tmp_path / "report.md").exists()  # no report.json beside the plan: pictures only


def test_redraw_takes_a_run_folder_and_names_one_without_a_plan(tmp_path: Path) -> None:
    synthetic_plan().save(tmp_path / "plan.patch")
    assert all(p.parent == tmp_path for p in redraw(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no plan.patch in it; give the folder of a finished"):
        redraw(tmp_path / "empty")


def test_redraw_rewrites_report_md(tmp_path: Path) -> None:
    plan = synthetic_plan()
    plan.save(tmp_path / "plan.patch")
    report = causal_report(tmp_path)
    write_report(report, tmp_path)
    json_before = (tmp_path / "report.json").read_bytes()
    (tmp_path / "report.md").write_text("stale")
    out = tmp_path / "redrawn"
    paths = redraw(tmp_path / "plan.patch", out)
    assert paths[-1] == out / "report.md"
    md = paths[-1].read_text()
    assert "| PATCH joint | hybrid | 35.0% | 13.84 |" in md
    for p in paths[:-1]:
        assert f"]({p.name})" in md  # links the freshly drawn pictures, by name (they sit beside it)
    assert (tmp_path / "report.md").read_text() == "stale"  # out_dir given: the plan's folder untouched
    assert (tmp_path / "report.json").read_bytes() == json_before


def test_redraw_rejects_a_broken_report_json(tmp_path: Path) -> None:
    synthetic_plan().save(tmp_path / "plan.patch")
    (tmp_path / "report.json").write_text("{not json")
    with pytest.raises(ValueError, match="report.json"):
        redraw(tmp_path / "plan.patch")


def test_cli_report_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from patchc.job.cli import main

    synthetic_plan().save(tmp_path / "plan.patch")
    assert main(["report", str(tmp_path / "plan.patch")]) == 0
    printed = capsys.readouterr().out.split()
    assert str(tmp_path / "sparsity_heatmap.png") in printed
    assert os.path.exists(tmp_path / "sparsity_per_block.png")


def test_import_patchc_does_not_import_matplotlib() -> None:
    import subprocess
    import sys

    code = "import sys, patchc, patchc.job.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert out == "False"


def test_printed_rows_line_up_whatever_the_longest_name() -> None:
    from patchc.job.report import format_results

    names = ["dense", "PATCH joint", "learned 2:4 (nm) + recovery"]
    rows = [{"name": n, "sparsity": 0.5, "perplexity": 7.0, "perplexity_extra": {"wiki.txt": 100.0}} for n in names]
    lines = format_results({"metric": "perplexity", "results": rows}).splitlines()
    assert len({line.index("sparsity") for line in lines}) == 1 and len({len(line) for line in lines}) == 1
    short = format_results({"metric": "perplexity", "results": rows[:1]})
    assert short == "  dense                  sparsity  50.0%   perplexity     7.000   wiki   100.000"  # as before
