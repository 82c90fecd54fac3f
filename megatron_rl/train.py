"""The RL loop: rollout -> rewards -> advantages -> old log-probs -> minibatch updates -> weight
sync -> metrics -> checkpoint. `train(recipe)` runs it on every rank of the job.

Rank 0 owns the rollout engine, the verifiers and the metric sinks; the samples are broadcast
to every rank, which takes its data-parallel share. Each step's randomness (the prompts, the
engine's sampling, the minibatch order) is derived from `run.seed` and the step number alone,
so a resumed run repeats exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from megatron_rl.algo import get_policy_loss
from megatron_rl.checkpoint.convert import export_hf
from megatron_rl.checkpoint.hf_files import read_config
from megatron_rl.checkpoint.train_state import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.config import Recipe
from megatron_rl.learner import LearnSettings, learn
from megatron_rl.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    MetricsSink,
    StepTimer,
    WandbSink,
)
from megatron_rl.models.policy import OptimizerSettings, Policy
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, shutdown_distributed
from megatron_rl.parallel.schedule import PolicyLossSpec
from megatron_rl.rewards import (
    ArithmeticTask,
    Problem,
    ProblemSource,
    Verifier,
    get_verifier,
    load_jsonl_problems,
)
from megatron_rl.rollout.backends import open_engine
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_rl.rollout.evaluate import held_out_accuracy
from megatron_rl.rollout.step import RolloutSettings, rollout_step
from megatron_rl.rollout.sync import SyncSettings, sync_weights


class TrainingAborted(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps)."""


def train(recipe: Recipe, *, resume: bool = False) -> dict[str, float]:
    """Run `recipe` to its last step; returns the last step's metrics (on rank 0)."""
    launch = LaunchEnv.from_environ()
    par = recipe.parallel
    dims = ParallelDims(
        world_size=launch.world_size, tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp, etp=par.etp
    )
    init_distributed(dims, launch, seed=recipe.run.seed)
    try:
        return _train(recipe, dims, resume=resume)
    finally:
        shutdown_distributed()


def _train(recipe: Recipe, dims: ParallelDims, *, resume: bool) -> dict[str, float]:
    with ExitStack() as stack:  # the rollout engine's servers and resources
        return _train_loop(recipe, dims, stack, resume=resume)


def _train_loop(
    recipe: Recipe, dims: ParallelDims, stack: ExitStack, *, resume: bool
) -> dict[str, float]:
    run, rollout = recipe.run, recipe.rollout
    run_dir, rank0 = Path(run.dir), dist.get_rank() == 0
    codec = PromptCodec(recipe.model.hf_path, max_prompt_tokens=_max_prompt_tokens(recipe))
    problems = _problem_source(recipe)
    verifier = get_verifier(recipe.data.verifier)
    spec = _loss_spec(recipe)
    policy = Policy(
        recipe.model.hf_path,
        dims,
        _optimizer_settings(recipe),
        dispatcher=recipe.model.dispatcher,
        recompute=recipe.model.recompute,
    )
    engine = None
    if rank0:
        engine = open_engine(
            rollout,
            recipe.model.hf_path,
            run_dir,
            stack,
            routing_shape=(policy.config.num_layers, policy.config.router_topk),
            routed_experts=recipe.algo.routing_replay == "r3",
        )
    params = SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=codec.stop_token_ids,
    )
    rollout_settings, learn_settings = _step_settings(recipe)
    sync_settings = SyncSettings(
        bucket_bytes=rollout.sync_bucket_mb * 2**20,
        probe_every=rollout.probe_every,
        probe_tolerance=rollout.probe_tolerance,
    )
    probe = _probe_sequence(codec, problems.eval_problems[0])
    syncs = 0

    def sync(version: int) -> dict[str, float]:
        nonlocal syncs
        metrics = sync_weights(
            policy, engine, version=version, probe=probe, settings=sync_settings, sync_count=syncs
        )
        syncs += 1
        return metrics

    start, state = 0, {"bad_steps": 0}
    checkpoint_dir = run_dir / "checkpoints"
    found = latest_checkpoint(checkpoint_dir)
    if found is not None and not resume:
        raise ValueError(
            f"run.dir {run_dir}: holds checkpoints of an earlier run ({found.name}); pass "
            "--resume to continue it, or choose another run.dir"
        )
    if found is not None:
        start, state = load_checkpoint(found, policy)
    sync(start)
    evaluate = _evaluator(engine, codec, problems.eval_problems, verifier, recipe)
    metrics: dict[str, float] = {}
    with MetricsLogger(_metric_sinks(recipe, start) if rank0 else []) as logger:
        if start == 0:
            logger.log(0, evaluate())
        for step in range(start + 1, run.steps + 1):
            timer = StepTimer()
            with timer.phase("rollout"):
                batch, metrics = rollout_step(
                    engine,
                    codec,
                    problems.train_batch(step),
                    verifier,
                    params,
                    rollout_settings,
                    seed=run.seed * 1_000_003 + step,
                )
            metrics |= learn(policy, batch, spec, learn_settings, timer, seed=run.seed + step)
            with timer.phase("weight_sync"):
                metrics |= sync(step)
            if step % run.eval_every == 0 or step == run.steps:
                with timer.phase("eval"):
                    metrics |= evaluate()
            metrics |= timer.metrics(0 if batch is None else int(batch.loss_mask.sum()))
            logger.log(step, metrics)
            state["bad_steps"] = state["bad_steps"] + 1 if metrics["steps/skipped"] else 0
            if state["bad_steps"] >= run.max_bad_steps:
                raise TrainingAborted(
                    f"step {step}: {state['bad_steps']} consecutive steps with a non-finite loss "
                    f"or gradient (run.max_bad_steps={run.max_bad_steps}); the last good "
                    f"checkpoint is in {checkpoint_dir}"
                )
            if _should_save(recipe, step):
                save_checkpoint(checkpoint_dir, step, policy, state, keep=recipe.checkpoint.keep)
    if recipe.checkpoint.export_hf:
        export_hf(
            policy.model.module,
            policy.family,
            policy.config,
            Path(recipe.model.hf_path),
            run_dir / "export",
            overwrite=True,
        )
    return metrics


def _max_prompt_tokens(recipe: Recipe) -> int:
    context = read_config(Path(recipe.model.hf_path)).get("max_position_embeddings", 4096)
    return context - recipe.rollout.max_new_tokens


def _step_settings(recipe: Recipe) -> tuple[RolloutSettings, LearnSettings]:
    algo = recipe.algo
    rollout = RolloutSettings(
        group_size=recipe.rollout.group_size,
        std_normalize=algo.std_normalize,
        drop_zero_variance_groups=algo.drop_zero_variance_groups,
        reward_timeout_s=recipe.data.reward_timeout_s,
        routed_experts=algo.routing_replay == "r3",
    )
    learn_settings = LearnSettings(
        updates_per_batch=algo.updates_per_batch,
        micro_batch_size=recipe.run.micro_batch_size,
        routing_replay=algo.routing_replay,
        use_engine_logprobs=algo.use_engine_logprobs,
    )
    return rollout, learn_settings


def _optimizer_settings(recipe: Recipe) -> OptimizerSettings:
    optim = recipe.optim
    return OptimizerSettings(
        lr=optim.lr,
        warmup_steps=optim.warmup_steps,
        weight_decay=optim.weight_decay,
        clip_grad=optim.clip_grad,
        adam_betas=(optim.adam_beta1, optim.adam_beta2),
        adam_eps=optim.adam_eps,
        distributed=optim.distributed_optimizer,
    )


def _problem_source(recipe: Recipe) -> ProblemSource:
    data, run = recipe.data, recipe.run
    if data.source == "jsonl":
        train, held_out = load_jsonl_problems(data.train_path), load_jsonl_problems(data.eval_path)
    else:
        task = ArithmeticTask(
            min_operands=data.min_operands,
            max_operands=data.max_operands,
            max_operand=data.max_operand,
        )
        train = task.problems("train", 20_000, seed=run.seed)
        # One fixed held-out set (seed 0), so runs with different seeds are compared on it.
        held_out = task.problems("eval", data.eval_problems, seed=0)
    return ProblemSource(
        train,
        held_out[: data.eval_problems],
        per_step=recipe.rollout.prompts_per_step,
        seed=run.seed,
    )


def _loss_spec(recipe: Recipe) -> PolicyLossSpec:
    algo = recipe.algo
    default_low, default_high = get_policy_loss(algo.loss).default_clip
    dr_grpo = algo.loss_agg == "seq-mean-token-sum-norm"
    return PolicyLossSpec(
        name=algo.loss,
        clip_low=default_low if algo.clip_low is None else algo.clip_low,
        clip_high=default_high if algo.clip_high is None else algo.clip_high,
        options={
            "loss_agg": algo.loss_agg,
            # Non-finite values must reach the loss, where the step is skipped and counted.
            "check_finite": False,
        }
        # Dr. GRPO's constant normaliser: the longest response the engine may return.
        | ({"max_response_len": recipe.rollout.max_new_tokens} if dr_grpo else {}),
    )


def _metric_sinks(recipe: Recipe, start: int) -> list[MetricsSink]:
    config, run_dir = recipe.metrics, Path(recipe.run.dir)
    sinks: list[MetricsSink] = []
    if config.jsonl:
        # A fresh run starts the file afresh; a resumed one keeps the steps it resumes after.
        sinks.append(JsonlSink(run_dir / "metrics.jsonl", resume_step=start if start else -1))
    if config.console:
        keys = ("reward/mean", "eval/accuracy", "loss/policy", "clip_frac/seq")
        sinks.append(ConsoleSink(recipe.run.steps, keys, start_step=start))
    if config.wandb != "disabled":
        sinks.append(
            WandbSink(
                config.wandb_project,
                recipe.run.name,
                run_dir,
                asdict(recipe),
                mode=config.wandb,
                resume_id=recipe.run.name if start else None,
            )
        )
    return sinks


def _probe_sequence(codec: PromptCodec, problem: Problem) -> list[int]:
    """The weight-sync probe: a held-out prompt and its ideal response (or reference answer),
    as token ids."""
    response = problem.solution or problem.reference
    ids = codec.encode_prompt(problem.prompt) + codec.tokenizer.encode(
        response, add_special_tokens=False
    )
    return ids[: codec.max_prompt_tokens]


def _evaluator(
    engine: RolloutEngine | None,
    codec: PromptCodec,
    problems: list[Problem],
    verifier: Verifier,
    recipe: Recipe,
):
    def evaluate() -> dict[str, float]:
        if engine is None:
            return {}
        accuracy = held_out_accuracy(
            engine,
            codec,
            problems,
            verifier,
            max_new_tokens=recipe.rollout.max_new_tokens,
            timeout_s=recipe.data.reward_timeout_s,
        )
        return {"eval/accuracy": accuracy}

    return evaluate


def _should_save(recipe: Recipe, step: int) -> bool:
    every = recipe.checkpoint.save_every
    return step == recipe.run.steps or (every > 0 and step % every == 0)
