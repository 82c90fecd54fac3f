"""A/B on one CPU SGLang server (the CPU recipe's settings): a step's samples asked for as `n`
copies of each prompt (one seed per prompt, what the engine sent before) or as one item per
sample, each with its own seed (what it sends now). Prints each arm's seconds per request.

    python scripts/ab_sglang_sample_items.py    # from the repository root, after
                                                # scripts/install_sglang_cpu.sh
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time

from megatron_rl.config import load_config
from megatron_rl.rollout.sglang import ServerGroup
from megatron_rl.rollout.sglang.http import ServerConnection
from megatron_rl.trainer.recipe import Recipe

CPU_RECIPE = "examples/moe/tiny_gspo_sglang.yaml"  # its paths are the repository root's

PROMPTS = [[1 + (7 * i + j) % 30 for j in range(12 + i % 5)] for i in range(16)]
SAMPLES = 8
SAMPLING = {"temperature": 1.0, "max_new_tokens": 48}
ROUNDS = 5


def as_copies(server: ServerConnection) -> list:
    return server.post(
        "/generate",
        {
            "input_ids": PROMPTS,
            "sampling_params": SAMPLING | {"n": SAMPLES, "sampling_seed": 1},
            "return_logprob": True,
        },
    )


def as_items(server: ServerConnection) -> list:
    return server.post(
        "/generate",
        {
            "input_ids": [prompt for prompt in PROMPTS for _ in range(SAMPLES)],
            "sampling_params": [
                SAMPLING | {"sampling_seed": k} for k in range(len(PROMPTS) * SAMPLES)
            ],
            "return_logprob": True,
        },
    )


def main() -> None:
    recipe = load_config(Recipe, CPU_RECIPE)
    config = dataclasses.replace(recipe.rollout.sglang, base_port=30861)
    arms = {"n copies": as_copies, "an item per sample": as_items}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    with (
        tempfile.TemporaryDirectory() as logs,
        ServerGroup(config, recipe.model.hf_path, logs, seed=recipe.run.seed) as group,
    ):
        server = group.servers[0].connection
        for ask in arms.values():  # warm-up
            ask(server)
        for _ in range(ROUNDS):  # alternating, so that drift hits both arms
            for name, ask in arms.items():
                start = time.perf_counter()
                answer = ask(server)
                seconds[name].append(time.perf_counter() - start)
                assert len(answer) == len(PROMPTS) * SAMPLES
    for name, values in seconds.items():
        print(
            f"{name}: median {statistics.median(values):.3f} s "
            f"[{min(values):.3f}, {max(values):.3f}] over {ROUNDS} requests of "
            f"{len(PROMPTS)} prompts x {SAMPLES} samples"
        )


if __name__ == "__main__":
    main()
