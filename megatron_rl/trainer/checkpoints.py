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
    CHECKPOINTS/latest      name of the newest complete checkpoint

A checkpoint is written into `.step_000020.partial` and renamed when every rank has finished
(`megatron_rl.files.atomic.staged_directory`), and `latest` is replaced atomically after that:
a run killed while saving keeps its previous checkpoint. Only the newest `keep` checkpoints
stay; an old one is renamed to `.step_000010.removing` before it is removed, so that a kill
leaves either the whole checkpoint or a hidden folder. The next run removes what killed runs left
(`clear_leftovers`), and resumes from the newest checkpoint whose files are whole
(`checkpoint_to_resume`; a `step_N` directory exists only once complete, so `latest`, which is
rewritten to it, is for people and tools), with damaged newer ones renamed `step_N.damaged` and
named. A checkpoint resumes at the layout
and with the optimizer it was saved with (`check_resumable`).
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
    save_weights,
    write_metadata,
)
from megatron_rl.files.atomic import staged_directory, write_text_atomic
from megatron_rl.files.distcp import check_weights
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
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


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
        save_weights(
            _sharded_state(policy, is_loading=False, format_version=FORMAT_VERSION),
            staging / "weights",
        )
        _save_durably(_rng_state(), staging / f"rng_rank{dist.get_rank()}.pt")
        if dist.get_rank() == 0 and rollouts_ahead:
            _save_durably(rollouts_ahead, staging / ROLLOUTS_AHEAD)
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
            write_text_atomic(staging / "trainer.json", json.dumps(state, indent=2) + "\n")
    if dist.get_rank() == 0:
        write_text_atomic(directory / LATEST, final.name + "\n")
        prune(directory, keep=keep, newest=final)
    dist.barrier()
    return final


def checkpoint_to_resume(directory: Path) -> Path | None:
    """The newest checkpoint under `directory` whose files are whole, or None when there is
    none (the module docstring); `latest` is rewritten when it named another or was missing."""
    pointer = directory / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    for path in reversed(complete_checkpoints(directory)):
        try:
            check_weights(path)
        except ValueError as error:
            damaged = path.with_name(f"{path.name}.damaged")
            os.replace(path, damaged)
            _say(f"{error}; it is kept as {damaged.name}, and an older checkpoint is tried")
            continue
        if path.name != named:
            _say(f"{pointer}: {'named ' + named if named else 'missing'}; resuming {path.name}")
            write_text_atomic(pointer, path.name + "\n")
        return path
    return None


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


def _save_durably(value: Any, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


def load_rollouts_ahead(path: Path) -> list[dict[str, Any]]:
    """The rollouts generated ahead that the checkpoint at `path` saved (none: empty)."""
    saved = path / ROLLOUTS_AHEAD
    return torch.load(saved, weights_only=True) if saved.exists() else []


def load_checkpoint(path: Path, policy: Policy) -> tuple[int, dict[str, Any]]:
    """Restore `policy` (model, optimizer, scheduler) and this rank's RNGs from `path`;
    returns the step it was saved after and the loop's own state."""
    state = json.loads((path / "trainer.json").read_text())
    check_resumable(path, state, policy.dims, is_distributed(policy.optimizer))
    format_version = read_metadata(path, given_as="checkpoint").format_version
    loaded = load_weights(
        _sharded_state(policy, is_loading=True, format_version=format_version), path
    )
    policy.model.module.load_state_dict(loaded["model"])
    load_optimizer_state(policy.optimizer, loaded["optimizer"])
    policy.scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(torch.load(path / f"rng_rank{dist.get_rank()}.pt", weights_only=False))
    return state["step"], state["trainer"]
