"""Workers for the policy tests (run on gloo ranks by tests.parallel.harness)."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from megatron.core import parallel_state
from safetensors.torch import load_file, save_file

from megatron_rl.algo import (
    MismatchCorrection,
    PolicyLossSpec,
    engine_gap_metrics,
)
from megatron_rl.models.config import ModelConfig
from megatron_rl.moe.replay_mode import RoutingReplayMode
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.parallel.stages import from_last_stage
from megatron_rl.rewards import ArithmeticTask
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.trainer import policy as policy_module
from megatron_rl.trainer.batches import (
    EngineRouting,
    RolloutBatch,
    build_rollout_batch,
    micro_batches,
)
from megatron_rl.trainer.learner import learn, step_advantages
from megatron_rl.trainer.metrics import StepTimer
from megatron_rl.trainer.micro_batch import PolicyMicroBatch, router_rows
from megatron_rl.trainer.optimizer_config import OptimConfig
from megatron_rl.trainer.policy import Policy
from megatron_rl.trainer.rank0_engine import Rank0Engine
from megatron_rl.trainer.recipe import AlgoConfig
from megatron_rl.trainer.schedule import policy_forward_backward
from megatron_rl.trainer.weight_sync import WeightSyncMismatch, sync_weights
from tests.parallel.optimizer_worker import main_weights


def _engine_logprobs(engine: LocalEngine, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The engine model's log-prob of every next token `[b, S]`, 0 off `mask`."""
    with torch.no_grad():
        logp = engine.model(tokens).logits.float().log_softmax(-1)
    targets = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)
    return torch.where(mask, logp.gather(2, targets[..., None])[..., 0], 0.0)


def _sync(
    policy: Policy,
    engine: LocalEngine | None,
    version: int,
    *,
    probe: list[int] | None = None,
    tolerance: float = 1e-4,
) -> dict[str, float]:
    rollout = RolloutConfig(
        sync_bucket_mb=1, probe_every=1 if probe else 0, probe_tolerance=tolerance
    )
    return sync_weights(
        policy,
        Rank0Engine(engine),
        version=version,
        probe=probe or [],
        rollout=rollout,
        sync_count=0,
    )


class _LostUpdates(LocalEngine):
    """A broken engine (test double): it takes weight updates and drops them."""

    def update_weights(self, buckets, version: int) -> None:
        for _ in buckets:
            pass
        self._version = version


def engine_old_share(
    batch: RolloutBatch,
    advantages: torch.Tensor,
    dp_size: int,
    *,
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    width_multiple: int = 1,
    packed: bool = False,
    engine_routing: EngineRouting | None = None,
) -> list[PolicyMicroBatch]:
    """This rank's data-parallel share of all of `batch`'s rows, as micro-batches (cut as
    `micro_batches` cuts them) with the rows' `advantages` (`[B]`) and the engine's log-probs
    as the old ones."""
    return [
        replace(micro.with_row_advantages(advantages), old_logp=micro.engine_logp)
        for micro in micro_batches(
            batch,
            list(range(batch.num_rows)),
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=dp_size,
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            width_multiple=width_multiple,
            packed=packed,
            engine_routing=engine_routing,
        )
    ]


def _share(policy: Policy, batch: RolloutBatch, micro_batch_size: int) -> list[PolicyMicroBatch]:
    """`engine_old_share` with the batch's group advantages."""
    advantages = step_advantages(batch, AlgoConfig())
    return engine_old_share(batch, advantages, policy.dims.dp, micro_batch_size=micro_batch_size)


def _one_update(policy: Policy, batch) -> float:
    """One GRPO optimizer step on this rank's share of `batch`; returns the gradient norm."""
    share = _share(policy, batch, micro_batch_size=4)
    mode = RoutingReplayMode.NONE
    computed = policy.old_policy(share, mode)
    share = [
        replace(micro, old_logp=old.logp if old.logp is not None else micro.old_logp)
        for micro, old in zip(share, computed, strict=True)
    ]
    return policy.update(
        share, PolicyLossSpec.of("grpo", clip_low=0.2, clip_high=0.2), mode
    ).grad_norm


def probe_check(launch: LaunchEnv, hf_dir: str) -> dict[str, object]:
    """The weight-sync probe: trainer and engine agree after each sync; an engine that dropped
    the update stops every rank with WeightSyncMismatch."""
    dims = ParallelDims(world_size=launch.world_size, ep=launch.world_size)
    init_distributed(dims, launch, seed=5)
    policy = Policy(ModelConfig(hf_path=hf_dir), dims, OptimConfig(lr=1e-3))
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    codec = PromptCodec(hf_dir, max_prompt_tokens=64)
    problem = ArithmeticTask().problems("eval", 1, seed=0)[0]
    probe = codec.encode_prompt(problem.prompt) + codec.tokenizer.encode(problem.solution)
    batch = _rollout_batch(engine, codec)
    result: dict[str, object] = {"start": _sync(policy, engine, 0, probe=probe)}
    _one_update(policy, batch)
    result["synced"] = _sync(policy, engine, 1, probe=probe)
    broken = _LostUpdates(engine.model) if engine is not None else None
    _one_update(policy, batch)
    try:
        _sync(policy, broken, 2, probe=probe)
    except WeightSyncMismatch as error:
        result["error"] = str(error)
    return result


def _rollout_batch(engine: LocalEngine | None, codec: PromptCodec):
    """Samples of 4 training problems (2 each) from rank 0's engine, on every rank."""
    problems = ArithmeticTask().problems("train", 4, seed=3)
    box = [None]
    if engine is not None:
        params = SamplingParams(max_new_tokens=32, stop_token_ids=codec.stop_token_ids)
        groups = engine.generate([codec.encode_prompt(p.prompt) for p in problems], params, n=2)
        box = [[s for g in groups for s in g]]
    torch.distributed.broadcast_object_list(box, src=0)
    samples = box[0]
    rewards = torch.tensor([float(i % 2) for i in range(len(samples))])
    return build_rollout_batch(
        samples,
        rewards,
        group_size=2,
        pad_id=0,
        newline_token_ids=codec.newline_token_ids,
    )


def weight_sync(launch: LaunchEnv, hf_dir: str, layout: dict[str, int]) -> dict[str, float]:
    """Trainer (split as `layout`) and engine log-probs on one probe batch: equal at the start,
    apart after an update, equal again after the weight sync."""
    dims = ParallelDims(world_size=launch.world_size, **layout)
    init_distributed(dims, launch, seed=5)
    policy = Policy(ModelConfig(hf_path=hf_dir), dims, OptimConfig(lr=1e-3))
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    codec = PromptCodec(hf_dir, max_prompt_tokens=64)
    batch = _rollout_batch(engine, codec)
    rows = list(range(batch.num_rows))

    def trainer_logp() -> tuple[torch.Tensor, torch.Tensor]:
        micro = micro_batches(batch, rows, dp_rank=0, dp_size=1, micro_batch_size=len(rows))
        (old,) = policy.old_policy(micro, RoutingReplayMode.NONE)
        # only the last stage has them; rank 0 (the first stage under PP) compares
        logp, mask = from_last_stage(old.logp), micro[0].loss_mask
        return torch.where(mask, logp, 0.0), mask

    result: dict[str, float] = {}
    logp, mask = trainer_logp()
    if engine is not None:
        result["start"] = float((logp - _engine_logprobs(engine, batch.tokens, mask)).abs().max())
    result["grad_norm"] = _one_update(policy, batch)
    logp, mask = trainer_logp()
    if engine is not None:
        stale = _engine_logprobs(engine, batch.tokens, mask)
        result["before_sync"] = float((logp - stale).abs().max())
    _sync(policy, engine, version=1)
    if engine is not None:
        fresh = _engine_logprobs(engine, batch.tokens, mask)
        result["after_sync"] = float((logp - fresh).abs().max())
        result["version"] = engine.weight_version
    return result


def old_policy_is_current(launch: LaunchEnv, hf_dir: str, layout: dict[str, int]) -> dict:
    """One update on the same rollouts by two copies of the policy: with the old log-probs of an
    old-policy forward, and with none (`old_logp=None`: the update's own forward, detached).
    Returns both updates' losses, gradient norms and largest weight difference after the step,
    and the skipping update's mismatch metrics beside those of the forward (engine beside)."""
    dims = ParallelDims(world_size=launch.world_size, **layout)
    init_distributed(dims, launch, seed=5)
    config = ModelConfig(hf_path=hf_dir)
    with_forward, without = (Policy(config, dims, OptimConfig(lr=1e-3)) for _ in range(2))
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    batch = _rollout_batch(engine, PromptCodec(hf_dir, max_prompt_tokens=64))
    share = _share(with_forward, batch, micro_batch_size=2)
    mode, correction = RoutingReplayMode.NONE, MismatchCorrection.of("tis")
    spec = PolicyLossSpec.of("gspo", clip_low=3e-4, clip_high=4e-4, mismatch=correction)
    start = [weight.detach().clone() for weight in main_weights(without.optimizer)]
    computed = with_forward.old_policy(share, mode)
    forward = with_forward.update(
        [
            replace(micro, old_logp=old.logp, engine_logp=micro.old_logp)
            for micro, old in zip(share, computed, strict=True)
        ],
        spec,
        mode,
    )
    skipped = without.update(
        [replace(micro, old_logp=None, engine_logp=micro.old_logp) for micro in share],
        spec,
        mode,
    )
    gap = {}
    if parallel_state.is_pipeline_last_stage():
        trainer = torch.cat([old.logp.flatten() for old in computed])
        engine_logp = torch.cat([micro.old_logp.flatten() for micro in share])
        mask = torch.cat([micro.loss_mask.flatten() for micro in share])
        gap = {k: float(v) for k, v in engine_gap_metrics(trainer, engine_logp, mask).items()}
    after = main_weights(without.optimizer)
    pairs = zip(main_weights(with_forward.optimizer), after, strict=True)
    return {
        "loss": (forward.loss, skipped.loss),
        "grad_norm": (forward.grad_norm, skipped.grad_norm),
        "weight_diff": max(float((a - b).abs().max()) for a, b in pairs),
        "moved": max(float((a - b).abs().max()) for a, b in zip(after, start, strict=True)),
        "metrics": skipped.metrics,
        "gap": from_last_stage(gap),
    }


def update_steps_once(launch: LaunchEnv, hf_dir: str) -> dict:
    """One update by two copies of the policy on the same micro-batches, with a gradient clip
    that binds: the trainer's (`Policy.update`), counting how often it prepares the gradients,
    and megatron-core's own `optimizer.step()` after the same forward-backward. Returns the
    count, both gradient norms and the largest weight difference after the step."""
    dims = ParallelDims(world_size=launch.world_size, ep=launch.world_size)
    init_distributed(dims, launch, seed=5)
    config, optim = ModelConfig(hf_path=hf_dir), OptimConfig(lr=1e-3, clip_grad=1e-3)
    ours, theirs = (Policy(config, dims, optim, routing_replay=False) for _ in range(2))
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    batch = _rollout_batch(engine, PromptCodec(hf_dir, max_prompt_tokens=64))
    share = _share(ours, batch, micro_batch_size=4)
    spec, mode = PolicyLossSpec.of("grpo", clip_low=0.2, clip_high=0.2), RoutingReplayMode.NONE
    start = [weight.detach().clone() for weight in main_weights(ours.optimizer)]
    prepared = []
    prepare_grads = ours.optimizer.prepare_grads

    def counted_prepare_grads() -> bool:
        prepared.append(1)
        return prepare_grads()

    ours.optimizer.prepare_grads = counted_prepare_grads
    result = ours.update(share, spec, mode)
    theirs.model.zero_grad_buffer()
    theirs.optimizer.zero_grad()
    policy_forward_backward(theirs.model, share, spec)
    taken, their_norm, _ = theirs.optimizer.step()
    after = main_weights(ours.optimizer)
    pairs = zip(after, main_weights(theirs.optimizer), strict=True)
    return {
        "prepared": len(prepared),
        "skipped": result.skipped,
        "taken": taken,
        "grad_norm": (result.grad_norm, float(their_norm)),
        "weight_diff": max(float((a - b).abs().max()) for a, b in pairs),
        "moved": max(float((a - b).abs().max()) for a, b in zip(after, start, strict=True)),
    }


def non_finite_updates(launch: LaunchEnv, hf_dir: str) -> dict:
    """Updates whose loss is NaN (NaN old log-probs in one micro-batch) or whose gradient norm is
    inf (an inf written into one gradient after the backward; a fault injected here): each is
    skipped, leaves the weights as they were and reports its non-finite values."""
    dims = ParallelDims(world_size=launch.world_size, ep=launch.world_size)
    init_distributed(dims, launch, seed=5)
    policy = Policy(ModelConfig(hf_path=hf_dir), dims, OptimConfig(lr=1e-3), routing_replay=False)
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    batch = _rollout_batch(engine, PromptCodec(hf_dir, max_prompt_tokens=64))
    share = _share(policy, batch, micro_batch_size=2)
    # as the trainer's: non-finite values reach the loss instead of stopping it
    spec = PolicyLossSpec.of("grpo", clip_low=0.2, clip_high=0.2, check_finite=False)
    mode = RoutingReplayMode.NONE
    start = [weight.detach().clone() for weight in main_weights(policy.optimizer)]
    poisoned = [replace(share[0], old_logp=share[0].old_logp * math.nan), *share[1:]]
    nan_loss = policy.update(poisoned, spec, mode)
    real_forward_backward = policy_module.policy_forward_backward

    def inf_gradient(*args, **kwargs):
        result = real_forward_backward(*args, **kwargs)
        next(iter(policy.model.parameters())).main_grad.view(-1)[0] = math.inf
        return result

    policy_module.policy_forward_backward = inf_gradient
    inf_norm = policy.update(share, spec, mode)
    policy_module.policy_forward_backward = real_forward_backward
    after = [weight.detach().clone() for weight in main_weights(policy.optimizer)]
    good = policy.update(share, spec, mode)
    return {
        "nan_loss": (nan_loss.loss, nan_loss.grad_norm, nan_loss.skipped, nan_loss.metrics),
        "inf_norm": (inf_norm.loss, inf_norm.grad_norm, inf_norm.skipped),
        "good": (good.loss, good.grad_norm, good.skipped),
        "moved": max(float((a - b).abs().max()) for a, b in zip(after, start, strict=True)),
        "lr_steps": policy.scheduler.num_steps,
    }


def one_row_step(launch: LaunchEnv, hf_dir: str) -> dict[str, float]:
    """A step that kept one training row, with algo.updates_per_batch = 4: `learn`'s metrics."""
    dims = ParallelDims(world_size=launch.world_size, ep=launch.world_size)
    init_distributed(dims, launch, seed=5)
    policy = Policy(ModelConfig(hf_path=hf_dir), dims, OptimConfig(lr=1e-3))
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    codec = PromptCodec(hf_dir, max_prompt_tokens=64)
    batch = _rollout_batch(engine, codec)
    # one group of 2 whose first response was filtered (DAPO's overlong filter): one row trains
    one = build_rollout_batch(
        batch.samples[:2],
        batch.rewards[:2],
        group_size=2,
        trains=[False, True],
        pad_id=0,
        newline_token_ids=codec.newline_token_ids,
    )
    algo = AlgoConfig(loss="gspo", updates_per_batch=4)
    return learn(
        policy,
        one,
        algo.loss_spec(max_response_len=32),
        algo,
        micro_batch_size=4,
        timer=StepTimer(),
        seed=0,
    )


SAVED_AFTER_UPDATES = 3


def bfloat16_copy(hf_dir: str, directory: Path) -> str:
    """A copy of the Hugging Face checkpoint `hf_dir` with bfloat16 weights and config dtype, as
    GPU runs train it."""
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    weights = load_file(directory / "model.safetensors")
    save_file({n: t.bfloat16() for n, t in weights.items()}, directory / "model.safetensors")
    return str(directory)


def checkpoint_round_trip(
    launch: LaunchEnv, hf_dir: str, directory: str, format_version: int, distributed: bool
) -> dict[str, object]:
    """Save a policy after a few updates in checkpoint format `format_version` (format 1 as an
    older megatron-rl wrote it), with the distributed or the plain optimizer, load it into a
    fresh policy, take one more update with both; report what differs."""
    from megatron_rl.checkpoint import format as checkpoint_format
    from megatron_rl.trainer import checkpoints

    dims = ParallelDims(world_size=launch.world_size, ep=launch.world_size)
    init_distributed(dims, launch, seed=5)
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    batch = _rollout_batch(engine, PromptCodec(hf_dir, max_prompt_tokens=64))
    settings = OptimConfig(lr=1e-3, distributed_optimizer=distributed)
    saved = Policy(ModelConfig(hf_path=hf_dir), dims, settings)
    for _ in range(SAVED_AFTER_UPDATES):
        _one_update(saved, batch)
    # an older writer: both the weights' keys and megatron_rl.json's format field
    checkpoints.FORMAT_VERSION = checkpoint_format.FORMAT_VERSION = format_version
    path = checkpoints.save_checkpoint(Path(directory), 1, saved, {"seen": 8}, keep=1)
    fresh = Policy(ModelConfig(hf_path=hf_dir), dims, settings)
    step, trainer = checkpoints.load_checkpoint(path, fresh)
    optimizer = dict(_adam_tensors(saved.optimizer))
    report = {
        "step": step,
        "trainer": trainer,
        "format": checkpoint_format.read_metadata(path).format_version,
        "weights_differ": _differing(
            saved.model.module.state_dict(), fresh.model.module.state_dict()
        ),
        "optimizer_differ": _differing(optimizer, dict(_adam_tensors(fresh.optimizer))),
        "optimizer_tensors": len(optimizer),
        "optimizers": sorted(
            {type(inner).__name__ for inner in fresh.optimizer.chained_optimizers}
        ),
        "parameters_numel": sum(p.numel() for p in saved.model.module.parameters()),
        "dtypes": sorted({str(p.dtype) for p in saved.model.module.parameters()}),
        "main_weights": len(main_weights(saved.optimizer)),
        "main_weights_numel": sum(w.numel() for w in main_weights(saved.optimizer)),
    }
    # and the restored optimizer takes the next step exactly as the saved one does
    _one_update(saved, batch)
    _one_update(fresh, batch)
    report["next_step_differs"] = _differing(
        saved.model.module.state_dict(), fresh.model.module.state_dict()
    )
    return report


def _differing(expected: dict, actual: dict) -> list[str]:
    """Names of the tensors of `expected` that `actual` lacks or holds with other values."""
    return [
        name
        for name, tensor in expected.items()
        if isinstance(tensor, torch.Tensor)
        and (name not in actual or not torch.equal(tensor, actual[name]))
    ]


def _adam_tensors(optimizer: object):
    """This rank's Adam state (moments and step per weight) and its main weights."""
    for index, inner in enumerate(optimizer.chained_optimizers):
        yield from _tensors(inner.optimizer.state_dict(), f"{index}")
    yield from _tensors(main_weights(optimizer), "main")


def _tensors(tree: object, where: str = ""):
    """Every tensor of a nested dict/list state, with its path."""
    if isinstance(tree, torch.Tensor):
        yield where, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{where}/{key}")
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from _tensors(value, f"{where}/{index}")


def routing_probe(launch: LaunchEnv, hf_dir: str) -> dict[str, object]:
    """The routing probe on a DeepSeek-V3-shaped model (sigmoid router with a score-correction
    bias): the routing and margins before an "update" that raises the last MoE layer's bias of
    experts 0 and 1 by 10 (routing changes there, the gate weights of any given experts do not),
    the probe's metrics after it, and what they must be, computed here from the routing before;
    then a real update with the probe on, the routers' change, and the engine-vs-trainer routing
    mismatch of the float32 engine (whose routing is the trainer's) and of a copy with one
    (token, layer) changed by hand."""
    dims = ParallelDims(world_size=launch.world_size)
    init_distributed(dims, launch, seed=5)
    policy = Policy(ModelConfig(hf_path=hf_dir), dims, OptimConfig(lr=1e-3))
    engine = LocalEngine.from_pretrained(hf_dir)
    codec = PromptCodec(hf_dir, max_prompt_tokens=64)
    problems = ArithmeticTask().problems("train", 4, seed=3)
    params = SamplingParams(max_new_tokens=32, stop_token_ids=codec.stop_token_ids)
    groups = engine.generate(
        [codec.encode_prompt(p.prompt) for p in problems], params, n=3, return_routed_experts=True
    )
    batch = build_rollout_batch(  # 12 rows: the probe forwards the first PROBE_ROWS (8)
        [s for g in groups for s in g],
        torch.tensor([float(i % 2) for i in range(12)]),
        group_size=3,
        pad_id=0,
        newline_token_ids=codec.newline_token_ids,
    )
    config = policy.config
    engine_routing = EngineRouting(
        num_layers=config.num_layers,
        moe_layers=tuple(config.moe_layers),
        stage_layers=tuple(policy.replay.layer_numbers),
        topk=config.router_topk,
    )
    (with_engine,) = micro_batches(
        batch,
        list(range(12)),
        dp_rank=0,
        dp_size=1,
        micro_batch_size=12,
        engine_routing=engine_routing,
    )
    mode = RoutingReplayMode.R2
    watch = policy.replay.observe_routing()
    (old,) = policy.old_policy([with_engine], mode)
    before = watch()
    mismatch = policy.engine_routing_mismatch([with_engine], [old])
    flipped_one = [layer.clone() for layer in old.routing]
    flipped_one[-1][_first_response_token(with_engine)] = (
        flipped_one[-1][_first_response_token(with_engine)].flip(0) + 100
    )  # experts no model has: the whole set differs at one (token, layer)
    mismatch_one = policy.engine_routing_mismatch(
        [with_engine], [replace(old, routing=flipped_one)]
    )
    micro = replace(with_engine, old_logp=old.logp, routing=old.routing)
    router = policy_module._routers(policy.model.module)[-1]
    with torch.no_grad():
        router.expert_bias[:2] += 10.0
    probed = policy._probe_after_update(micro, before)
    with torch.no_grad():
        router.expert_bias[:2] -= 10.0
    probed_rows = micro.first_rows(policy_module.PROBE_ROWS)
    mask = probed_rows.loss_mask.transpose(0, 1).reshape(-1)
    last_before = router_rows(before.free[-1], 12, policy_module.PROBE_ROWS)[mask]
    kept = (last_before[:, :, None] == torch.tensor([0, 1])).any(-1).sum(-1)  # [tokens]
    expected = {
        "layer": float((kept < 2).float().mean()),
        "activated": float(((2 - kept) / 2).float().mean()),
        "flips": float((kept < 2).sum()),
    }
    advantages = step_advantages(batch, AlgoConfig())
    micro = replace(micro, advantages=advantages)
    routers = policy.router_weights()
    grpo = PolicyLossSpec.of("grpo", clip_low=0.2, clip_high=0.2)
    update = policy.update([micro], grpo, mode, probe_routing=True)
    frozen = Policy(ModelConfig(hf_path=hf_dir), dims, OptimConfig(lr=1e-3, freeze_router=True))
    frozen_routers = frozen.router_weights()
    frozen_update = frozen.update([micro], grpo, mode, probe_routing=True)
    return {
        "probed": probed,
        "expected": expected,
        "moe_layers": list(config.moe_layers),
        "tokens": int(mask.sum()),  # of the probed rows
        "all_tokens": int(micro.loss_mask.sum()),
        "mismatch": mismatch,
        "mismatch_one": mismatch_one,
        "update": update.metrics,
        "router_change": policy.router_change(routers),
        "unchanged": policy.router_change(policy.router_weights()),
        "frozen_change": frozen.router_change(frozen_routers),
        "frozen_update": frozen_update.metrics | {"grad_norm": frozen_update.grad_norm},
    }


def _first_response_token(micro) -> int:
    """The router-order index (position-major) of the first response token of row 0."""
    batch = micro.tokens.shape[0]
    position = int(micro.loss_mask[0].nonzero()[0])
    return position * batch


def token_budget_gradient(launch: LaunchEnv, hf_dir: str, layout: dict[str, int]) -> dict:
    """The loss and gradient of one GSPO forward-backward over this rank's share of the same
    rollouts, cut into micro-batches by rows (2 per micro-batch, the batch's width), by a
    token budget (rows of like length, each micro-batch as wide as its longest row) and packed
    within that budget (rows back to back in one row), and how many padding positions each way
    computed: per cut, the largest gradient difference from the rows' (relative to the largest
    gradient), and the largest gradient, over this rank's parameters."""
    dims = ParallelDims(world_size=launch.world_size, **layout)
    init_distributed(dims, launch, seed=5)
    policy = Policy(ModelConfig(hf_path=hf_dir), dims, OptimConfig(lr=1e-3))
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    batch = _rollout_batch(engine, PromptCodec(hf_dir, max_prompt_tokens=64))
    advantages = step_advantages(batch, AlgoConfig())
    spec = PolicyLossSpec.of("gspo", clip_low=3e-4, clip_high=4e-4)
    budget = 2 * int(batch.lengths.min())
    cuts = {"rows": (None, False), "budget": (budget, False), "packed": (budget, True)}
    result: dict = {}
    grads = {}
    for name, (tokens, packed) in cuts.items():
        share = engine_old_share(
            batch,
            advantages,
            dims.dp,
            micro_batch_size=2,
            micro_batch_tokens=tokens,
            width_multiple=dims.tp,  # sequence parallelism splits each micro-batch over TP
            packed=packed,
        )
        policy.model.zero_grad_buffer()
        step = policy_forward_backward(policy.model, share, spec)
        grads[name] = {
            n: p.main_grad.detach().clone() for n, p in policy.model.module.named_parameters()
        }
        result[name] = {
            "loss": float(step.loss),
            "shapes": sorted({tuple(micro.tokens.shape) for micro in share}),
            "padding": sum(int(micro.padding_mask.sum()) for micro in share),
            "tokens": sum(micro.tokens.numel() for micro in share),
        }
    largest = max(float(g.abs().max()) for g in grads["rows"].values())
    result["largest_grad"] = largest
    for name in ("budget", "packed"):
        assert grads["rows"].keys() == grads[name].keys()
        result[name]["grad_difference"] = (
            max(float((grads[name][n] - g).abs().max()) for n, g in grads["rows"].items()) / largest
        )
    return result
