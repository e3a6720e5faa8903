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
