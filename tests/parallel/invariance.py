"""Worker side of the layout-invariance tests: the same weights and batch, once as a single
process would compute them and once split by a parallel layout; loss and every parameter's
gradient are compared on the single-process layout.

How weights and gradients cross layouts: megatron-core's own dist_checkpointing. The reference
model (tp=pp=ep=1) saves its weights; the split model loads them resharded. After its backward,
the split model's gradients are copied into its parameters and saved the same way, then loaded
into a fresh single-process model, where they line up name by name with the reference gradients.
The reference runs on both ranks with identical data (DP=2 over copies of one batch), which gives
exactly the single-process loss and gradient.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_rl.algo import MismatchCorrection, PolicyLossSpec, subsentence_segment_ids
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, set_model_parallel
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.optimizer import build_optimizer, wrap_for_training
from megatron_rl.trainer.optimizer_config import OptimConfig
from megatron_rl.trainer.schedule import policy_forward_backward

NEWLINE = 1
TINY_MOE = MoEModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=128,
    moe_ffn_hidden_size=32,
    num_experts=4,
    router_topk=2,
    vocab_size=128,
    qk_layernorm=True,
    shared_expert_ffn_hidden_size=32,  # an always-on shared expert, as in Qwen2-MoE or DeepSeek
)
LOSSES = {
    "gspo": PolicyLossSpec.of("gspo", clip_low=3e-2, clip_high=4e-2),
    "grpo": PolicyLossSpec.of("grpo", clip_low=0.2, clip_high=0.27),
    "sspo": PolicyLossSpec.of("sspo", clip_low=0.1, clip_high=0.1),
}
# The terms around the surrogate: mismatch corrections (bands narrow enough to mask or truncate
# some tokens of micro_batches' engine log-probs), the entropy bonus, dual-clip, a KL penalty.
CORRECTED_LOSSES = {
    "grpo_icepop_entropy": PolicyLossSpec.of(
        "grpo",
        clip_low=0.2,
        clip_high=0.27,
        mismatch=MismatchCorrection.of("icepop", lower=0.8, upper=1.25),
        entropy_coef=0.01,
    ),
    "gspo_tis_sequence": PolicyLossSpec.of(
        "gspo",
        clip_low=3e-2,
        clip_high=4e-2,
        mismatch=MismatchCorrection.of("tis", level="sequence", upper=1.2),
        dual_clip=3.0,
        kl_coef=0.1,
    ),
}
LAYOUTS = {
    "tp2": {"tp": 2},  # sequence parallelism is on whenever tp > 1
    "ep2_alltoall": {"ep": 2},
    "ep2_allgather": {"ep": 2},
    "pp2": {"pp": 2},
    "pp2_tied": {"pp": 2},  # tied embeddings: the last stage's output layer is the embedding
    "dp2": {},
    "tp2_ep2_etp1": {"tp": 2, "ep": 2, "etp": 1},  # attention split by TP, experts by EP
    "tp2_etp1": {"tp": 2, "etp": 1},  # each TP rank runs every expert on its tokens
}


def micro_batches(count: int = 4, batch: int = 2, seq: int = 24, seed: int = 0) -> list:
    """Prompts and responses of different lengths in full rows, several lines each."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(2, TINY_MOE.vocab_size, (batch, seq), generator=gen)
        tokens[torch.rand(batch, seq, generator=gen) < 0.2] = NEWLINE
        positions = torch.arange(seq)[None, :]
        starts = torch.randint(4, 10, (batch, 1), generator=gen)
        ends = torch.randint(seq - 6, seq, (batch, 1), generator=gen)
        mask = (positions >= starts) & (positions < ends)
        targets = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
        old_logp = -torch.rand(batch, seq, generator=gen) * 2 - 4
        out.append(
            PolicyMicroBatch(
                tokens=tokens,
                loss_mask=mask,
                old_logp=old_logp,
                engine_logp=old_logp + 0.2 * torch.randn(batch, seq, generator=gen),
                ref_logp=old_logp + 0.1 * torch.randn(batch, seq, generator=gen),
                advantages=torch.randn(batch, generator=gen),
                segment_ids=subsentence_segment_ids(targets, mask, [NEWLINE]),
                old_entropy=torch.rand(batch, seq, generator=gen),
            )
        )
    return out


def _load(model: torch.nn.Module, directory: str) -> None:
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))


def _run(
    config: MoEModelConfig,
    dims: ParallelDims,
    dispatcher: str,
    weights: str,
    batches: list,
    spec: PolicyLossSpec,
):
    set_model_parallel(dims)
    model = build_gpt_moe(config, dims, dispatcher=dispatcher)
    _load(model, weights)
    ddp = wrap_for_training(model, distributed_optimizer=False)  # whole gradients are read
    return ddp, policy_forward_backward(ddp, batches, spec)


def _grad_norm(model) -> float:
    """The gradient norm megatron-core's optimizer clips by, over all ranks' shards."""
    optimizer = build_optimizer(model, OptimConfig(lr=0.0))
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


def _fresh_dir(path: str) -> str:
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    return path


def compare_layout(launch: LaunchEnv, layout: str, losses: list[str], workdir: str) -> dict:
    """For each loss: the reference and split losses and the worst relative gradient error."""
    reference = ParallelDims(world_size=launch.world_size)
    init_distributed(reference, launch)
    split = ParallelDims(world_size=launch.world_size, **LAYOUTS[layout])
    dispatcher = "allgather" if layout.endswith("allgather") else "alltoall"
    config = replace(TINY_MOE, tie_word_embeddings=layout.endswith("tied"))
    weights = _fresh_dir(os.path.join(workdir, "weights"))
    dist_checkpointing.save(build_gpt_moe(config, reference).sharded_state_dict(), weights)
    batches = micro_batches()
    mine = batches[launch.rank :: launch.world_size] if layout == "dp2" else batches

    report = {}
    for name in losses:
        spec = (LOSSES | CORRECTED_LOSSES)[name]
        ref_model, ref_step = _run(config, reference, dispatcher, weights, batches, spec)
        ref_grads = {n: p.main_grad.clone() for n, p in ref_model.module.named_parameters()}
        ref_norm = float(sum(g.double().square().sum() for g in ref_grads.values()).sqrt())
        split_model, split_step = _run(config, split, dispatcher, weights, mine, spec)
        split_norm = _grad_norm(split_model)
        with torch.no_grad():
            for param in split_model.module.parameters():
                param.copy_(param.main_grad)
        grads_dir = _fresh_dir(os.path.join(workdir, f"grads-{name}"))
        dist_checkpointing.save(split_model.module.sharded_state_dict(), grads_dir)

        set_model_parallel(reference)
        gathered = build_gpt_moe(config, reference)
        _load(gathered, grads_dir)
        errors, smallest = {}, float("inf")
        for param_name, grad in gathered.named_parameters():
            ref = ref_grads[param_name]
            scale = float(ref.abs().max())
            smallest = min(smallest, scale)
            errors[param_name] = float((grad - ref).abs().max()) / max(scale, 1e-30)
        corrected = [
            float(value)
            for metrics in split_step.metrics
            for key, value in metrics.items()
            if key.startswith("mismatch/") and key.endswith("_token_frac")
        ]
        report[name] = {
            "corrected_frac": sum(corrected) / len(corrected) if corrected else math.nan,
            "ref_loss": float(ref_step.loss),
            "loss": float(split_step.loss),  # nan on a pipeline stage without the loss
            "worst_grad_error": max(errors.values()),
            "ref_grad_norm": ref_norm,
            "grad_norm": split_norm,
            "worst_param": max(errors, key=errors.get),
            "smallest_ref_grad": smallest,
            "num_params": len(errors),
        }
    return report


def accumulation(launch: LaunchEnv, loss: str) -> dict:
    """One micro-batch of 4 rows vs. 4 micro-batches of 1 row, same weights (DP over copies)."""
    dims = ParallelDims(world_size=launch.world_size)
    init_distributed(dims, launch)
    (big,) = micro_batches(count=1, batch=4, seed=3)
    rows = [
        replace(
            big,
            tokens=big.tokens[i : i + 1],
            loss_mask=big.loss_mask[i : i + 1],
            old_logp=big.old_logp[i : i + 1],
            advantages=big.advantages[i : i + 1],
            segment_ids=big.segment_ids[i : i + 1],
            old_entropy=big.old_entropy[i : i + 1],
        )
        for i in range(4)
    ]
    model = wrap_for_training(build_gpt_moe(TINY_MOE, dims), distributed_optimizer=False)
    step_one = policy_forward_backward(model, [big], LOSSES[loss])
    grads_one = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
    model.zero_grad_buffer()
    step_four = policy_forward_backward(model, rows, LOSSES[loss])
    errors = {
        n: float((p.main_grad - grads_one[n]).abs().max() / grads_one[n].abs().max())
        for n, p in model.module.named_parameters()
    }
    return {
        "loss_one": float(step_one.loss),
        "loss_four": float(step_four.loss),
        "worst_grad_error": max(errors.values()),
    }
