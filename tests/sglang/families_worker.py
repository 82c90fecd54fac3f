"""Worker for the SGLang family tests: the trainer's side of a weight sync (Megatron-Core)."""

from __future__ import annotations

import torch

from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.families import family_for
from megatron_rl.models.hf_weights import load_hf_weights, stream_hf_weights
from megatron_rl.models.module_weights import named_weights
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed


def perturbed_stream(launch: LaunchEnv, hf_dir: str, tokens: list[int], bucket_bytes: int):
    """Load `hf_dir` into Megatron-Core, move every weight (the router bias too) by seeded
    noise, and return the weight stream's buckets (copies) and the model's log-probs of
    `tokens[1:]`: what a trainer would sync, and what the engine should then compute. As numpy
    arrays: they cross to the test process by value (torch would share memory with a process
    that is about to end)."""
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    source = HFCheckpoint(hf_dir)
    family = family_for(source.config)
    config = family.config_from_hf(source.config)
    model = build_gpt_moe(config, dims)
    load_hf_weights(model, family, config, source.tensor, source.shape)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _, weight in named_weights(model):
            weight.add_(0.05 * weight.std() * torch.randn(weight.shape, generator=generator))
    model.eval()
    ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        logits = model(ids, torch.arange(len(tokens))[None], attention_mask=None)
    logp = logits.float().log_softmax(-1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
    buckets = [
        [(name, tensor.numpy().copy()) for name, tensor in bucket]
        for bucket in stream_hf_weights(model, family, config, bucket_bytes=bucket_bytes)
    ]
    return {"buckets": buckets, "logp": logp.numpy()}
