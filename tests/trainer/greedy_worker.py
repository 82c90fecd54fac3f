"""Worker: greedy decoding by the Megatron-Core model of a megatron-rl checkpoint (a training
checkpoint's model weights), one prompt at a time, no cache: the trainer's own greedy outputs."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.checkpoint.format import load_weights, model_sharded_state_dict, read_metadata
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed


def greedy_from_checkpoint(
    launch: LaunchEnv, ckpt: str, prompts: list[list[int]], max_new: int, stop_ids: list[int]
) -> list[list[int]]:
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    metadata = read_metadata(Path(ckpt))
    model = build_gpt_moe(metadata.config, dims, initialize=False)
    wanted = model_sharded_state_dict(model, metadata.format_version)
    loaded = load_weights(wanted, Path(ckpt))
    model.load_state_dict({key: value for key, value in loaded.items() if key in wanted})
    model.eval()
    responses = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_new):
                tokens = torch.tensor([ids])
                positions = torch.arange(len(ids))[None]
                logits = model(tokens, positions, attention_mask=None)[0, -1]
                ids.append(int(logits.argmax()))
                if ids[-1] in stop_ids:
                    break
        responses.append(ids[len(prompt) :])
    return responses
