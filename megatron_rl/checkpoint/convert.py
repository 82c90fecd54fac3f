"""Hugging Face <-> megatron-rl checkpoints (`format.py`), on one process or under torchrun.

Both directions write into a staging directory beside `--out` and rename it when every rank has
finished (`megatron_rl.files.atomic.staged_directory`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rl.checkpoint.format import (
    load_weights,
    model_sharded_state_dict,
    read_metadata,
    save_weights,
    write_metadata,
)
from megatron_rl.files.atomic import staged_directory
from megatron_rl.files.hf_checkpoint import asset_files, copy_assets, read_config
from megatron_rl.files.safetensors_shards import TensorSpec, write_safetensors_shards
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families.base import ModelFamily
from megatron_rl.models.hf_source import HFSource
from megatron_rl.models.hf_weights import (
    HFWeightStream,
    apply_hf_load,
    plan_hf_load,
    stream_hf_weights,
)
from megatron_rl.parallel.collectives import raise_together
from megatron_rl.parallel.dims import ParallelDims


def hf_to_mcore(
    source: HFSource,
    out: Path,
    dims: ParallelDims,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> None:
    """Convert a Hugging Face checkpoint into a megatron-rl checkpoint (Megatron-Core
    distributed weights). Runs on every rank of a world laid out as `dims`; each rank reads only
    the tensors of its own shard."""
    with staged_directory(out, overwrite=overwrite, collective=True) as staging:
        family, config = source.family, source.config
        model = build_gpt_moe(config, dims, initialize=False)
        plan = raise_together(lambda: plan_hf_load(model, family, config, source.checkpoint.shape))
        bar = _Progress(len(plan.entries), "hf-to-mcore", progress and dist.get_rank() == 0)
        try:
            apply_hf_load(plan, source.checkpoint.tensor, on_param=bar)
        finally:
            bar.close()
            source.checkpoint.close()
        (staging / "weights").mkdir(exist_ok=True)
        dist.barrier()
        save_weights(model_sharded_state_dict(model), staging / "weights")
        if dist.get_rank() == 0:
            write_metadata(staging, family, config, source.checkpoint.directory)


def mcore_to_hf(
    ckpt: Path,
    out: Path,
    dims: ParallelDims,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    bucket_bytes: int = 512 * 2**20,
    progress: bool = True,
) -> None:
    """Write a Hugging Face checkpoint (config.json, sharded safetensors with an index,
    tokenizer files) from a megatron-rl checkpoint; rank 0 writes, every rank streams."""
    metadata = read_metadata(ckpt)
    family, config = metadata.family, metadata.config
    model = build_gpt_moe(config, dims, initialize=False)
    wanted = model_sharded_state_dict(model, metadata.format_version)
    loaded = load_weights(wanted, ckpt)
    # A training checkpoint also holds the optimizer's state; only the model's is read.
    model.load_state_dict({key: value for key, value in loaded.items() if key in wanted})
    export_hf(
        model,
        family,
        config,
        ckpt / "hf",
        out,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
        bucket_bytes=bucket_bytes,
        progress=progress,
    )


def export_hf(
    model: torch.nn.Module,
    family: ModelFamily,
    config: MoEModelConfig,
    assets: Path,
    out: Path,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    bucket_bytes: int = 512 * 2**20,
    progress: bool = False,
) -> None:
    """Write a live model (every rank's `model` chunk, unwrapped) as a Hugging Face checkpoint
    at `out`, with config.json and tokenizer files from `assets` (a collective)."""
    with staged_directory(out, overwrite=overwrite, collective=True) as staging:
        stream = stream_hf_weights(model, family, config, bucket_bytes=bucket_bytes)
        if dist.get_rank() == 0:
            _write_hf(staging, assets, family, config, stream, max_shard_bytes, progress)
        else:
            for _ in stream:
                pass


class _Progress:
    """A tqdm bar counting tensors, with the bytes so far beside it."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self.bar = tqdm(total=total, unit="tensor", desc=description, disable=not enabled)
        self.bytes = 0

    def __call__(self, size: int) -> None:
        self.bytes += size
        self.bar.update(1)
        self.bar.set_postfix_str(f"{self.bytes / 2**30:.2f} GiB")

    def close(self) -> None:
        self.bar.close()


def _write_hf(
    staging: Path,
    assets: Path,
    family: ModelFamily,
    config: MoEModelConfig,
    stream: HFWeightStream,
    max_shard_bytes: int,
    progress: bool,
) -> None:
    """Rank 0: the streamed weights as safetensors shards, with config.json and the tokenizer
    files from the Hugging Face directory `assets` (config.json made from `config` if absent)."""
    source_config = assets / "config.json"
    hf_config = read_config(assets) if source_config.is_file() else family.config_to_hf(config)
    specs = [TensorSpec(name, shape, dtype) for name, shape, dtype in stream.manifest]
    bar = _Progress(len(specs), "mcore-to-hf", progress)
    try:
        tensors = (pair for bucket in stream for pair in bucket)
        write_safetensors_shards(
            staging, specs, tensors, max_shard_bytes=max_shard_bytes, on_tensor=bar
        )
    finally:
        bar.close()
    (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    copy_assets(asset_files(assets), staging)
