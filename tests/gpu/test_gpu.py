"""GPU-only checks: NCCL, bf16, the distributed optimizer, bf16 training checkpoints, CUDA
log-probs, and the Transformer Engine spec when TE is installed. They skip on machines without
CUDA (CI, the CPU dev box) and are run on a lent GPU with `bash scripts/gpu_check.sh`."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.parallel.logprobs import vocab_parallel_logprobs
from tests.gpu import gpu_worker
from tests.parallel.harness import run_on_ranks
from tests.trainer import policy_worker
from tests.trainer.policy_worker import bfloat16_copy
from tests.trainer.run_cli import TINY_MODEL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_logprobs_on_cuda_match_log_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(512, 151_936, generator=gen) * 2).to(torch.bfloat16).cuda()
    logits.requires_grad_(True)
    targets = torch.randint(0, 151_936, (512,), generator=gen).cuda()
    logp, entropy = vocab_parallel_logprobs(logits, targets)
    (logp.sum() + entropy.sum()).backward()
    reference = torch.log_softmax(logits.detach().double(), -1)
    torch.testing.assert_close(
        logp.double(), reference.gather(-1, targets[:, None]).squeeze(-1), rtol=0, atol=1e-4
    )
    torch.testing.assert_close(
        entropy.double(), -(reference.exp() * reference).sum(-1), rtol=0, atol=1e-3
    )
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_bf16_model_step_with_nccl_and_distributed_optimizer():
    (report,) = run_on_ranks(gpu_worker.bf16_step, world_size=1)
    assert report["backend"] == "nccl"
    assert report["distributed_optimizer"]
    assert math.isfinite(report["loss"]) and report["updated"] and report["grad_norm"] > 0
    assert report["changed"] > 0


def test_bf16_training_checkpoint_on_cuda(tmp_path):
    model = bfloat16_copy(TINY_MODEL, tmp_path / "bf16")
    (result,) = run_on_ranks(
        policy_worker.checkpoint_round_trip,
        model,
        str(tmp_path / "checkpoints"),
        2,
        True,
        world_size=1,
    )
    # one GPU: no data-parallel copies, so the plain mixed-precision optimizer
    assert result["optimizers"] == ["Float16OptimizerWithFloat16Params"]
    assert "torch.bfloat16" in result["dtypes"]
    assert result["weights_differ"] == result["optimizer_differ"] == []
    assert result["next_step_differs"] == []


def test_the_reference_policy_offloaded_to_the_host_gives_the_same_logprobs():
    (report,) = run_on_ranks(gpu_worker.reference_offload, str(TINY_MODEL), world_size=1)
    assert report["gpu_device"] == "cuda"
    assert report["devices_before"] == report["devices_after"] == ["cpu"]
    assert report["max_difference"] == 0.0
