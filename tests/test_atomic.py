"""tvsmt/atomic.py: the one atomic write behind plans, reports, HTML pages and the corpus."""

import os
import stat

import pytest

from tvsmt.atomic import atomic_file, atomic_write


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(path) as fh:
            fh.write(b"half of the new")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["plan.json"]


def test_written_files_get_the_umask_mode_and_private_ones_0600(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "shared.json", b"{}")
        atomic_write(tmp_path / "key", b"k", private=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "shared.json").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "key").st_mode) == 0o600
    assert (tmp_path / "shared.json").read_bytes() == b"{}"


def test_the_temporary_file_is_hidden_and_names_the_target(tmp_path):
    path = tmp_path / "report.json"
    with atomic_file(path) as fh:
        (tmp,) = [p for p in os.listdir(tmp_path)]
        assert tmp.startswith(".report.json.partial-") and not path.exists()
        fh.write(b"x")
    assert os.listdir(tmp_path) == ["report.json"]
