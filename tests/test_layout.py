"""The package layout: stage folders that import only what comes before them, size limits, the old
module paths (deprecated aliases) and plan files written before the stage folders existed."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

import patchc
from patchc._moved import MOVED
from patchc.ir import TilePlan

ROOT = Path(patchc.__file__).resolve().parent
LEGACY_PLAN = Path(__file__).parent / "data" / "plan_v1.patch"

# Pipeline order: a module may import (at run time) from its own stage and from stages of a lower rank.
RANK = {
    "utils": 0,
    "config": 1,
    "ir": 2,
    "models": 2,
    "masking": 3,
    "pruning": 3,
    "codegen": 3,
    "passes": 4,
    "runtime": 4,
    "job": 5,
    "bench": 5,
    "export": 5,
}
MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 200


def modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p.parent != ROOT or p.stem == "config")


def stage_of(path_or_name: Path | str) -> str:
    if isinstance(path_or_name, Path):
        rel = path_or_name.relative_to(ROOT)
        return rel.parts[0] if len(rel.parts) > 1 else rel.stem
    return path_or_name.split(".")[1]


def runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every `patchc.*` import outside `if TYPE_CHECKING:` blocks."""
    type_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("patchc."):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("patchc.")]
    return found


def test_every_stage_has_a_rank_and_a_docstring():
    stages = {stage_of(p) for p in modules()}
    assert stages == set(RANK), f"stage folders without a rank (or ranks without a folder): {stages ^ set(RANK)}"
    for stage in RANK:
        init = ROOT / stage / "__init__.py" if (ROOT / stage).is_dir() else ROOT / f"{stage}.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 20, f"{init}: say what the stage owns and what it hands on"


def test_no_module_imports_a_later_stage():
    upward = []
    for path in modules():
        here = stage_of(path)
        for line, name in runtime_imports(ast.parse(path.read_text())):
            if name.split(".")[1] in RANK and RANK[stage_of(name)] > RANK[here]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({here}) imports {name}")
    assert not upward, "imports against the pipeline order:\n" + "\n".join(upward)


def test_modules_and_classes_stay_small_or_say_why():
    too_big = []
    for path in modules():
        text = path.read_text()
        tree = ast.parse(text)
        reason = "Why this file is long" in (ast.get_docstring(tree) or "")
        if len(text.splitlines()) > MAX_MODULE_LINES and not reason:
            too_big.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES and not reason:
                too_big.append(f"{path.name}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_is_the_new_module_with_a_warning(old, monkeypatch):
    new = importlib.import_module(MOVED[old])
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        alias = importlib.import_module(old)
    assert alias is new
    assert new.__spec__.name == MOVED[old]  # the alias did not rename the real module
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is new  # warned once, then cached


def test_deprecation_points_at_the_importing_line(monkeypatch):
    monkeypatch.delitem(sys.modules, "patchc.tile_plan", raising=False)
    with pytest.warns(DeprecationWarning) as caught:
        from patchc.tile_plan import TILE_DENSE  # noqa: F401
        from patchc.tile_plan import TilePlan as OldTilePlan
    assert OldTilePlan is patchc.TilePlan
    assert Path(caught[0].filename) == Path(__file__)


def test_public_api_keeps_its_names():
    import patchc.codegen
    import patchc.runtime

    assert callable(patchc.transform) and callable(patchc.harden) and callable(patchc.compile)
    for name in ("PatchConfig", "TilePlan", "LayerPlan", "PlanError", "MaskedProgram", "train_masks", "lm_loss"):
        assert hasattr(patchc, name), name
    for name in ("pack", "tile_linear", "generate", "reference_tile_linear"):
        assert hasattr(patchc.codegen, name), name
    for name in ("compile", "TileLinear", "tune_plan", "patch_backend"):
        assert hasattr(patchc.runtime, name), name
    assert patchc.masks.load_npz is importlib.import_module("patchc.pruning.mask_files").load_npz


def test_plan_file_from_before_the_move_loads_and_saves_byte_identical(tmp_path):
    plan = TilePlan.load(LEGACY_PLAN)
    plan.verify()
    # Counts and exact sums recorded when the file was written (old code, commit 7538a3c).
    expect = {
        "layers.0.mlp.up_proj.weight": (torch.float32, 3, 3, -3.1262038475833833, 656.367381255026),
        "layers.0.mlp.down_proj.weight": (torch.float16, 7, 5, 29.063976526260376, 657.5264551639557),
        "layers.1.self_attn.q_proj.weight": (torch.bfloat16, 3, 1, 2.8681182861328125, 719.4828948974609),
    }
    assert list(plan.layers) == list(expect)
    for fqn, (dtype, n_dense, n_sparse, total, abs_total) in expect.items():
        layer, dense = plan.layers[fqn], plan.layers[fqn].to_dense().double()
        assert (layer.dtype, layer.n_dense, layer.n_sparse) == (dtype, n_dense, n_sparse)
        assert float(dense.sum()) == total and float(dense.abs().sum()) == abs_total
    assert plan.layers["layers.0.mlp.up_proj.weight"].bias is not None
    assert plan.skipped == {"lm_head.weight": "excluded by PatchConfig.exclude"}
    assert plan.density == pytest.approx(0.8315789473684211, abs=0)
    plan.save(tmp_path / "again.patch")  # now written as version 2: the same tensors plus checksums
    import safetensors.torch

    old, new = (safetensors.torch.load_file(str(p)) for p in (LEGACY_PLAN, tmp_path / "again.patch"))
    assert old.keys() == new.keys() and all(torch.equal(old[k].view(torch.uint8), new[k].view(torch.uint8)) for k in old)
    head = TilePlan.load(tmp_path / "again.patch").header()
    assert head["version"] == 2 and head["layers"] == plan.header()["layers"]
