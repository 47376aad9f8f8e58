"""atomic_write: the old file or the new one survives, never a torn one, with the permissions open() would give."""

import os
import stat

import pytest

from orbit_lightning.atomic_write import atomic_write


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_permissions_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "sub" / "f.bin", lambda tmp: open(tmp, "wb").write(b"new"))
        with open(tmp_path / "plain", "w"):  # what a plain open() gives, the reference
            pass
    finally:
        os.umask(old)
    assert (tmp_path / "sub" / "f.bin").read_bytes() == b"new"
    assert stat.S_IMODE((tmp_path / "sub" / "f.bin").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == mode


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")

    def half_then_fail(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("ne")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]
