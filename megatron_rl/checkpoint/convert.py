"""Hugging Face <-> megatron-rl checkpoints (`format.py`), on one process or under torchrun.

Both directions write into a staging directory beside `--out` and rename it when every rank has
finished (`megatron_rl.files.atomic.staged_directory`), and both stream: no rank holds its whole
model. `hf_to_mcore` makes each tensor from the Hugging Face files when megatron-core's format
writes it; `mcore_to_hf` loads the checkpoint a part at a time as the weight stream reads it.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rl.checkpoint.format import (
    PartByPart,
    model_sharded_state_dict,
    read_metadata,
    record_checksums_of_every_rank,
    save_weights,
    verify_checkpoint,
    write_metadata,
)
from megatron_rl.files.atomic import staged_directory
from megatron_rl.files.distcp import TensorValue, TensorValues
from megatron_rl.files.file_ranges import FileRange
from megatron_rl.files.hf_checkpoint import HFCheckpoint, asset_files, copy_assets, read_config
from megatron_rl.files.safetensors_shards import (
    TensorSpec,
    shard_file_sizes,
    write_safetensors_shards,
)
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families.base import BoundRule, ModelFamily, bind_rules
from megatron_rl.models.hf_source import HFSource
from megatron_rl.models.hf_weights import (
    HFLoadPlan,
    HFWeightStream,
    TPLayout,
    plan_hf_load,
    stream_hf_weights,
    tp_slice,
    unchanged_ranges,
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
    the tensors of its own shard, each when it is written: the model is built (its memory
    untouched) only for the layout of its state dict."""
    with staged_directory(out, overwrite=overwrite, collective=True) as staging:
        family, config = source.family, source.config
        model = build_gpt_moe(config, dims, initialize=False)
        plan = raise_together(lambda: plan_hf_load(model, family, config, source.checkpoint.shape))
        bar = _Progress(len(plan.entries), "hf-to-mcore", progress and dist.get_rank() == 0)
        (staging / "weights").mkdir(exist_ok=True)
        dist.barrier()
        try:
            values = _values_from_hf(plan, source.checkpoint, bar)
            weights = save_weights(model_sharded_state_dict(model), staging / "weights", values)
        finally:
            bar.close()
            source.checkpoint.close()
        if dist.get_rank() == 0:
            write_metadata(staging, family, config, source.checkpoint.directory)
        written = {f"weights/{name}": checksum for name, checksum in weights.items()}
        record_checksums_of_every_rank(staging, written)


def _values_from_hf(
    plan: HFLoadPlan, checkpoint: HFCheckpoint, on_value: Callable[[int], None]
) -> TensorValues:
    """Each planned model tensor's value, made from the Hugging Face tensors of `checkpoint`
    when it is written; `on_value(bytes)` after each (progress)."""

    def value(tensor: torch.Tensor, rule: BoundRule, layout: TPLayout) -> TensorValue:
        def make() -> torch.Tensor:
            hf = [checkpoint.tensor(name) for name in rule.hf]
            full = rule.transform.to_megatron(hf, plan.config)
            on_value(full.numel() * full.element_size())
            return tp_slice(full, layout)

        return TensorValue(tensor, make, lambda: checkpoint.prefetch(rule.hf))

    return {
        tensor.untyped_storage().data_ptr(): value(tensor, rule, layout)
        for tensor, rule, layout in plan.entries
    }


def mcore_to_hf(
    ckpt: Path,
    out: Path,
    dims: ParallelDims,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    bucket_bytes: int = 512 * 2**20,
    part_bytes: int = 512 * 2**20,
    progress: bool = True,
) -> list[str]:
    """Write a Hugging Face checkpoint (config.json, sharded safetensors with an index,
    tokenizer files) from a megatron-rl checkpoint; rank 0 writes, every rank streams. Each rank
    loads the checkpoint in parts of about `part_bytes` of its own tensors as the stream reaches
    them (`PartByPart`), so it holds one part and one bucket, not its model. The tensors that
    rank 0, the writer, holds whole and exports unchanged (expert weights, norms, embeddings:
    `unchanged_ranges`) are not read there: their bytes are copied from the checkpoint's files
    into the shards, file to file, where they are stored as they are exported. Returns the names
    of the Hugging Face tensors so copied (on rank 0; none elsewhere).

    Rank 0 first reads every file of the checkpoint once against the checksums recorded at its
    save (`verify_checkpoint`): a damaged file is named (a ValueError on every rank) before
    anything is written, rather than exported as NaNs. It reads past the page cache: most of
    the bytes are copied, read past it again."""
    metadata = read_metadata(ckpt)
    raise_together(
        lambda: verify_checkpoint(ckpt, past_page_cache=True) if dist.get_rank() == 0 else None
    )
    family, config = metadata.family, metadata.config
    model = build_gpt_moe(config, dims, initialize=False)
    order = bind_rules(family, config)
    unchanged = unchanged_ranges(model, order, config) if dist.get_rank() == 0 else {}
    parts = PartByPart(model, ckpt, metadata.format_version, order, part_bytes, unchanged)
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
        before_tensor=parts.before_tensor,
        stored=parts.located,
    )
    return sorted(parts.located)


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
    before_tensor: Callable[[str], None] | None = None,
    stored: Mapping[str, Sequence[FileRange]] | None = None,
) -> None:
    """Write a live model (every rank's `model` chunk, unwrapped) as a Hugging Face checkpoint
    at `out`, with config.json and tokenizer files from `assets` (a collective).
    `before_tensor` is the weight stream's hook (`HFWeightStream`); `stored`, where rank 0
    copies Hugging Face tensors' bytes from instead of writing them
    (`write_safetensors_shards`)."""
    with staged_directory(out, overwrite=overwrite, collective=True) as staging:
        stream = stream_hf_weights(
            model, family, config, bucket_bytes=bucket_bytes, before_tensor=before_tensor
        )
        if dist.get_rank() == 0:
            _write_hf(
                staging, out, assets, family, config, stream, max_shard_bytes, progress, stored
            )
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
        # refreshed as tqdm refreshes the count (at most ten times a second), not per tensor
        self.bar.set_postfix_str(f"{self.bytes / 2**30:.2f} GiB", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# The file system's unit of allocation on most disks: what a file of n bytes takes, rounded up.
_BLOCK = 4096


def _write_hf(
    staging: Path,
    out: Path,
    assets: Path,
    family: ModelFamily,
    config: MoEModelConfig,
    stream: HFWeightStream,
    max_shard_bytes: int,
    progress: bool,
    stored: Mapping[str, Sequence[FileRange]] | None,
) -> None:
    """Rank 0: the streamed weights as safetensors shards in `staging` (to become `out`), with
    config.json and the tokenizer files from the Hugging Face directory `assets` (config.json
    made from `config` if absent). A disk that fills is named with the space the export needs."""
    source_config = assets / "config.json"
    hf_config = read_config(assets) if source_config.is_file() else family.config_to_hf(config)
    specs = [TensorSpec(name, shape, dtype) for name, shape, dtype in stream.manifest]
    files = asset_files(assets)
    sizes = [*shard_file_sizes(specs, max_shard_bytes), *(path.stat().st_size for path in files)]
    needed = sum(-(-size // _BLOCK) * _BLOCK for size in sizes)  # files take whole blocks
    free = shutil.disk_usage(staging).free
    bar = _Progress(len(specs), "mcore-to-hf", progress)
    try:
        tensors = (pair for bucket in stream for pair in bucket)
        write_safetensors_shards(
            staging, specs, tensors, max_shard_bytes=max_shard_bytes, on_tensor=bar, stored=stored
        )
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        copy_assets(files, staging)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        raise OSError(
            errno.ENOSPC,
            f"no space left for the export (it needs about {needed / 2**20:.2f} MiB, "
            f"{free / 2**20:.2f} MiB were free)",
            str(out),
        ) from error
    finally:
        bar.close()
