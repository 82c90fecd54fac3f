"""The RL loop: rollout -> rewards -> advantages -> old log-probs -> minibatch updates -> weight
sync -> metrics -> checkpoint. `train(recipe)` runs it on every rank of the job.

Rank 0 owns the rollout engine, the verifiers and the metric sinks; the samples are broadcast
to every rank, which takes its data-parallel share. Each step's randomness (the prompts, the
engine's sampling, the minibatch order) is derived from `run.seed` and the step number alone,
so a resumed run repeats exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.algo import get_policy_loss, group_advantages
from megatron_rl.checkpoint.convert import export_hf
from megatron_rl.checkpoint.train_state import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.config import Recipe
from megatron_rl.metrics import ConsoleSink, JsonlSink, MetricsLogger, MetricsSink, WandbSink
from megatron_rl.models.policy import OptimizerSettings, Policy
from megatron_rl.moe.drift import routing_bytes
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
from megatron_rl.rollout.batch import (
    EngineRouting,
    RolloutBatch,
    build_rollout_batch,
    micro_batches,
    minibatch_rows,
)
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.collect import collect_rollouts
from megatron_rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_rl.rollout.evaluate import held_out_accuracy
from megatron_rl.rollout.local import LocalEngine


class TrainingAborted(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps)."""


def train(recipe: Recipe, *, resume: bool = False) -> dict[str, float]:
    """Run `recipe` to its last step; returns the last step's metrics (on rank 0)."""
    launch = LaunchEnv.from_environ()
    par = recipe.parallel
    dims = ParallelDims(world_size=launch.world_size, tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp)
    init_distributed(dims, launch, seed=recipe.run.seed)
    try:
        return _train(recipe, dims, resume=resume)
    finally:
        shutdown_distributed()


def _train(recipe: Recipe, dims: ParallelDims, *, resume: bool) -> dict[str, float]:
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
        engine = LocalEngine.from_pretrained(
            recipe.model.hf_path, max_batch_size=rollout.max_batch_size
        )
    params = SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=codec.stop_token_ids,
    )
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
    _sync_weights(policy, engine, version=start)
    evaluate = _evaluator(engine, codec, problems.eval_problems, verifier, recipe)
    metrics: dict[str, float] = {}
    with MetricsLogger(_metric_sinks(recipe, start) if rank0 else []) as logger:
        if start == 0:
            logger.log(0, evaluate())
        for step in range(start + 1, run.steps + 1):
            started = time.perf_counter()
            timings: dict[str, float] = {}

            with _timed(timings, "rollout"):
                batch, metrics = _rollout_batch(
                    engine, codec, problems.train_batch(step), verifier, params, recipe, step
                )
            metrics |= _learn(policy, batch, spec, recipe, step, timings)
            with _timed(timings, "weight_sync"):
                _sync_weights(policy, engine, version=step)
            if step % run.eval_every == 0 or step == run.steps:
                with _timed(timings, "eval"):
                    metrics |= evaluate()
            metrics |= _time_metrics(timings, batch, time.perf_counter() - started)
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
    from megatron_rl.checkpoint.hf_files import read_config

    context = read_config(Path(recipe.model.hf_path)).get("max_position_embeddings", 4096)
    return context - recipe.rollout.max_new_tokens


def _optimizer_settings(recipe: Recipe) -> OptimizerSettings:
    optim = recipe.optim
    return OptimizerSettings(
        lr=optim.lr,
        warmup_steps=optim.warmup_steps,
        weight_decay=optim.weight_decay,
        clip_grad=optim.clip_grad,
        adam_betas=(optim.adam_beta1, optim.adam_beta2),
        adam_eps=optim.adam_eps,
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


def _rollout_batch(
    engine: RolloutEngine | None,
    codec: PromptCodec,
    problems: list[Problem],
    verifier: Verifier,
    params: SamplingParams,
    recipe: Recipe,
    step: int,
) -> tuple[RolloutBatch | None, dict[str, float]]:
    """Rank 0 samples and scores; every rank gets the batch (None when nothing is left to
    train on) and the rollout metrics."""
    payload: list = [None, None]
    if engine is not None:
        rollouts = collect_rollouts(
            engine,
            codec,
            problems,
            verifier,
            params,
            group_size=recipe.rollout.group_size,
            seed=recipe.run.seed * 1_000_003 + step,
            reward_timeout_s=recipe.data.reward_timeout_s,
            return_routed_experts=recipe.algo.routing_replay == "r3",
        )
        groups = group_advantages(
            rollouts.rewards, recipe.rollout.group_size, std_normalize=recipe.algo.std_normalize
        )
        keep = torch.ones_like(groups.zero_variance)
        if recipe.algo.drop_zero_variance_groups:
            keep = ~groups.zero_variance
        metrics = rollouts.metrics | {
            "groups/zero_variance": float(groups.num_zero_variance_groups),
            "groups/zero_variance_frac": float(groups.num_zero_variance_groups) / len(problems),
        }
        rows = keep.nonzero()[:, 0].tolist()
        batch = None
        if rows:
            batch = build_rollout_batch(
                [rollouts.samples[row] for row in rows],
                groups.advantages[rows],
                pad_id=codec.tokenizer.pad_token_id or 0,
                newline_token_ids=codec.newline_token_ids,
            )
        payload = [batch, metrics]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    return payload[0], payload[1]


def _learn(
    policy: Policy,
    batch: RolloutBatch | None,
    spec: PolicyLossSpec,
    recipe: Recipe,
    step: int,
    timings: dict[str, float],
) -> dict[str, float]:
    """Old log-probs, then `algo.updates_per_batch` optimizer steps on minibatches of `batch`."""
    algo = recipe.algo
    if batch is None:  # every group had equal rewards and was dropped
        return {"steps/skipped": 0.0, "steps/no_data": 1.0}
    rows = minibatch_rows(batch.num_rows, algo.updates_per_batch, seed=recipe.run.seed + step)
    engine_routing = _engine_routing(policy) if algo.routing_replay == "r3" else None
    minibatches = [
        micro_batches(
            batch,
            chunk,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            micro_batch_size=recipe.run.micro_batch_size,
            engine_routing=engine_routing,
        )
        for chunk in rows
    ]
    every_micro_batch = [micro for minibatch in minibatches for micro in minibatch]
    metrics: dict[str, float] = {}
    with _timed(timings, "old_logprob"):
        needs_forward = not algo.use_engine_logprobs or spec.name == "sspo"
        if needs_forward:
            engine_logp = [micro.old_logp for micro in every_micro_batch]
            # R3 replays the engine's routing; otherwise the old routing is recorded (R2 replays
            # it, and it is what the drift metrics compare the updated routers with).
            routing = "replay" if algo.routing_replay == "r3" else "record"
            policy.old_logprobs(every_micro_batch, routing=routing)
            metrics |= _old_policy_metrics(every_micro_batch, engine_logp)
            records = [layer for micro in every_micro_batch for layer in micro.routing or []]
            metrics["routing/record_bytes"] = float(routing_bytes(records))
            if algo.use_engine_logprobs:
                for micro, logp in zip(every_micro_batch, engine_logp, strict=True):
                    micro.old_logp = logp
    with _timed(timings, "train"):
        updates = [
            policy.update(minibatch, spec, replay=algo.routing_replay != "none")
            for minibatch in minibatches
        ]
    good = [u for u in updates if not u.skipped]
    metrics |= {
        "loss/policy": _mean([u.loss for u in good]),
        "grad_norm": _mean([u.grad_norm for u in good]),
        "optim/lr": policy.learning_rate,
        "steps/skipped": float(len(good) < len(updates)),
        "steps/skipped_updates": float(len(updates) - len(good)),
    }
    for key in sorted({k for u in good for k in u.metrics}):
        values = [u.metrics[key] for u in good if key in u.metrics]
        metrics[key] = (
            max(values)
            if key.endswith("max")
            else (min(values) if key.endswith("min") else _mean(values))
        )
    return metrics


def _old_policy_metrics(micro_batches_: list, engine_logp: list) -> dict[str, float]:
    """Entropy of the old policy and the engine/trainer mismatch (k3 KL(engine || trainer)),
    over response tokens (this rank's share; equal shares make it representative)."""
    masks = torch.cat([m.loss_mask.flatten() for m in micro_batches_])
    if masks.sum() == 0 or micro_batches_[0].old_entropy is None:
        return {}
    entropy = torch.cat([m.old_entropy.flatten() for m in micro_batches_])[masks]
    trainer = torch.cat([m.old_logp.flatten() for m in micro_batches_])[masks].double()
    engine = torch.cat([e.flatten() for e in engine_logp])[masks].double()
    delta = trainer - engine
    return {
        "entropy/mean": float(entropy.mean()),
        "mismatch/k3": float((torch.expm1(delta) - delta).mean()),
        "mismatch/abs_max": float(delta.abs().max()),
    }


def _engine_routing(policy: Policy) -> EngineRouting:
    config = policy.config
    replay = policy.replay
    first = parallel_state.get_pipeline_model_parallel_rank() * replay.num_layers
    sequence_parallel = policy.model.config.sequence_parallel
    return EngineRouting(
        num_layers=config.num_layers,
        topk=config.router_topk,
        layers=range(first, first + replay.num_layers),
        sp_rank=parallel_state.get_tensor_model_parallel_rank() if sequence_parallel else 0,
        sp_size=parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1,
    )


def _sync_weights(policy: Policy, engine: RolloutEngine | None, *, version: int) -> None:
    """Stream the policy's weights into the engine on rank 0 (every rank takes part)."""
    stream = policy.weight_stream()
    if engine is not None:
        engine.update_weights(stream, version)
    else:
        for _ in stream:
            pass


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


class _timed:
    """Adds the seconds spent in the block to `timings[name]`."""

    def __init__(self, timings: dict[str, float], name: str) -> None:
        self.timings, self.name = timings, name

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.started
        self.timings[self.name] = self.timings.get(self.name, 0.0) + elapsed


def _time_metrics(
    timings: dict[str, float], batch: RolloutBatch | None, seconds: float
) -> dict[str, float]:
    tokens = 0 if batch is None else int(batch.loss_mask.sum())
    return {f"time/{name}_s": value for name, value in timings.items()} | {
        "time/step_s": seconds,
        "throughput/response_tokens_per_s": tokens / seconds,
    }


def _should_save(recipe: Recipe, step: int) -> bool:
    every = recipe.checkpoint.save_every
    return step == recipe.run.steps or (every > 0 and step % every == 0)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
