"""TRL's GRPOTrainer on the step benchmark's work, in TRL's own environment (.venv-trl, made by
scripts/install_trl_bench.sh); megatron_rl.bench.rl_step runs it. It imports nothing from
megatron_rl: the problems come as JSON, and the reward is the arithmetic task's rule (the
answer after the last `#### ` equals the reference).

    python trl_grpo.py --model DIR --problems FILE --steps N --out FILE [...]

Writes per step: seconds (TrainerCallback, step begin to step end: generation, reward, old
log-probs where TRL needs them, forward-backward, optimizer step) and completion tokens; and the
process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ANSWER_MARKER = "#### "


def arithmetic_reward(completions: list[str], reference: list[str], **_: object) -> list[float]:
    """1.0 where the line after the last `#### ` of a completion is its reference, else 0.0."""
    rewards = []
    for completion, expected in zip(completions, reference, strict=True):
        marker = completion.rfind(ANSWER_MARKER)
        answer = completion[marker + len(ANSWER_MARKER) :].split("\n", 1)[0].strip()
        rewards.append(float(marker >= 0 and answer == expected))
    return rewards


class StepClock(TrainerCallback):
    """Seconds of every optimizer step and the mean completion length TRL logs for it."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.mean_lengths: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.seconds.append(time.perf_counter() - self._started)

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
        if logs and "completions/mean_length" in logs:
            self.mean_lengths.append(float(logs["completions/mean_length"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--problems", required=True, help="JSON list of {prompt, reference}")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON file for the measurements")
    args = parser.parse_args()
    problems = json.loads(Path(args.problems).read_text())
    prompts_per_step = len(problems) // args.steps
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_output"),
        use_cpu=True,
        seed=args.seed,
        max_steps=args.steps,
        learning_rate=args.lr,
        per_device_train_batch_size=prompts_per_step * args.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,  # one update per generation batch
        num_iterations=1,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        importance_sampling_level="sequence",  # GSPO
        loss_type="grpo",
        beta=0.0,
        epsilon=3e-4,
        epsilon_high=4e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=False,  # the problems in megatron-rl's step order
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=Dataset.from_list(problems),
        processing_class=AutoTokenizer.from_pretrained(args.model),
        callbacks=[clock],
    )
    trainer.train()
    result = {
        "seconds": clock.seconds,
        "completion_tokens": [
            length * config.per_device_train_batch_size for length in clock.mean_lengths
        ],
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "threads": torch.get_num_threads(),
        "gradient_checkpointing": config.gradient_checkpointing,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
