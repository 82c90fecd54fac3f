"""Hugging Face <-> Megatron-Core distributed checkpoints, on one process or under torchrun.

A megatron-rl checkpoint directory:

    megatron_rl.json   format version, model family, the MoEModelConfig
    hf/                the source config.json and tokenizer files (used again on export)
    weights/           megatron-core dist_checkpointing files (loadable at any TP/EP/PP)

Both directions write into a temporary directory beside `--out` and rename it when complete.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from tqdm import tqdm

from megatron_rl.checkpoint.hf_files import (
    ASSET_FILES,
    HFCheckpoint,
    TensorSpec,
    check_output_dir,
    copy_assets,
    publish,
    read_config,
    write_safetensors_shards,
)
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import FAMILIES, family_for
from megatron_rl.models.families.base import ModelFamily
from megatron_rl.models.hf_weights import (
    HFWeightStream,
    apply_hf_load,
    plan_hf_load,
    stream_hf_weights,
    unmapped_hf_names,
)
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import host_all_reduce

FORMAT_VERSION = 2
METADATA = "megatron_rl.json"

# How `weights/` keys the model, by format version (the `metadata` of megatron-core's
# `sharded_state_dict`). Format 1 stores each expert weight of all layers as one tensor of
# layers x experts slices; saving and loading then compare every pair of slices for overlap
# (megatron-core's and torch.distributed.checkpoint's validation), time that grows with the
# square of layers x experts. Format 2 keys every layer and every expert on its own
# (`singleton_local_shards`), so that checking is linear. Both reload at any TP/EP/PP.
SHARDED_KEYS: dict[int, dict[str, bool] | None] = {1: None, 2: {"singleton_local_shards": True}}


def model_sharded_state_dict(
    model: torch.nn.Module, format_version: int = FORMAT_VERSION
) -> ShardedStateDict:
    """`model`'s (a megatron-core GPTModel, unwrapped) sharded state dict, keyed as checkpoints of
    `format_version` key it."""
    keys = SHARDED_KEYS[format_version]
    # a fresh dict each call: megatron-core adds its process groups to the one it is given
    return model.sharded_state_dict(metadata=None if keys is None else dict(keys))


def _broadcast_path(path: Path | None) -> Path:
    """Rank 0 chose it; every rank gets it."""
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _staging_dir(out: Path, *, overwrite: bool) -> Path:
    """Rank 0 checks the target and makes a temporary sibling; every rank learns its path."""
    error = None
    staging = None
    if dist.get_rank() == 0:
        try:
            check_output_dir(out, overwrite=overwrite)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        except ValueError as caught:
            error = str(caught)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ValueError(box[0])
    return _broadcast_path(staging)


def _finish(staging: Path, out: Path, failed: bool) -> None:
    """All ranks agree on success before rank 0 publishes; any failure removes the staging."""
    flag = host_all_reduce(torch.tensor([1 if failed else 0]))
    if dist.get_rank() == 0:
        if int(flag) == 0:
            publish(staging, out)
        else:
            shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face checkpoint, checked and matched to a family (before any process group)."""

    checkpoint: HFCheckpoint
    family: ModelFamily
    config: MoEModelConfig


def inspect_hf(hf_dir: Path) -> HFSource:
    """Open and check a Hugging Face checkpoint: files, architecture, config, unused tensors."""
    checkpoint = HFCheckpoint(hf_dir)
    family = family_for(checkpoint.config)
    config = family.config_from_hf(checkpoint.config)
    extra = unmapped_hf_names(family, config, checkpoint.names())
    if extra:
        raise ValueError(
            f"{hf_dir}: {len(extra)} tensor(s) the {family.architecture} mapping does not use, "
            f"e.g. {extra[:3]}; the config and the weights disagree"
        )
    return HFSource(checkpoint, family, config)


def _agree(error: str | None) -> None:
    """Every rank raises the first rank's error, so that no rank waits in a collective."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ValueError(first)


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
    staging = _staging_dir(out, overwrite=overwrite)
    failed = True
    try:
        family, config = source.family, source.config
        model = build_gpt_moe(config, dims, initialize=False)
        plan, error = None, None
        try:
            plan = plan_hf_load(model, family, config, source.checkpoint.shape)
        except ValueError as caught:
            error = str(caught)
        _agree(error)
        bar = _Progress(len(plan.entries), "hf-to-mcore", progress and dist.get_rank() == 0)
        try:
            apply_hf_load(plan, source.checkpoint.tensor, on_param=bar)
        finally:
            bar.close()
            source.checkpoint.close()
        (staging / "weights").mkdir(exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(model_sharded_state_dict(model), str(staging / "weights"))
        if dist.get_rank() == 0:
            write_metadata(staging, family, config, source.checkpoint.directory)
        failed = False
    finally:
        _finish(staging, out, failed)


def write_metadata(ckpt: Path, family: ModelFamily, config: MoEModelConfig, hf_dir: Path) -> None:
    """What makes `ckpt` (with its model in `weights/`) a megatron-rl checkpoint: METADATA and
    `hf/` (config.json and tokenizer files of the Hugging Face checkpoint `hf_dir`)."""
    (ckpt / "hf").mkdir()
    shutil.copy2(hf_dir / "config.json", ckpt / "hf")
    copy_assets([hf_dir / name for name in ASSET_FILES if (hf_dir / name).is_file()], ckpt / "hf")
    metadata = {
        "format": FORMAT_VERSION,
        "architecture": family.architecture,
        "model": asdict(config),
    }
    (ckpt / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")


@dataclass(frozen=True)
class CheckpointMetadata:
    """What `megatron_rl.json` says about a checkpoint."""

    family: ModelFamily
    config: MoEModelConfig
    format_version: int


def read_metadata(ckpt: Path) -> CheckpointMetadata:
    path = ckpt / METADATA
    if not path.is_file():
        raise ValueError(f"--ckpt {ckpt}: no {METADATA}; not a megatron-rl checkpoint")
    try:
        metadata = json.loads(path.read_text())
        version, architecture = metadata["format"], metadata["architecture"]
        config = MoEModelConfig(**metadata["model"])
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: unreadable ({error!r})") from None
    if version not in SHARDED_KEYS:
        raise ValueError(
            f"{path}: format {version}, this version of megatron-rl reads formats "
            f"{', '.join(map(str, SHARDED_KEYS))}"
        )
    if architecture not in FAMILIES:
        raise ValueError(
            f"{path}: architecture {architecture!r} is not supported; supported: "
            f"{', '.join(FAMILIES)}"
        )
    if not (ckpt / "weights").is_dir():
        raise ValueError(f"--ckpt {ckpt}: the weights/ directory is missing")
    return CheckpointMetadata(FAMILIES[architecture], config, version)


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
    loaded = dist_checkpointing.load(wanted, str(ckpt / "weights"))
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
    staging = _staging_dir(out, overwrite=overwrite)
    failed = True
    try:
        stream = stream_hf_weights(model, family, config, bucket_bytes=bucket_bytes)
        if dist.get_rank() == 0:
            _write_hf(staging, assets, family, config, stream, max_shard_bytes, progress)
        else:
            for _ in stream:
                pass
        failed = False
    finally:
        _finish(staging, out, failed)


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
    copy_assets([assets / name for name in ASSET_FILES if (assets / name).is_file()], staging)
