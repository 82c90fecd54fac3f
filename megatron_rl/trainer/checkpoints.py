"""Training checkpoints: everything a run needs to continue exactly where it stopped.

    CHECKPOINTS/step_000020/
        weights/            megatron-core dist_checkpointing: the model (loadable at any
                            layout) and the optimizer (optimizer_state.py)
        rng_rank{r}.pt      this rank's torch, Python and NumPy RNG states
        rollouts.pt         the rollouts generated ahead of the step (rollout.max_staleness > 0)
        trainer.json        step, layout, optimizer kind, learning-rate scheduler, the loop's
                            own counters
        megatron_rl.json    model family and config, and
        hf/                 config.json and tokenizer: `megatron-rl convert mcore-to-hf` reads it
        checksums.json      every other file's length and CRC-32, written last
    CHECKPOINTS/latest      name of the newest complete checkpoint

A checkpoint is written into `.step_000020.partial` and renamed when every rank has finished
(`megatron_rl.files.atomic.staged_directory`), and `latest` is replaced atomically after that:
a run killed while saving keeps its previous checkpoint. Every file's checksum is taken as it is
written where this process writes it, and just after, from the page cache, where megatron-core's
writer processes did (`megatron_rl.checkpoint.format.save_weights`). Only the newest `keep`
checkpoints stay; an old one is renamed to `.step_000010.removing` before it is removed, so that
a kill leaves either the whole checkpoint or a hidden folder. The next run removes what killed
runs left (`clear_leftovers`), and resumes from the newest checkpoint whose files are as they
were saved (`checkpoint_to_resume`: the weights' lengths, then every file read once against its
checksum, and trainer.json; a `step_N` directory exists only once complete, so `latest`, which
is rewritten to it, is for people and tools), with damaged newer ones renamed `step_N.damaged`
and named. A checkpoint resumes at the layout and with the optimizer it was saved with
(`check_resumable`).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.checkpoint.format import (
    FORMAT_VERSION,
    load_weights,
    model_sharded_state_dict,
    read_metadata,
    record_checksums_of_every_rank,
    save_weights,
    verify_checkpoint,
    write_metadata,
)
from megatron_rl.files.atomic import flush_to_disk, staged_directory, write_text_atomic
from megatron_rl.files.checksums import FileChecksum, HashingWriter
from megatron_rl.files.plain_data import load_plain_data
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.trainer.optimizer_state import (
    is_distributed,
    load_optimizer_state,
    optimizer_sharded_state_dict,
)
from megatron_rl.trainer.policy import Policy
from megatron_rl.trainer.run_dir import (
    LATEST,
    clear_leftovers,
    complete_checkpoints,
    prune,
    refuse_earlier_run,
)


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, numbers and tuples: plain data, which
    `torch.load(weights_only=True)` reads back (NumPy's key as an int64 tensor)."""
    kind, key, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    numpy = {
        "kind": str(kind),
        "key": torch.from_numpy(key.astype(np.int64)),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy}


# Checkpoints saved before the states were plain data hold NumPy's state as NumPy pickles it:
# an array rebuilt from its bytes (no function of the file's choosing is called), and a dtype.
_NUMPY_ARRAY = [
    np._core.multiarray._reconstruct,
    (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),  # NumPy 1
    np.ndarray,
    np.dtype,
]


def _load_rng_state(path: Path) -> dict[str, Any]:
    """The RNG states saved at `path` (`_rng_state`, or an older checkpoint's NumPy array)."""
    return load_plain_data(path, allowed=_NUMPY_ARRAY)


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy = state["numpy"]
    if isinstance(numpy, dict):  # as `_rng_state` saves it; older checkpoints hold NumPy's tuple
        key = numpy["key"].numpy().astype(np.uint32)
        numpy = (
            numpy["kind"],
            key,
            numpy["position"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    np.random.set_state(numpy)


def _sharded_state(policy: Policy, *, is_loading: bool, format_version: int) -> dict[str, Any]:
    model = model_sharded_state_dict(policy.model.module, format_version)
    optimizer = optimizer_sharded_state_dict(policy.optimizer, model, is_loading=is_loading)
    return {"model": model, "optimizer": optimizer}


ROLLOUTS_AHEAD = "rollouts.pt"


def save_checkpoint(
    directory: Path,
    step: int,
    policy: Policy,
    trainer_state: dict[str, Any],
    *,
    keep: int,
    rollouts_ahead: list[dict[str, Any]] | None = None,
) -> Path:
    """Save the training state after `step` under `directory` (a collective); returns the path.
    `rollouts_ahead` (rank 0's: plain containers and tensors) is saved beside it."""
    final = directory / f"step_{step:06d}"
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    with staged_directory(final, overwrite=True, collective=True) as staging:
        (staging / "weights").mkdir(exist_ok=True)
        dist.barrier()
        weights = save_weights(
            _sharded_state(policy, is_loading=False, format_version=FORMAT_VERSION),
            staging / "weights",
        )
        written = {f"weights/{name}": checksum for name, checksum in weights.items()}
        rng = f"rng_rank{dist.get_rank()}.pt"
        written[rng] = _save_durably(_rng_state(), staging / rng)
        if dist.get_rank() == 0 and rollouts_ahead:
            written[ROLLOUTS_AHEAD] = _save_durably(rollouts_ahead, staging / ROLLOUTS_AHEAD)
        dist.barrier()
        if dist.get_rank() == 0:
            state = {
                "step": step,
                "world_size": dist.get_world_size(),
                "layout": policy.dims.describe(),
                "distributed_optimizer": is_distributed(policy.optimizer),
                "scheduler": policy.scheduler.state_dict(),
                "trainer": trainer_state,
            }
            write_metadata(staging, policy.family, policy.config, policy.hf_dir)
            write_text_atomic(staging / TRAINER_STATE, json.dumps(state, indent=2) + "\n")
        record_checksums_of_every_rank(staging, written)
    if dist.get_rank() == 0:
        write_text_atomic(directory / LATEST, final.name + "\n")
        prune(directory, keep=keep, newest=final)
    dist.barrier()
    return final


def checkpoint_to_resume(directory: Path) -> Path | None:
    """The newest checkpoint under `directory` whose files are as they were saved, or None when
    there is no checkpoint (the module docstring); `latest` is rewritten when it named another
    or was missing. Damaged newer ones are set aside as `step_N.damaged`, each named with its
    first damaged file; when every checkpoint is damaged, a ValueError names the newest's file
    and nothing is moved (a resume from step 0 would silently discard the run)."""
    pointer = directory / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    found = complete_checkpoints(directory)
    damaged: list[tuple[Path, ValueError]] = []
    for path in reversed(found):
        try:
            verified = verify_checkpoint(path)
            read_trainer_state(path)
        except ValueError as error:
            damaged.append((path, error))
            continue
        for bad, error in damaged:
            aside = _free_name(bad.with_name(f"{bad.name}.damaged"))
            os.rename(bad, aside)
            _say(f"{error}; it is kept as {aside.name}, and an older checkpoint is tried")
        if not verified:
            _say(f"{path.name}: saved without checksums; only its files' lengths were checked")
        if path.name != named:
            _say(f"{pointer}: {'named ' + named if named else 'missing'}; resuming {path.name}")
            write_text_atomic(pointer, path.name + "\n")
        return path
    if damaged:
        newest, error = damaged[0]
        older = {1: "", 2: "; the older one is damaged too"}.get(
            len(damaged), f"; the {len(damaged) - 1} older ones are damaged too"
        )
        raise ValueError(
            f"{error}; no checkpoint in {directory} can be resumed{older} (restore the file, or "
            f"move {newest.name} away to start again from step 0)"
        )
    return None


def _free_name(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... the first that does not exist."""
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


TRAINER_STATE = "trainer.json"
# What a resume reads from it (the others are optional: fields added later).
_TRAINER_STATE_KEYS = ("step", "world_size", "scheduler", "trainer")


def read_trainer_state(path: Path) -> dict[str, Any]:
    """Checkpoint `path`'s trainer.json, checked to be a JSON object with the fields a resume
    reads; a ValueError names it otherwise."""
    state_path = path / TRAINER_STATE
    try:
        state = json.loads(state_path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        reason = f"not JSON: {str(error).split('. ')[0]}"
        raise ValueError(f"{state_path}: damaged ({reason}); {path} is unusable") from None
    if not isinstance(state, dict):
        raise ValueError(f"{state_path}: damaged (not a JSON object); {path} is unusable")
    missing = [key for key in _TRAINER_STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"{state_path}: damaged (no {', '.join(missing)}); {path} is unusable")
    if not isinstance(state["step"], int):
        raise ValueError(
            f"{state_path}: damaged (step {state['step']!r} is not an integer); {path} is unusable"
        )
    return state


def resume_point(run_dir: Path, *, resume: bool) -> Path | None:
    """Rank 0: the checkpoint a run in `run_dir` starts from (None: step 0), after removing
    what interrupted saves left. Without `resume`, a directory that holds an earlier run is
    refused (`refuse_earlier_run`); with it, the newest whole checkpoint is chosen
    (`checkpoint_to_resume`)."""
    if not resume:
        refuse_earlier_run(run_dir)
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir():
        return None
    for leftover in clear_leftovers(checkpoints):
        _say(f"removed {leftover}, left by an interrupted save")
    return checkpoint_to_resume(checkpoints) if resume else None


def _say(message: str) -> None:
    print(f"megatron-rl: {message}", file=sys.stderr, flush=True)


def check_resumable(
    path: Path, state: dict[str, Any], dims: ParallelDims, distributed_optimizer: bool
) -> None:
    """Refuse to resume checkpoint `path` (its trainer.json `state`) at another layout or with
    the other optimizer: the RNG states are per rank, and the distributed optimizer's state is
    saved as its ranks hold it."""
    if state["world_size"] != dims.world_size:
        raise ValueError(
            f"{path}: saved by {state['world_size']} ranks, resumed with "
            f"{dims.world_size}; the RNG states are per rank"
        )
    layout = dims.describe()
    if state.get("layout", layout) != layout:
        raise ValueError(
            f"{path}: saved at layout [{state['layout']}], resumed at [{layout}]; resume at the "
            "saved layout, or export the checkpoint (megatron-rl convert mcore-to-hf) and start "
            "a new run from the export"
        )
    # Checkpoints from before the field existed were written by the plain optimizer.
    saved = state.get("distributed_optimizer", False)
    if saved != distributed_optimizer:
        raise ValueError(
            f"{path}: saved with optim.distributed_optimizer={str(saved).lower()}, resumed with "
            f"{str(not saved).lower()}; set optim.distributed_optimizer={str(saved).lower()} to "
            "resume it"
        )


def _save_durably(value: Any, path: Path) -> FileChecksum:
    """torch.save `value` to `path`, flushed to the disk; its checksum, hashed as written."""
    with HashingWriter(path) as handle:
        torch.save(value, handle)
        flush_to_disk(handle)
    return handle.checksum


def load_rollouts_ahead(path: Path) -> list[dict[str, Any]]:
    """The rollouts generated ahead that the checkpoint at `path` saved (none: empty)."""
    saved = path / ROLLOUTS_AHEAD
    return load_plain_data(saved) if saved.exists() else []


def load_checkpoint(path: Path, policy: Policy) -> tuple[int, dict[str, Any]]:
    """Restore `policy` (model, optimizer, scheduler) and this rank's RNGs from `path`;
    returns the step it was saved after and the loop's own state."""
    state = read_trainer_state(path)
    check_resumable(path, state, policy.dims, is_distributed(policy.optimizer))
    format_version = read_metadata(path, given_as="checkpoint").format_version
    loaded = load_weights(
        _sharded_state(policy, is_loading=True, format_version=format_version), path
    )
    policy.model.module.load_state_dict(loaded["model"])
    load_optimizer_state(policy.optimizer, loaded["optimizer"])
    policy.scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(_load_rng_state(path / f"rng_rank{dist.get_rank()}.pt"))
    return state["step"], state["trainer"]
