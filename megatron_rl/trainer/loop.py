"""The RL loop: rollout -> rewards -> advantages -> old log-probs -> minibatch updates -> weight
sync -> metrics -> checkpoint. `train(recipe)` runs it on every rank of the job.

Rank 0 owns the rollout engine, the verifiers' scoring worker processes and the metric sinks;
the samples go to every rank, which takes its data-parallel share. With rollout.max_staleness > 0
the rollouts of later steps are generated while the trainer trains
(megatron_rl.trainer.rollout_queue). Each step's randomness (the prompts, the engine's sampling,
the minibatch order) is derived from `run.seed` and the step number alone, so a resumed run
repeats exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megatron_rl.checkpoint.convert import export_hf
from megatron_rl.files.hf_checkpoint import read_config
from megatron_rl.parallel.collectives import any_rank, from_rank0
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, shutdown_distributed
from megatron_rl.process.stop import StopSignals
from megatron_rl.rewards import (
    Problem,
    ProblemSource,
    ScoringPool,
    Verifier,
    get_verifier,
    open_scoring_pool,
    problem_source,
)
from megatron_rl.rollout.backends import open_engine
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.evaluate import held_out_accuracy
from megatron_rl.trainer.batches import RolloutBatch
from megatron_rl.trainer.checkpoints import (
    load_checkpoint,
    load_rollouts_ahead,
    resume_point,
    save_checkpoint,
)
from megatron_rl.trainer.learner import learn
from megatron_rl.trainer.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    MetricsSink,
    StepTimer,
    WandbSink,
)
from megatron_rl.trainer.policy import Policy
from megatron_rl.trainer.rank0_engine import Rank0Engine
from megatron_rl.trainer.recipe import Recipe
from megatron_rl.trainer.reference import ReferencePolicy
from megatron_rl.trainer.rollout_queue import RolloutQueue
from megatron_rl.trainer.rollout_step import rollout_step
from megatron_rl.trainer.weight_sync import sync_weights


class TrainingAborted(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps)."""


class RunStopped(Exception):
    """A signal asked the run to stop after its step; the step's checkpoint is saved."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped after step {step}; its checkpoint is {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


def train(
    recipe: Recipe, *, resume: bool = False, stop: StopSignals | None = None
) -> dict[str, float]:
    """Run `recipe` to its last step; returns the last step's metrics (on rank 0). With `stop`
    (every rank's), a graceful stop signal ends the run after a step and its checkpoint
    (RunStopped, which rank 0 reports on stderr)."""
    launch = LaunchEnv.from_environ()
    dims = ParallelDims.of(recipe.parallel, launch.world_size)
    timeout = timedelta(seconds=recipe.run.collective_timeout_s)
    init_distributed(dims, launch, seed=recipe.run.seed, timeout=timeout)
    try:
        with ExitStack() as stack:  # the scoring workers, the engine's servers and resources
            return Trainer.build(recipe, dims, stack, resume=resume, stop=stop).run()
    except RunStopped as stopped:
        if dist.get_rank() == 0:
            print(f"megatron-rl: {stopped}; continue it with --resume", file=sys.stderr, flush=True)
        # The ranks leave together, rank 0 done unwinding and reporting: torchrun ends the
        # others as soon as one exits.
        dist.barrier()
        raise
    finally:
        shutdown_distributed()


class Trainer:
    """One run on this rank: what `build` makes, then `step` after `step` (`run`)."""

    def __init__(
        self,
        recipe: Recipe,
        policy: Policy,
        engine: Rank0Engine,
        codec: PromptCodec,
        problems: ProblemSource,
        verifier: Verifier,
        scoring: ScoringPool | None = None,
        stop: StopSignals | None = None,
        reference: ReferencePolicy | None = None,
    ) -> None:
        self.recipe, self.policy, self.engine = recipe, policy, engine
        self.reference = reference
        self.codec, self.problems, self.verifier = codec, problems, verifier
        self.scoring = scoring  # rank 0's; None elsewhere
        self.stop = stop
        self.loss_spec = recipe.algo.loss_spec(max_response_len=recipe.rollout.max_new_tokens)
        self.run_dir = Path(recipe.run.dir)
        self.probe = _probe_sequence(codec, problems.eval_problems[0])
        self.start, self.bad_steps, self.syncs = 0, 0, 0
        self.rollouts = RolloutQueue(
            engine,
            self._generate_rollouts,
            max_staleness=recipe.rollout.max_staleness,
        )

    @classmethod
    def build(
        cls,
        recipe: Recipe,
        dims: ParallelDims,
        stack: ExitStack,
        *,
        resume: bool,
        stop: StopSignals | None = None,
    ) -> Trainer:
        """The policy, the engine serving the policy's weights and the scoring workers (their
        processes and resources released when `stack` closes), and the data; from the newest
        checkpoint with `resume`."""
        hf_path, run_dir = recipe.model.hf_path, Path(recipe.run.dir)
        found = from_rank0(lambda: resume_point(run_dir, resume=resume))
        codec = PromptCodec(
            hf_path,
            max_prompt_tokens=_max_prompt_tokens(recipe),
            chat_template=recipe.data.chat_template,
            trust_remote_code=recipe.model.trust_remote_code,
        )
        problems = problem_source(
            recipe.data, per_step=recipe.rollout.prompts_per_step, seed=recipe.run.seed
        )
        verifier = get_verifier(recipe.data.verifier)
        for problem in (*problems.train, *problems.eval_problems):  # a bad prompt fails now
            codec.encode_prompt(problem.prompt, origin=problem.origin)
        policy = Policy(recipe.model, dims, recipe.optim)
        # The starting weights, frozen: on resume too, model.hf_path is where the run started.
        reference = None
        if recipe.algo.kl_coef > 0:
            reference = ReferencePolicy(recipe.model, dims, offload=recipe.algo.ref_offload)
        engine, scoring = None, None
        if dist.get_rank() == 0:
            # Opened before the engine: the workers start while it loads, and the pool closes
            # after the background rollout work that scores in it has stopped.
            scoring = stack.enter_context(open_scoring_pool(recipe.data))
            engine = open_engine(
                recipe.rollout,
                hf_path,
                run_dir,
                stack,
                routing_shape=(policy.config.num_layers, policy.config.router_topk),
                routed_experts=recipe.engine_returns_routing,
                seed=recipe.run.seed,
            )
        rank0_engine = Rank0Engine(engine, partial_rollouts=recipe.rollout.partial_rollouts)
        stack.callback(rank0_engine.close)  # before the engine's own resources are released
        trainer = cls(
            recipe, policy, rank0_engine, codec, problems, verifier, scoring, stop, reference
        )
        if found is not None:
            trainer.start, state = load_checkpoint(found, policy)
            trainer.bad_steps = state["bad_steps"]
            trainer.rollouts.restore(
                found, state.get("max_staleness", 0), lambda: load_rollouts_ahead(found)
            )
        trainer.sync(trainer.start)
        return trainer

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def run(self) -> dict[str, float]:
        """Every step from the start (or the resumed checkpoint) to `run.steps`, logged, checked
        and checkpointed; then the export. Returns the last step's metrics."""
        recipe, metrics = self.recipe, {}
        with MetricsLogger(self._metric_sinks() if dist.get_rank() == 0 else []) as logger:
            if self.start == 0:
                logger.log(0, self.evaluate())
            if self.start < recipe.run.steps:
                self.rollouts.generate_ahead(self.start)
            for step in range(self.start + 1, recipe.run.steps + 1):
                metrics = self.step(step)
                logger.log(step, metrics)
                self._count_bad_steps(step, metrics)
                saved = self._save_if_due(step)
                self._stop_if_asked(step, saved)
                if step < recipe.run.steps:
                    self.rollouts.generate_ahead(step)
        if recipe.checkpoint.export_hf:
            self._export()
        return metrics

    def step(self, step: int) -> dict[str, float]:
        """RL step `step` (from 1): the picture of the module docstring; returns its metrics."""
        recipe, timer = self.recipe, StepTimer()
        with timer.phase("rollout"):  # lock-step: the generation; else the wait for it
            rollouts = self.rollouts.take(step)
        batch, metrics = rollouts.batch, dict(rollouts.metrics)
        metrics |= learn(
            self.policy,
            batch,
            self.loss_spec,
            recipe.algo,
            micro_batch_size=recipe.run.micro_batch_size,
            micro_batch_tokens=recipe.run.micro_batch_tokens,
            packed=recipe.run.packed_sequences,
            timer=timer,
            seed=recipe.run.seed + step,
            reference=self.reference,
            probe_routing=recipe.metrics.routing_probe,
        )
        with timer.phase("weight_sync"):
            metrics |= self.sync(step)
        if step % recipe.run.eval_every == 0 or step == recipe.run.steps:
            with timer.phase("eval"):
                metrics |= self.evaluate()
        return metrics | timer.metrics(0 if batch is None else int(batch.loss_mask.sum()))

    def _generate_rollouts(
        self, engine: RolloutEngine, step: int
    ) -> tuple[RolloutBatch | None, dict[str, float]]:
        recipe = self.recipe
        return rollout_step(
            engine,
            self.codec,
            self.problems,
            step,
            self.verifier,
            rollout=recipe.rollout,
            algo=recipe.algo,
            seed=recipe.run.seed * 1_000_003 + step,
            scoring=self.scoring,
            return_routed_experts=recipe.engine_returns_routing,
        )

    def sync(self, version: int) -> dict[str, float]:
        """The policy's weights into the engine as `version`, checked by the probe as the recipe
        says; its metrics."""
        metrics = sync_weights(
            self.policy,
            self.engine,
            version=version,
            probe=self.probe,
            rollout=self.recipe.rollout,
            sync_count=self.syncs,
        )
        self.syncs += 1
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: one greedy response per evaluation problem, scored."""
        recipe = self.recipe
        accuracy = self.engine.run(
            lambda engine: held_out_accuracy(
                engine,
                self.codec,
                self.problems.eval_problems,
                self.verifier,
                max_new_tokens=recipe.rollout.max_new_tokens,
                scoring=self.scoring,
            )
        )
        return {"eval/accuracy": accuracy}

    def _save_if_due(self, step: int) -> Path | None:
        """The checkpoint of `step` when one is due, saved; else None."""
        checkpoint, last = self.recipe.checkpoint, self.recipe.run.steps
        if step == last and checkpoint.save_last:
            return self._save(step)
        if checkpoint.save_every > 0 and step % checkpoint.save_every == 0:
            return self._save(step)
        return None

    def _save(self, step: int) -> Path:
        state = {"bad_steps": self.bad_steps, "max_staleness": self.rollouts.max_staleness}
        return save_checkpoint(
            self.checkpoint_dir,
            step,
            self.policy,
            state,
            keep=self.recipe.checkpoint.keep,
            rollouts_ahead=self.rollouts.ahead(),
        )

    def _stop_if_asked(self, step: int, saved: Path | None) -> None:
        """Stop now if a stop signal came: an immediate one that was lost on the way
        (StopSignals), or a graceful one on any rank, after the step's checkpoint (unless this
        was the last step: the run then ends as it would have)."""
        if self.stop is None:
            return
        self.stop.raise_if_stopping()
        if any_rank(self.stop.graceful_requested) and step < self.recipe.run.steps:
            raise RunStopped(step, saved or self._save(step))

    def _export(self) -> None:
        """The final policy as a Hugging Face checkpoint in RUN_DIR/export."""
        policy, assets = self.policy, Path(self.recipe.model.hf_path)
        module, out = policy.model.module, self.run_dir / "export"
        export_hf(module, policy.family, policy.config, assets, out, overwrite=True)

    def _count_bad_steps(self, step: int, metrics: dict[str, float]) -> None:
        """A step with a skipped (non-finite) update says so on the console; `run.max_bad_steps`
        such steps in a row stop the run."""
        self.bad_steps = self.bad_steps + 1 if metrics["steps/skipped"] else 0
        limit = self.recipe.run.max_bad_steps
        if self.bad_steps and dist.get_rank() == 0:
            print(
                f"megatron-rl: step {step}: {metrics['steps/skipped_updates']:.0f} of "
                f"{metrics['steps/updates']:.0f} updates skipped, the weights left as they were "
                f"(non-finite loss in {metrics['steps/nonfinite_loss_updates']:.0f}, gradient "
                f"norm in {metrics['steps/nonfinite_grad_norm_updates']:.0f}; loss/policy "
                f"{metrics['loss/policy']}, grad_norm {metrics['grad_norm']}); {self.bad_steps} "
                f"such step(s) in a row, the run stops at run.max_bad_steps={limit}",
                file=sys.stderr,
                flush=True,
            )
        if self.bad_steps >= limit:
            raise TrainingAborted(
                f"step {step}: {self.bad_steps} consecutive steps with a non-finite loss "
                f"or gradient (run.max_bad_steps={limit}); the last good "
                f"checkpoint is in {self.checkpoint_dir}"
            )

    def _metric_sinks(self) -> list[MetricsSink]:
        recipe, config = self.recipe, self.recipe.metrics
        sinks: list[MetricsSink] = []
        if config.jsonl:
            # A fresh run starts the file afresh; a resumed one keeps the steps it resumes after.
            resume_step = self.start if self.start else -1
            sinks.append(JsonlSink(self.run_dir / "metrics.jsonl", resume_step=resume_step))
        if config.console:
            keys = ("reward/mean", "eval/accuracy", "loss/policy", "clip_frac/seq")
            sinks.append(ConsoleSink(recipe.run.steps, keys, start_step=self.start))
        if config.wandb != "disabled":
            sinks.append(
                WandbSink(
                    config.wandb_project,
                    recipe.run.name,
                    self.run_dir,
                    asdict(recipe),
                    mode=config.wandb,
                    resume_id=recipe.run.name if self.start else None,
                )
            )
        return sinks


def _max_prompt_tokens(recipe: Recipe) -> int:
    config = read_config(Path(recipe.model.hf_path), given_as="model.hf_path")
    context = config.get("max_position_embeddings", 4096)
    return context - recipe.rollout.max_new_tokens


def _probe_sequence(codec: PromptCodec, problem: Problem) -> list[int]:
    """The weight-sync probe: a held-out prompt and its ideal response (or reference answer),
    as token ids."""
    response = problem.solution or problem.reference
    ids = codec.encode_prompt(problem.prompt, origin=problem.origin) + codec.tokenizer.encode(
        response, add_special_tokens=False
    )
    return ids[: codec.max_prompt_tokens]
