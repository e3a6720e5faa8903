"""patchc.utils.files: atomic writes."""

from __future__ import annotations

import os


def test_atomic_writes_respect_the_umask_and_keep_an_existing_mode(tmp_path):
    """mkstemp makes 0600 files; results must get what open() would give (shared run folders, caches)."""
    import stat

    from patchc.utils.files import write_bytes_atomic

    old = os.umask(0o022)
    try:
        fresh = write_bytes_atomic(tmp_path / "a.json", b"{}")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
        os.umask(0o002)
        assert stat.S_IMODE(write_bytes_atomic(tmp_path / "b.json", b"{}").stat().st_mode) == 0o664
        os.chmod(fresh, 0o600)  # a file the user made private stays private when rewritten
        assert stat.S_IMODE(write_bytes_atomic(fresh, b"[]").stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_saving_a_plan_onto_a_folder_names_the_folder_and_leaves_it_as_it_was(tmp_path):
    """`plan.save(folder)` failed naming its own hidden temp file (`.out.x1y2.tmp`), not the path given."""
    import pytest
    import torch

    from patchc.ir import TilePlan
    from patchc.job.console import one_line

    plan = TilePlan.from_weights({"w.weight": torch.randn(16, 16)}, tile=(16, 16))
    folder = tmp_path / "out"
    (folder / "kept.txt").parent.mkdir()
    (folder / "kept.txt").write_text("mine")
    with pytest.raises(IsADirectoryError) as err:
        plan.save(folder)
    assert one_line(err.value) == f"{folder}: a folder is there; give a file's path"
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in folder.iterdir()] == ["kept.txt"]
