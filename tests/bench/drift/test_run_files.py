"""A finished grid's runs packed into one archive (bench/drift/run_files.py); the report read from
it is checked against the unpacked one end to end in test_harness.py."""

from __future__ import annotations

import tarfile

import pytest

from megatron_rl.bench.drift.run_files import RUNS_ARCHIVE, ArchiveError, pack_runs, run_file


def _run(out, run_id, **files):
    (out / "runs" / run_id).mkdir(parents=True)
    for name, text in files.items():
        (out / "runs" / run_id / name.replace("_", ".")).write_text(text)


def test_packed_files_read_back_as_they_were_and_others_are_left_out(tmp_path):
    _run(tmp_path, "a", status_json='{"state": "done"}', metrics_jsonl='{"step": 0}\n')
    _run(tmp_path, "b", status_json='{"state": "crashed"}', train_log="10%\r20%\r\n")
    (tmp_path / "runs" / "a" / "checkpoints").mkdir()  # not a run file: not packed
    assert run_file(tmp_path, "a", "metrics.jsonl") == '{"step": 0}\n'  # from runs/
    archive = pack_runs(tmp_path, ["a", "b"])
    assert archive == tmp_path / RUNS_ARCHIVE and not (tmp_path / "runs").exists()
    assert run_file(tmp_path, "a", "metrics.jsonl") == '{"step": 0}\n'  # from the archive
    assert run_file(tmp_path, "b", "status.json") == '{"state": "crashed"}'
    assert run_file(tmp_path, "b", "train.log") == "10%\r20%\r\n"  # no newline translation
    assert run_file(tmp_path, "b", "metrics.jsonl") is None
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == [
            "a/metrics.jsonl",
            "a/status.json",
            "b/status.json",
            "b/train.log",
        ]


def test_a_grid_with_a_run_not_ended_is_not_packed(tmp_path):
    _run(tmp_path, "a", status_json="{}")
    _run(tmp_path, "b", metrics_jsonl="{}\n")  # started, not ended
    with pytest.raises(ArchiveError, match=r"1 runs of the grid have not ended .*first: b"):
        pack_runs(tmp_path, ["a", "b"])
    assert (tmp_path / "runs" / "b").is_dir() and not (tmp_path / RUNS_ARCHIVE).exists()


def test_a_damaged_archive_is_named(tmp_path):
    (tmp_path / RUNS_ARCHIVE).write_bytes(b"not xz")
    with pytest.raises(ArchiveError, match=r"runs\.tar\.xz: not a readable runs archive"):
        run_file(tmp_path, "a", "status.json")
