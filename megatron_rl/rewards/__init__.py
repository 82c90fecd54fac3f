"""Rewards for RL post-training: verifiers that score responses, and the problems they score.

A verifier maps `(prompt, response, reference)` to a float reward and is registered by name
(`math`, `arithmetic`); `score_responses` scores a batch so that a verifier that raises or hangs
costs one sample a zero reward, never the training step. Problems come from the built-in
multi-step arithmetic task (`ArithmeticTask`) or from users' JSON Lines or parquet files
(`load_jsonl_problems`, `load_parquet_problems`); the recipe's `data` section (`DataConfig`)
says which, and `problem_source` builds them. Beside the standard library and the recipe loader
(`megatron_rl.config`) the package imports Hugging Face datasets (parquet) and math-verify (the
`math` verifier), each only where it is used.
"""

from megatron_rl.rewards.arithmetic import ArithmeticTask, Problem, solve
from megatron_rl.rewards.config import DataConfig, problem_source
from megatron_rl.rewards.datasets import DatasetError, load_jsonl_problems, load_parquet_problems
from megatron_rl.rewards.source import ProblemSource
from megatron_rl.rewards.verifiers import (
    RewardScores,
    Verifier,
    extract_final_answer,
    get_verifier,
    normalize_answer,
    register_verifier,
    score_responses,
    verifier_names,
)

__all__ = [
    "ArithmeticTask",
    "DataConfig",
    "DatasetError",
    "Problem",
    "ProblemSource",
    "RewardScores",
    "Verifier",
    "extract_final_answer",
    "get_verifier",
    "load_jsonl_problems",
    "load_parquet_problems",
    "normalize_answer",
    "problem_source",
    "register_verifier",
    "score_responses",
    "solve",
    "verifier_names",
]
