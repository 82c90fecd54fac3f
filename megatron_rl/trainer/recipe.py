"""A training recipe: every section of `megatron-rl train RECIPE`, and the trainer's own.

Each component defines the section it takes, with each option's default in that one place:
`model` (megatron_rl.models.config), `parallel` (megatron_rl.parallel.dims), `rollout` and
`rollout.sglang` (megatron_rl.rollout.config, megatron_rl.rollout.sglang.config), `optim`
(megatron_rl.trainer.optimizer_config), `data` (megatron_rl.rewards.config), `metrics`
(megatron_rl.trainer.metrics). The trainer's own, `algo`, `run` and `checkpoint`, are here.
`megatron_rl.config.load_config(Recipe, path, overrides)` reads one.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megatron_rl.algo import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    MISMATCH_CORRECTIONS,
    MismatchCorrection,
    PolicyLossSpec,
    get_policy_loss,
    policy_loss_names,
)
from megatron_rl.config import ConfigError, check_positive
from megatron_rl.models.config import ModelConfig
from megatron_rl.moe.replay_mode import RoutingReplayMode
from megatron_rl.parallel.dims import ParallelConfig
from megatron_rl.process.stop import GRACEFUL_CANDIDATES, signal_number
from megatron_rl.rewards.config import DataConfig
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.trainer.metrics import MetricsConfig
from megatron_rl.trainer.optimizer_config import OptimConfig


class OldLogProbs(enum.Enum):
    """Where an update's old log-probs, the denominator of its importance ratio, come from
    (`AlgoConfig.old_logprobs`, the one place that decides it)."""

    OLD_POLICY_FORWARD = "a forward of the weights before the step's updates"
    UPDATE_FORWARD = "the update's own forward, detached (one update per rollout batch)"
    ENGINE = "the rollout engine's (algo.mismatch=bypass)"


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """The policy-optimisation algorithm."""

    loss: str = "gspo"
    """Policy loss, one of megatron_rl.algo.policy_loss_names()."""
    clip_low: float | None = None
    """Lower clip half-width; None takes the loss's default (docs/algorithms.md)."""
    clip_high: float | None = None
    """Upper clip half-width; None takes the loss's default."""
    loss_agg: str = "seq-mean-token-mean"
    """How token objectives become the loss (docs/algorithms.md, Aggregation)."""
    routing_replay: RoutingReplayMode = RoutingReplayMode.NONE
    """none; r2: replay the old policy's routing; r3: replay the rollout engine's routing."""
    updates_per_batch: int = 4
    """Minibatch updates per rollout batch (the GSPO paper uses 4)."""
    mismatch: str = "none"
    """The rollout engine's log-probs against the trainer's: none (the trainer's old log-probs,
    no correction); bypass (the engine's log-probs are the old ones: no old-policy forward);
    tis, mis, icepop (the trainer's old log-probs, and each token's objective weighted by a
    correction of pi_old / pi_engine; docs/algorithms.md, Mismatch correction)."""
    mismatch_level: str | None = None
    """token, sequence or geometric; None: the correction's default (tis token, mis sequence;
    icepop is token-level only)."""
    mismatch_lower: float | None = None
    """mis, icepop: the lower end of the band of ratios kept (0 <= lower < 1); None: the
    correction's default (mis 0, icepop 0.5)."""
    mismatch_upper: float | None = None
    """tis: the cap C (>= 1); mis, icepop: the band's upper end (> 1); None: the correction's
    default (tis 2, mis 2, icepop 5)."""
    mismatch_mask_level: str | None = None
    """tis only: an mis band at this level (token, sequence or geometric) as a mask on the TIS
    weights: zero where its ratio leaves [mismatch_mask_lower, mismatch_mask_upper] (token TIS
    with a geometric band: the mismatch studies' recipe); None: no mask."""
    mismatch_mask_lower: float | None = None
    """The mask's band's lower end (0 <= lower < 1); None: mis's default, 0."""
    mismatch_mask_upper: float | None = None
    """The mask's band's upper end (> 1); None: mis's default, 2."""
    dual_clip: float | None = None
    """PPO dual-clip's c (> 1): for a negative advantage the objective is bounded by c * A;
    None: the loss's default (3 for every loss that has it; cispo has none); 0: off."""
    entropy_coef: float = 0.0
    """Entropy bonus: this times the current policy's token entropy, aggregated like the loss,
    is added to the objective (0: none)."""
    kl_coef: float = 0.0
    """KL penalty to the reference policy (the starting weights, kept frozen; built only when
    > 0): this times the aggregated per-token estimate is subtracted from the objective."""
    kl_estimator: str = "k3"
    """The per-token KL estimator: k1, k2 or k3 (docs/algorithms.md, KL penalty)."""
    ref_offload: bool = False
    """Keep the reference policy in host memory between its forwards (on a GPU: its weights'
    device memory saved, two host-device copies per step paid; on the CPU nothing changes)."""
    kl_in_reward: bool = False
    """Subtract kl_coef times each sample's summed per-token KL (old policy to reference) from
    its reward before the group advantages, instead of penalising the loss."""
    std_normalize: bool = True
    """Divide group advantages by the group's std (GRPO); false: Dr. GRPO's mean-centring only."""
    drop_zero_variance_groups: bool = False
    """Leave out groups whose rewards are all equal (they carry no gradient; always counted)."""
    overlong_filter: bool = False
    """DAPO's overlong filter: responses cut at rollout.max_new_tokens carry no loss (their
    rewards still count in their groups' advantages)."""

    RENAMED: ClassVar[dict[str, str]] = {
        "use_engine_logprobs": "the engine's log-probs as the old ones are algo.mismatch=bypass"
    }
    MISMATCH_MODES: ClassVar[tuple[str, ...]] = ("none", "bypass", *MISMATCH_CORRECTIONS)

    @property
    def old_logprobs(self) -> OldLogProbs:
        """Where the updates' old log-probs come from, decided here alone: the engine's under
        algo.mismatch=bypass; with one update per rollout batch the update's own forward
        (the old policy's weights are the ones the update starts from), except under R2 (the
        old-policy forward records the routing the update replays) or the KL in the reward
        (it needs them before the update); else a forward of the weights before the updates."""
        if self.mismatch == "bypass":
            return OldLogProbs.ENGINE
        if (
            self.updates_per_batch == 1
            and not self.routing_replay.needs_old_policy_forward
            and not self.kl_in_reward
        ):
            return OldLogProbs.UPDATE_FORWARD
        return OldLogProbs.OLD_POLICY_FORWARD

    @property
    def runs_old_policy_forward(self) -> bool:
        """The trainer runs the old policy's forward before the updates: for its log-probs, or
        under bypass for the old policy's entropy when the loss needs it (SSPO does)."""
        source = self.old_logprobs
        return source is OldLogProbs.OLD_POLICY_FORWARD or (
            source is OldLogProbs.ENGINE and get_policy_loss(self.loss).needs_old_entropy
        )

    def correction(self) -> MismatchCorrection | None:
        """The mismatch correction the loss applies (tis, mis, icepop; tis perhaps masked by an
        mis band), or None."""
        if self.mismatch not in MISMATCH_CORRECTIONS:
            return None
        try:
            correction = MismatchCorrection.of(
                self.mismatch,
                level=self.mismatch_level,
                lower=self.mismatch_lower,
                upper=self.mismatch_upper,
                key="algo.mismatch",
            )
            if self.mismatch_mask_level is None:
                return correction
            return correction.masked_by(
                self.mismatch_mask_level,
                lower=self.mismatch_mask_lower,
                upper=self.mismatch_mask_upper,
                key="algo.mismatch_mask",
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @property
    def mismatch_name(self) -> str:
        """The correction as the drift report names it: algo.mismatch, with the mask's level
        when there is one (`tis+mis_geometric`)."""
        if self.mismatch_mask_level is None:
            return self.mismatch
        return f"{self.mismatch}+mis_{self.mismatch_mask_level}"

    def _validate_mismatch(self) -> None:
        if self.mismatch not in self.MISMATCH_MODES:
            raise ConfigError(
                f"algo.mismatch: unknown mode {self.mismatch!r}; valid: "
                f"{', '.join(self.MISMATCH_MODES)}"
            )
        if self.mismatch in ("none", "bypass"):
            for name in ("mismatch_level", "mismatch_lower", "mismatch_upper"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"algo.{name}: only used by a correction (algo.mismatch=tis, mis or "
                        f"icepop), not by algo.mismatch={self.mismatch}"
                    )
        if self.mismatch_mask_level is None:
            for name in ("mismatch_mask_lower", "mismatch_mask_upper"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"algo.{name}: only used with a mask (algo.mismatch_mask_level), "
                        "which is unset"
                    )
        elif self.mismatch != "tis":
            raise ConfigError(
                f"algo.mismatch_mask_level: only tis takes a mask, not algo.mismatch="
                f"{self.mismatch}"
            )
        self.correction()

    def _dual_clip_option(self) -> dict[str, Any]:
        """The loss's `dual_clip` option: the loss's default when unset, None for 0 (off)."""
        if self.dual_clip is None:
            return {}
        if "dual_clip" not in get_policy_loss(self.loss).options:
            raise ConfigError(
                f"algo.dual_clip: loss {self.loss!r} has no dual-clip (its token weights are "
                "bounded already); leave it unset"
            )
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ConfigError(f"algo.dual_clip: expected 0 (off) or > 1, got {self.dual_clip}")
        return {"dual_clip": None if self.dual_clip == 0 else self.dual_clip}

    def validate(self) -> None:
        if self.loss not in policy_loss_names():
            raise ConfigError(
                f"algo.loss: unknown loss {self.loss!r}; valid: {', '.join(policy_loss_names())}"
            )
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ConfigError(
                f"algo.loss_agg: unknown mode {self.loss_agg!r}; valid: {', '.join(LOSS_AGG_MODES)}"
            )
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"algo.{name}: expected >= 0, got {value}")
        if self.updates_per_batch < 1:
            raise ConfigError(
                f"algo.updates_per_batch: expected >= 1, got {self.updates_per_batch}"
            )
        for name in ("entropy_coef", "kl_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"algo.{name}: expected >= 0, got {getattr(self, name)}")
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ConfigError("algo.kl_in_reward: needs algo.kl_coef > 0 (the penalty's weight)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(
                f"algo.kl_estimator: unknown estimator {self.kl_estimator!r}; valid: "
                f"{', '.join(KL_ESTIMATORS)}"
            )
        self._validate_mismatch()
        self._dual_clip_option()

    def loss_spec(self, *, max_response_len: int) -> PolicyLossSpec:
        """The policy loss the updates use: this section's loss and clip range (the loss's
        defaults where unset); `max_response_len` is Dr. GRPO's constant normaliser."""
        default_low, default_high = get_policy_loss(self.loss).default_clip
        dr_grpo = self.loss_agg == "seq-mean-token-sum-norm"
        return PolicyLossSpec.of(
            self.loss,
            clip_low=default_low if self.clip_low is None else self.clip_low,
            clip_high=default_high if self.clip_high is None else self.clip_high,
            loss_agg=self.loss_agg,
            # Non-finite values must reach the loss, where the step is skipped and counted.
            check_finite=False,
            mismatch=self.correction(),
            entropy_coef=self.entropy_coef,
            # In the reward instead, the loss has no KL term.
            kl_coef=0.0 if self.kl_in_reward else self.kl_coef,
            kl_estimator=self.kl_estimator,
            **self._dual_clip_option(),
            **({"max_response_len": max_response_len} if dr_grpo else {}),
        )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run: length, seeds, batching, where it writes."""

    name: str = "run"
    """Run name (wandb, log lines)."""
    dir: str = "runs/run"
    """Run directory: metrics.jsonl, checkpoints/, export/, wandb/."""
    steps: int = 100
    """RL steps (one rollout batch each)."""
    seed: int = 1234
    """Seed of data order, sampling and initialisation."""
    eval_every: int = 10
    """Held-out accuracy every this many steps (and before the first step and after the last)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward pass (gradient accumulation makes up the minibatch)."""
    micro_batch_tokens: int | None = None
    """A token budget per forward/backward pass: each rank's rows of a minibatch, longest first,
    share a pass while they fit in this many tokens (rows x the longest row's length) and
    `micro_batch_size` rows, each pass as wide as its longest row, so little of the work is
    padding; a longer row gets a pass of its own. None: `micro_batch_size` rows per pass, all as
    wide as the step's longest row."""
    packed_sequences: bool = False
    """Each pass's rows back to back in one row (packed, THD: attention within each sequence,
    positions restarting at each), so no position is padding but the few that round a pass up to
    the TP size. With `micro_batch_tokens` the rows, longest first, fill passes up to that many
    tokens whatever `micro_batch_size`; without, `micro_batch_size` rows per pass."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient (skipped) before the run aborts."""
    collective_timeout_s: float = 600.0
    """How long a collective (a gradient all-reduce, a pipeline send, a weight gather) waits for
    every rank of its group: a rank lost to a dead node or a cut network fails the run after
    this, not after the 30 minutes gloo, NCCL and megatron-core default to. Set it above the
    longest wait between collectives: the other ranks wait on rank 0's rollout generation, its
    evaluation and a checkpoint save."""

    def validate(self) -> None:
        check_positive(
            "run",
            self,
            "steps",
            "eval_every",
            "micro_batch_size",
            "max_bad_steps",
            "collective_timeout_s",
        )
        if self.micro_batch_tokens is not None:
            check_positive("run", self, "micro_batch_tokens")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Distributed checkpoints of the whole training state, and the final export."""

    save_every: int = 0
    """Save every this many steps (0: only at the end)."""
    save_last: bool = True
    """Save after the last step, so that the run can be extended with --resume (the drift
    harness's runs, which nothing extends, skip it: a few seconds of each run)."""
    keep: int = 2
    """Checkpoints kept on disk (the newest ones)."""
    export_hf: bool = True
    """Export the final policy to RUN_DIR/export as a Hugging Face checkpoint."""
    save_on_signals: list[str] = field(default_factory=lambda: ["SIGUSR1"])
    """Signals that stop the run after its step and a checkpoint (SLURM's `--signal`), among
    SIGUSR1, SIGUSR2, SIGTERM, SIGHUP, SIGQUIT and SIGXCPU. Any other stop signal stops it at
    once (docs/checkpoints.md, Failures and recovery)."""

    def validate(self) -> None:
        if self.save_every < 0:
            raise ConfigError(
                f"checkpoint.save_every: expected >= 0 (0: only at the end), got {self.save_every}"
            )
        if self.keep < 1:
            raise ConfigError(
                f"checkpoint.keep: expected >= 1 (the newest checkpoint), got {self.keep}"
            )
        self.save_signal_numbers()

    def save_signal_numbers(self) -> list[int]:
        """`save_on_signals` as signal numbers."""
        numbers = []
        for index, name in enumerate(self.save_on_signals):
            key = f"checkpoint.save_on_signals[{index}]"
            try:
                number = signal_number(name)
            except ValueError as error:
                raise ConfigError(f"{key}: {error}") from None
            if number not in GRACEFUL_CANDIDATES:
                accepted = ", ".join(signal.Signals(n).name for n in GRACEFUL_CANDIDATES)
                why = (
                    "(Ctrl-C) always stops at once"
                    if number == signal.SIGINT
                    else "does not ask a process to stop"
                )
                raise ConfigError(f"{key}: {name} {why}; accepted: {accepted}")
            numbers.append(number)
        return numbers


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A training recipe: every section of `megatron-rl train RECIPE`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The algorithm."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and rewards."""
    run: RunConfig = field(default_factory=RunConfig)
    """Length, seeds, batching, run directory."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and export."""

    @property
    def engine_returns_routing(self) -> bool:
        """The rollout engine returns each token's experts: R3 replays them, and the routing
        probe compares them with the trainer's."""
        return self.algo.routing_replay.uses_engine_routing or self.metrics.routing_probe

    def validate(self) -> None:
        if self.parallel.cp > 1:
            raise ConfigError(
                "parallel.cp: the trainer does not split sequences yet (model-level context "
                "parallelism needs Transformer Engine's attention; docs/parallelism.md)"
            )
        if (
            self.algo.routing_replay.needs_old_policy_forward
            and self.algo.old_logprobs is OldLogProbs.ENGINE
        ):
            raise ConfigError(
                "algo.routing_replay=r2 records routing in the trainer's old-policy forward, "
                "which algo.mismatch=bypass skips; use r3 or another algo.mismatch"
            )
        if self.rollout.partial_rollouts and self.metrics.routing_probe:
            raise ConfigError(
                "metrics.routing_probe: the probe compares the engine's routing with the "
                "trainer's, and a generation continued under new weights routes its prefix "
                "again; use rollout.partial_rollouts=false"
            )
        if self.rollout.partial_rollouts and self.algo.routing_replay.uses_engine_routing:
            raise ConfigError(
                "rollout.partial_rollouts: algo.routing_replay=r3 replays the routing the engine "
                "recorded, and a generation continued under new weights routes its prefix "
                "again; use r2 (recorded by the trainer) or rollout.partial_rollouts=false"
            )
        if self.algo.routing_replay.replays_gate_weights and self.rollout.backend != "local":
            raise ConfigError(
                "algo.routing_replay=r3_weights replays the engine's gate weights, which only "
                f"the in-process engine returns (rollout.backend=local); {self.rollout.backend}'s "
                "return_routed_experts gives expert ids only: use r3"
            )
        if self.rollout.max_staleness > self.run.steps:
            raise ConfigError(
                f"rollout.max_staleness: expected at most run.steps = {self.run.steps} (no step "
                f"lags further behind), got {self.rollout.max_staleness}"
            )
