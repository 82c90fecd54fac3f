"""The frozen reference policy of a KL penalty: the starting weights in the policy's layout."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.models.config import ModelConfig
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.policy import load_model_chunk
from megatron_rl.trainer.schedule import old_policy_pass


class ReferencePolicy:
    """This rank's chunk of `model.hf_path` as it was loaded, split like the policy: forward
    only, never updated, its routers always free (built without RouterReplay, so routing replay
    never reaches it). It costs one more copy of the weights in the model's dtype (no
    gradients, no optimizer state); `megatron-rl plan` counts it. With `offload` the copy lives
    in host memory and visits the model's device for each forward."""

    def __init__(self, model: ModelConfig, dims: ParallelDims, *, offload: bool = False) -> None:
        _, _, self.model = load_model_chunk(model, dims, routing_replay=False)
        self.model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.device = next(self.model.parameters()).device
        self.offload = offload and self.device.type != "cpu"
        if self.offload:
            self.model.to("cpu")

    def logprobs(self, micro_batches: list[PolicyMicroBatch]) -> list[Tensor | None]:
        """The reference's log-prob of each predicted token of each micro-batch (like its
        tokens), on the last pipeline stage; None on the others."""
        if self.offload:
            self.model.to(self.device)
        try:
            with torch.no_grad():
                return [values.logp for values in old_policy_pass(self.model, micro_batches)]
        finally:
            if self.offload:
                self.model.to("cpu")
