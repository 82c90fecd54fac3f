"""Rewards for RL post-training: verifiers that score responses, and the problems they score.

A verifier maps `(prompt, response, reference)` to a float reward and is registered by name
(`math`, `arithmetic`); `score_responses` scores a batch so that a verifier that raises, hangs or
crashes costs one sample a zero reward, never the training step: in a `ScoringPool`, each call
runs in a worker process that is killed at its deadline. Problems come from the built-in
multi-step arithmetic task (`ArithmeticTask`) or from users' JSON Lines or parquet files
(`load_jsonl_problems`, `load_parquet_problems`); the recipe's `data` section (`DataConfig`)
says which, `problem_source` builds them and `open_scoring_pool` the pool it asks for. Beside
the standard library and the recipe loader (`megatron_rl.config`) the package imports Hugging
Face datasets (parquet) and math-verify (the `math` verifier), each only where it is used.
"""

from megatron_rl.rewards.arithmetic import ArithmeticTask, Problem, solve
from megatron_rl.rewards.config import DataConfig, open_scoring_pool, problem_source
from megatron_rl.rewards.datasets import DatasetError, load_jsonl_problems, load_parquet_problems
from megatron_rl.rewards.scoring import RewardScores, score_responses
from megatron_rl.rewards.scoring_pool import ScoringPool
from megatron_rl.rewards.source import ProblemSource
from megatron_rl.rewards.verifiers import (
    Verifier,
    extract_final_answer,
    get_verifier,
    normalize_answer,
    register_verifier,
    verifier_names,
)

__all__ = [
    "ArithmeticTask",
    "DataConfig",
    "DatasetError",
    "Problem",
    "ProblemSource",
    "RewardScores",
    "ScoringPool",
    "Verifier",
    "extract_final_answer",
    "get_verifier",
    "load_jsonl_problems",
    "load_parquet_problems",
    "normalize_answer",
    "open_scoring_pool",
    "problem_source",
    "register_verifier",
    "score_responses",
    "solve",
    "verifier_names",
]
