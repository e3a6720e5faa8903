"""The README's Python blocks run as written, in order, in one namespace (an HF model, CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_training_loop_block():
    blocks = python_blocks()
    assert len(blocks) >= 3 and "patchc.lm_loss(prog" in blocks[0] and "patchc.harden(" in blocks[0]


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # the blocks write model.patch, mask.npz
    namespace: dict = {}
    for i, block in enumerate(python_blocks()):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    plan = namespace["plan"]
    assert abs(plan.density - 0.65) < 0.01 and (tmp_path / "model.patch").is_file()
    assert "global (parameter weighted" in capsys.readouterr().out
