"""The trainable policy on this rank: a Megatron-Core MoE model chunk loaded from a Hugging Face
checkpoint, megatron-core's DDP, optimizer and learning-rate scheduler, and routing replay."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch import Tensor

from megatron_rl.checkpoint.convert import inspect_hf
from megatron_rl.models.build import Dispatcher, build_gpt_moe, build_optimizer, wrap_for_training
from megatron_rl.models.hf_weights import HFWeightStream, load_hf_weights, stream_hf_weights
from megatron_rl.moe.drift import routing_drift
from megatron_rl.moe.replay import RoutingReplay
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import host_all_reduce
from megatron_rl.parallel.schedule import (
    PolicyLossSpec,
    PolicyMicroBatch,
    policy_forward_backward,
    policy_logprobs,
)
from megatron_rl.parallel.stages import from_last_stage, join_stages

# Per-micro-batch sums used for the loss itself; the update reports the loss instead.
_NOT_AVERAGED = ("loss/sum", "entropy/sum", "loss/denominator")


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """Adam and its schedule (see megatron_rl.config.OptimConfig)."""

    lr: float
    warmup_steps: int = 0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    distributed: bool = True  # Adam's state sharded over DP (when the layout has DP copies)


@dataclass(frozen=True)
class UpdateResult:
    """One optimizer step: the global loss, the gradient norm and the loss metrics averaged over
    micro-batches and data-parallel ranks (maxima and minima for `*/max`, `*/min`)."""

    loss: float
    grad_norm: float
    skipped: bool  # the loss or the gradient was not finite: no step was taken
    metrics: dict[str, float]


RoutingMode = Literal["free", "record", "replay"]


class Policy:
    """This rank's share of the policy (its pipeline stage, TP and EP shards).

    `routing_replay` builds the routers with megatron-core's RouterReplay, which recording,
    replaying and the drift metrics need; without replay actions they route freely.
    """

    def __init__(
        self,
        hf_dir: str | Path,
        dims: ParallelDims,
        optimizer: OptimizerSettings,
        *,
        dispatcher: Dispatcher = "alltoall",
        recompute: bool = False,
        routing_replay: bool = True,
    ) -> None:
        self.hf_dir = Path(hf_dir)
        self.dims = dims
        source = inspect_hf(self.hf_dir)
        self.family, self.config = source.family, source.config
        model = build_gpt_moe(
            self.config,
            dims,
            dispatcher=dispatcher,
            recompute=recompute,
            initialize=False,
            routing_replay=routing_replay,
        )
        load_hf_weights(
            model, self.family, self.config, source.checkpoint.tensor, source.checkpoint.shape
        )
        source.checkpoint.close()
        self.replay = RoutingReplay(model) if routing_replay else None
        # With no data-parallel copies the distributed optimizer has nothing to shard and takes
        # the plain optimizer's steps, with parameter gathers on top.
        distributed = optimizer.distributed and dims.replicates_weights
        self.model = wrap_for_training(model, distributed_optimizer=distributed)
        self.optimizer = build_optimizer(
            self.model,
            lr=optimizer.lr,
            weight_decay=optimizer.weight_decay,
            clip_grad=optimizer.clip_grad,
            adam_betas=optimizer.adam_betas,
            adam_eps=optimizer.adam_eps,
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optimizer.warmup_steps else optimizer.lr,
            max_lr=optimizer.lr,
            min_lr=optimizer.lr,
            lr_warmup_steps=optimizer.warmup_steps,
            lr_decay_steps=optimizer.warmup_steps + 1,
            lr_decay_style="constant",
            start_wd=optimizer.weight_decay,
            end_wd=optimizer.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    def old_logprobs(
        self, micro_batches: list[PolicyMicroBatch], *, routing: RoutingMode = "free"
    ) -> None:
        """Fill each micro-batch's `old_logp` and `old_entropy` with a forward of the current
        weights. `routing`: "free" lets the routers choose; "record" also stores their choice in
        each micro-batch's `routing` (R2, and drift metrics); "replay" forces the `routing` the
        micro-batches carry (R3: the engine's)."""
        if routing not in ("free", "record", "replay"):
            raise ValueError(f"routing: expected 'free', 'record' or 'replay', got {routing!r}")
        if routing != "free" and self.replay is None:
            raise ValueError(f"routing={routing!r}: build the Policy with routing_replay=True")
        policy_logprobs(
            self.model,
            micro_batches,
            replay=None if routing == "free" else self.replay,
            record_routing=routing == "record",
        )

    def update(
        self, micro_batches: list[PolicyMicroBatch], spec: PolicyLossSpec, *, replay: bool
    ) -> UpdateResult:
        """One optimizer step on the minibatch made of `micro_batches` (all DP ranks together),
        replaying their `routing` when `replay`. When they carry routing (recorded or replayed)
        the metrics include how far the routers' free choice has drifted from it.

        A non-finite loss or gradient norm skips the step (gradients are dropped) and says so.
        """
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if replay and self.replay is None:
            raise ValueError("replay: build the Policy with routing_replay=True")
        replaying = self.replay if replay else None
        watch = None
        if self.replay is not None and micro_batches[-1].routing is not None:
            watch = self.replay.observe_free_routing()
        result = policy_forward_backward(self.model, micro_batches, spec, replay=replaying)
        drift = {} if watch is None else _replay_drift(micro_batches[-1], watch())
        # The optimizer reads `main_grad` only after prepare_grads; norm first, so that a
        # non-finite gradient is caught before it reaches the weights.
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        loss, metrics = from_last_stage((float(result.loss), _average_metrics(result.metrics)))
        metrics |= drift
        skipped = not (torch.isfinite(torch.tensor([loss, grad_norm])).all())
        if not skipped:
            self.optimizer.step()
            self.scheduler.step(increment=1)
        return UpdateResult(loss=loss, grad_norm=grad_norm, skipped=bool(skipped), metrics=metrics)

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[Tensor]:
        """Per sequence, `[len - 1]` float32 log-probs of its tokens 1.. under the current
        weights, returned on every rank (a collective: every rank passes the same sequences)."""
        micro_batches = []
        for sequence in sequences:
            # Right padding to a multiple of 8 (sequence parallelism splits the sequence over
            # TP ranks); under causal attention it cannot change the real tokens' log-probs.
            width = -(-len(sequence) // 8) * 8
            tokens = torch.zeros(1, width, dtype=torch.long)
            tokens[0, : len(sequence)] = torch.tensor(sequence)
            mask = torch.zeros(1, width, dtype=torch.bool)
            mask[0, : len(sequence) - 1] = True
            micro_batches.append(
                PolicyMicroBatch(
                    tokens=tokens,
                    loss_mask=mask,
                    old_logp=torch.zeros(1, width),
                    advantages=torch.zeros(1),
                )
            )
        self.old_logprobs(micro_batches)
        # Only the last pipeline stage has log-probs; every rank of it holds the same ones.
        values = [
            mb.old_logp[0, : len(seq) - 1].float().cpu()
            for mb, seq in zip(micro_batches, sequences, strict=True)
        ]
        return from_last_stage(values)

    def weight_stream(self, *, bucket_bytes: int = 512 * 2**20) -> HFWeightStream:
        """The current weights as Hugging Face tensors on global rank 0 (a collective)."""
        return stream_hf_weights(
            self.model.module, self.family, self.config, bucket_bytes=bucket_bytes
        )


def metric_reduction(key: str) -> Literal["max", "min", "mean"]:
    """How values of the loss metric `key` combine over micro-batches, ranks and updates:
    extremes (`ratio/max`, `log_ratio/abs_max`, `ratio/min`) stay extremes, the rest average."""
    if key.endswith("max"):
        return "max"
    if key.endswith("min"):
        return "min"
    return "mean"


def _replay_drift(micro_batch: PolicyMicroBatch, free: list[Tensor]) -> dict[str, float]:
    """How far the routing the current weights would choose has drifted from the replayed one
    (the old policy's, R2, or the engine's, R3): this rank's last micro-batch, every layer (all
    pipeline stages), response tokens (all tokens under sequence parallelism, whose slices the
    mask does not follow)."""
    device = free[0].device  # the model's (R3's replayed routing comes from the host)
    replayed = join_stages(torch.stack(micro_batch.routing, 1).to(device), dim=1)
    chosen = join_stages(torch.stack(free, 1).to(replayed.dtype), dim=1)
    # Routers see tokens sequence-major: position, then row.
    mask = micro_batch.loss_mask.transpose(0, 1).reshape(-1).to(device)
    drift = routing_drift(replayed, chosen, mask if mask.numel() == len(replayed) else None)
    return {f"routing/{key.replace('/', '_')}": float(value) for key, value in drift.items()}


def _average_metrics(per_micro_batch: list[dict[str, Tensor]]) -> dict[str, float]:
    """Loss metrics over micro-batches and data-parallel ranks; empty off the last stage."""
    keys = sorted(
        k for k in (per_micro_batch[0] if per_micro_batch else {}) if k not in _NOT_AVERAGED
    )
    if not keys:
        return {}
    values = torch.tensor(
        [[float(m[key]) for key in keys] for m in per_micro_batch], dtype=torch.float64
    )
    finite = torch.nan_to_num(values, nan=0.0)
    totals = torch.stack(
        [
            finite.sum(0),
            finite.max(0).values,
            finite.min(0).values,
            torch.full((len(keys),), float(len(per_micro_batch)), dtype=torch.float64),
        ]
    )
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        totals[[0, 3]] = host_all_reduce(totals[[0, 3]], group=group)
        totals[1] = host_all_reduce(totals[1], op=dist.ReduceOp.MAX, group=group)
        totals[2] = host_all_reduce(totals[2], op=dist.ReduceOp.MIN, group=group)
    row = {"max": 1, "min": 2}
    return {
        key: float(totals[0, index] / totals[3, index])
        if metric_reduction(key) == "mean"
        else float(totals[row[metric_reduction(key)], index])
        for index, key in enumerate(keys)
    }
