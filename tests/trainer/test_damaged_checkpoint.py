"""A real checkpoint of `megatron-rl train` damaged on disk after its save, its size kept (4 KiB
of 0xff in the middle of a data file: what the length check cannot see): `--resume` names the
file, sets the checkpoint aside and resumes the one before, repeating the run to the last bit;
with no whole checkpoint left it stops with one line naming the file and moves nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatron_rl.files.checksums import MANIFEST
from tests.trainer.run_cli import RESUMED_RUN, check_repeats, read_metrics, train_cli

TWO_STEPS = [*RESUMED_RUN, "run.steps=2"]  # a checkpoint after each step


def _damage_largest_data_file(checkpoint: Path) -> Path:
    """4 KiB of 0xff in the middle of the checkpoint's largest .distcp, its size kept."""
    data = max((checkpoint / "weights").glob("*.distcp"), key=lambda path: path.stat().st_size)
    size = data.stat().st_size
    with open(data, "r+b") as handle:
        handle.seek(size // 2 - 2048)
        handle.write(b"\xff" * 4096)
    assert data.stat().st_size == size
    return data


def test_a_checkpoint_damaged_in_place_is_set_aside_and_the_one_before_resumed(tmp_path):
    first = train_cli(tmp_path, TWO_STEPS)
    assert first.returncode == 0, first.stderr[-3000:]
    whole = read_metrics(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    damaged = _damage_largest_data_file(checkpoints / "step_000002")

    resumed = train_cli(tmp_path, TWO_STEPS, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stderr
    assert f"{damaged}: damaged (its bytes differ from those saved: CRC-32 " in said, said[-3000:]
    assert "it is kept as step_000002.damaged, and an older checkpoint is tried" in said
    check_repeats(whole, tmp_path, (2,))  # step 1's checkpoint was loaded, step 2 done again
    assert (checkpoints / "step_000002.damaged" / "trainer.json").is_file()

    # every file of the new checkpoint has its checksum: those megatron-core's writers wrote
    # (hashed after them), the RNG states (as written), the small ones
    recorded = json.loads((checkpoints / "step_000002" / MANIFEST).read_text())["files"]
    for name in ("weights/.metadata", "weights/common.pt", "rng_rank0.pt", "trainer.json"):
        assert name in recorded
    assert sum(name.endswith(".distcp") for name in recorded) >= 1

    # the only checkpoint left damaged: one line naming the file, nothing moved
    shutil.rmtree(checkpoints / "step_000001")
    damaged = _damage_largest_data_file(checkpoints / "step_000002")
    again = train_cli(tmp_path, TWO_STEPS, resume=True)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "Traceback" not in again.stderr, again.stderr[-3000:]
    (line,) = [line for line in again.stderr.splitlines() if "error" in line]
    assert line.startswith(f"megatron-rl: error: {damaged}: damaged (its bytes differ"), line
    assert f"no checkpoint in {checkpoints} can be resumed" in line
    assert (checkpoints / "step_000002").is_dir()
    assert not (checkpoints / "step_000002.damaged-2").exists()
