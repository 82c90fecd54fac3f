"""Files written atomically get the permissions a plain open() would give them (a run directory
on a shared filesystem is read by others), and keep those of the file they replace."""

from __future__ import annotations

import os

from megatron_rl.files.atomic import write_text_atomic


def test_a_new_file_gets_the_umask_mode_and_a_replaced_one_keeps_its_own(tmp_path):
    umask = os.umask(0o027)
    os.umask(umask)
    path = write_text_atomic(tmp_path / "new.txt", "a")
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    path.chmod(0o600)
    write_text_atomic(path, "b")
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == "b"
    assert [entry.name for entry in tmp_path.iterdir()] == ["new.txt"]
