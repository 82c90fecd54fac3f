"""The recipe's `data` section: where the problems come from and which verifier scores them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config import ConfigError, check_positive
from megatron_rl.rewards.arithmetic import ArithmeticTask
from megatron_rl.rewards.datasets import load_jsonl_problems, load_parquet_problems
from megatron_rl.rewards.scoring_pool import ScoringPool
from megatron_rl.rewards.source import ProblemSource
from megatron_rl.rewards.verifiers import verifier_names


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts, references and the verifier that scores responses."""

    source: Literal["arithmetic", "jsonl", "parquet"] = "arithmetic"
    """arithmetic: the built-in multi-step task; jsonl, parquet: `train_path` / `eval_path`
    files."""
    train_path: str | None = None
    """Training problems: a JSON Lines file with one {"prompt": ..., "answer": ...} object per
    line (source=jsonl), or a parquet file with one per row (source=parquet)."""
    eval_path: str | None = None
    """Held-out problems, in the same format."""
    prompt_key: str = "prompt"
    """The key (JSON Lines) or column (parquet) holding each problem's prompt."""
    answer_key: str = "answer"
    """The key or column holding each problem's reference answer."""
    chat_template: bool = False
    """Wrap each prompt as one user message in the tokenizer's chat template, with the
    assistant's turn opened (instruct models)."""
    verifier: str = "arithmetic"
    """Reward function, one of megatron_rl.rewards.verifier_names()."""
    reward_timeout_s: float = 5.0
    """A verifier call longer than this gives reward 0 (counted as a timeout): its scoring
    worker process is killed and replaced."""
    reward_workers: int = 8
    """Scoring worker processes on rank 0: verifier calls run in parallel, one per worker."""
    reward_memory_mb: int = 4096
    """Memory a scoring worker may take beyond what it holds once started (its address space,
    RLIMIT_AS); a verifier call that needs more gives reward 0 (counted as a failure), and its
    worker is replaced."""
    eval_problems: int = 256
    """Held-out problems scored at each evaluation (the first N of the eval split)."""
    min_operands: int = 3
    """Arithmetic task: fewest numbers in an expression."""
    max_operands: int = 4
    """Arithmetic task: most numbers in an expression."""
    max_operand: int = 30
    """Arithmetic task: largest number."""

    def validate(self) -> None:
        if self.verifier not in verifier_names():
            raise ConfigError(
                f"data.verifier: unknown verifier {self.verifier!r}; valid: "
                f"{', '.join(verifier_names())}"
            )
        if self.source != "arithmetic" and not (self.train_path and self.eval_path):
            raise ConfigError(
                f"data.train_path and data.eval_path: required when source={self.source}"
            )
        for name in ("prompt_key", "answer_key"):
            if not getattr(self, name):
                raise ConfigError(f"data.{name}: expected a non-empty key")
        check_positive(
            "data", self, "reward_timeout_s", "reward_workers", "reward_memory_mb", "eval_problems"
        )
        if not math.isfinite(self.reward_timeout_s):
            raise ConfigError(
                f"data.reward_timeout_s: expected finite seconds, got {self.reward_timeout_s}"
            )


def problem_source(config: DataConfig, *, per_step: int, seed: int) -> ProblemSource:
    """The training batches and held-out problems `config` names; `per_step` problems per RL
    step, shuffled with `seed`."""
    if config.source != "arithmetic":
        load = load_jsonl_problems if config.source == "jsonl" else load_parquet_problems
        train = load(config.train_path, config.prompt_key, config.answer_key)
        held_out = load(config.eval_path, config.prompt_key, config.answer_key)
    else:
        task = ArithmeticTask(
            min_operands=config.min_operands,
            max_operands=config.max_operands,
            max_operand=config.max_operand,
        )
        train = task.problems("train", 20_000, seed=seed)
        # One fixed held-out set (seed 0), so runs with different seeds are compared on it.
        held_out = task.problems("eval", config.eval_problems, seed=0)
    return ProblemSource(train, held_out[: config.eval_problems], per_step=per_step, seed=seed)


def open_scoring_pool(config: DataConfig) -> ScoringPool:
    """The scoring worker processes `config` asks for, started; the caller closes them."""
    return ScoringPool(
        workers=config.reward_workers,
        timeout_s=config.reward_timeout_s,
        memory_limit_mb=config.reward_memory_mb,
    )
