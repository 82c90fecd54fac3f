"""A checkpoint's RNG states (`rng_rank{r}.pt`) are plain data: saved as a checkpoint saves
them, they load with `torch.load(weights_only=True)` and restore torch's, Python's and NumPy's
generators exactly (a cached Gaussian included); a file of an older checkpoint (NumPy's state
as an array) still restores exactly; a file that names a callable is refused, naming the file,
and the callable is not run."""

from __future__ import annotations

import os
import random
import shlex

import numpy as np
import pytest
import torch

from megatron_rl.files.plain_data import NotPlainData
from megatron_rl.trainer import checkpoints


def _draws() -> tuple:
    return (random.random(), np.random.normal(), np.random.randint(2**30), torch.rand(3))


def _scramble() -> None:
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)


def _restores_exactly(path, expected) -> bool:
    _scramble()
    checkpoints._set_rng_state(checkpoints._load_rng_state(path))
    drawn = _draws()
    return drawn[:3] == expected[:3] and torch.equal(drawn[3], expected[3])


@pytest.fixture
def seeded():
    """Generators part way through, NumPy with a Gaussian cached; put back afterwards."""
    saved = checkpoints._rng_state()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # Box-Muller draws two: one is cached
    yield
    checkpoints._set_rng_state(saved)


def test_saved_states_are_plain_data_and_restore_exactly(tmp_path, seeded):
    path = tmp_path / "rng_rank0.pt"
    torch.save(checkpoints._rng_state(), path)
    expected = _draws()
    torch.load(path, weights_only=True)  # nothing but plain data, nothing allowed besides
    assert _restores_exactly(path, expected)


def test_an_older_checkpoints_states_restore_exactly(tmp_path, seeded):
    path = tmp_path / "rng_rank0.pt"
    older = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # as an older checkpoint saved it: with an array
    }
    torch.save(older, path)
    expected = _draws()
    assert _restores_exactly(path, expected)


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_states_that_name_a_callable_are_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "rng_rank0.pt"
    state = checkpoints._rng_state() | {"numpy": _RunsCommand(f"touch {shlex.quote(str(marker))}")}
    torch.save(state, path)
    with pytest.raises(NotPlainData) as refused:
        checkpoints._load_rng_state(path)
    assert str(refused.value).startswith(
        f"{path}: holds code or objects that are not plain data (posix.system); it was not loaded"
    )
    assert not marker.exists()
