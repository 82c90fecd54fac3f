"""One SGLang server of a SLURM job's rollout nodes.

    python -m megatron_rl.launch.rollout_server RECIPE [KEY=VALUE ...]

runs as a task of the job's rollout step (megatron_rl.launch.slurm): it becomes the recipe's
server number SLURM_LOCALID on this node (port rollout.sglang.base_port + SLURM_LOCALID),
sampling from run.seed + SLURM_PROCID (the task's number in the step),
listening on every interface so that the trainer's nodes reach it, started with the command line
and environment the trainer uses for the servers it starts itself
(megatron_rl.rollout.sglang.servers).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from megatron_rl.config import load_config
from megatron_rl.rollout.sglang.servers import server_argv, server_environment
from megatron_rl.trainer.recipe import Recipe


def serve_argv(
    recipe: Recipe, local_index: int, job_index: int
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of this node's server `local_index`, server
    `job_index` of the job's rollout servers (it samples from run.seed + job_index, as the
    trainer's own server job_index would)."""
    config = dataclasses.replace(recipe.rollout.sglang, host="0.0.0.0")
    argv = server_argv(
        config,
        recipe.model.hf_path,
        local_index,
        random_seed=recipe.run.seed + job_index,
        routed_experts=recipe.algo.routing_replay.uses_engine_routing,
    )
    return argv, server_environment(config)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m megatron_rl.launch.rollout_server RECIPE [KEY=VALUE ...]")
        return 2
    recipe = load_config(Recipe, args[0], args[1:])
    command, env = serve_argv(
        recipe, int(os.environ.get("SLURM_LOCALID", "0")), int(os.environ.get("SLURM_PROCID", "0"))
    )
    print(f"megatron-rl: {' '.join(command)}", flush=True)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    sys.exit(main())
