"""Workers for the conversion tests: logits of HF vs converted Megatron-Core models, and the
conversions themselves on 1 or 2 ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from transformers import AutoModelForCausalLM

from megatron_rl.checkpoint.convert import export_hf, hf_to_mcore, mcore_to_hf
from megatron_rl.checkpoint.format import (
    METADATA,
    PartByPart,
    model_sharded_state_dict,
    read_metadata,
)
from megatron_rl.files.checksums import MANIFEST
from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.families import family_for
from megatron_rl.models.families.base import bind_rules
from megatron_rl.models.hf_source import inspect_hf
from megatron_rl.models.hf_weights import global_name, load_hf_weights, stream_hf_weights
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed


def _dims(launch: LaunchEnv, layout: dict) -> ParallelDims:
    return ParallelDims(world_size=launch.world_size, **layout)


def logits_match(launch: LaunchEnv, hf_dir: str, layout: dict) -> dict:
    dims = _dims(launch, layout)
    init_distributed(dims, launch)
    source = HFCheckpoint(hf_dir)
    family = family_for(source.config)
    config = family.config_from_hf(source.config)
    model = build_gpt_moe(config, dims)
    load_hf_weights(model, family, config, source.tensor, source.shape)
    model.eval()
    tokens = torch.randint(
        0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        local = _forward_through_stages(model, tokens, config.hidden_size)
        if local is None:
            return {}  # not the last pipeline stage
        tp = parallel_state.get_tensor_model_parallel_world_size()
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
        megatron_logits = torch.cat(parts, dim=-1)
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        hf_logits = reference(tokens).logits
    return {
        "max_abs_diff": float((megatron_logits - hf_logits).abs().max()),
        "logit_scale": float(hf_logits.abs().max()),
    }


def _forward_through_stages(
    model: torch.nn.Module, tokens: torch.Tensor, hidden_size: int
) -> torch.Tensor | None:
    """This stage's part of the forward: the previous stage's hidden states `[s, b, h]` in,
    this stage's out to the next one; the logits on the last stage, None elsewhere."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    if not parallel_state.is_pipeline_first_stage():
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], hidden_size)
        dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    output = model(tokens, positions, attention_mask=None)
    if parallel_state.is_pipeline_last_stage():
        return output
    dist.send(output.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
    return None


def convert_both_ways(launch: LaunchEnv, hf_dir: str, workdir: str, layout: dict) -> dict:
    """hf-to-mcore into WORKDIR/mcore and back into WORKDIR/hf-again (loading a part per
    tensor); and into WORKDIR/whole-model what the conversions wrote before they streamed:
    megatron-core's own save of the model filled from the Hugging Face files (`weights/`), and
    the export of that live model (`hf/`). Returns the tensors mcore-to-hf copied file to file."""
    dims = _dims(launch, layout)
    init_distributed(dims, launch)
    ckpt, back = Path(workdir) / "mcore", Path(workdir) / "hf-again"
    source = inspect_hf(Path(hf_dir))
    hf_to_mcore(source, ckpt, dims, progress=False)
    copied = mcore_to_hf(ckpt, back, dims, max_shard_bytes=40_000, part_bytes=1, progress=False)
    whole = Path(workdir) / "whole-model"
    model = build_gpt_moe(source.config, dims, initialize=False)
    read = source.checkpoint
    load_hf_weights(model, source.family, source.config, read.tensor, read.shape)
    if dist.get_rank() == 0:
        (whole / "weights").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(model_sharded_state_dict(model), str(whole / "weights"))
    export_hf(
        model, source.family, source.config, Path(hf_dir), whole / "hf", max_shard_bytes=40_000
    )
    return {"copied": copied}


def parts_held(launch: LaunchEnv, hf_dir: str, workdir: str) -> list[tuple[str, list[str]]]:
    """One process: the export's part-by-part load with a part per tensor, followed as the
    stream reads the model: each tensor as it is read, with the tensors read so far that hold
    memory."""
    dims = _dims(launch, {})
    init_distributed(dims, launch)
    ckpt = Path(workdir) / "mcore"
    hf_to_mcore(inspect_hf(Path(hf_dir)), ckpt, dims, progress=False)
    metadata = read_metadata(ckpt)
    family, config = metadata.family, metadata.config
    model = build_gpt_moe(config, dims, initialize=False)
    order = bind_rules(family, config)
    parts = PartByPart(model, ckpt, metadata.format_version, order, part_bytes=1)
    tensors = {
        global_name(model, local): tensor
        for local, tensor in model.state_dict(keep_vars=True).items()
        if isinstance(tensor, torch.Tensor)
    }
    report: list[tuple[str, list[str]]] = []

    def before_tensor(name: str) -> None:
        parts.before_tensor(name)
        read = [entry for entry, _ in report] + [name]
        report.append((name, [n for n in read if _holds_memory(tensors[n])]))

    for _ in stream_hf_weights(model, family, config, before_tensor=before_tensor):
        pass
    return report


def _holds_memory(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has memory of its own size (PartByPart's placeholders hold one element)."""
    return tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size()


def convert_across_layouts(
    launch: LaunchEnv,
    hf_dir: str,
    workdir: str,
    save_layout: dict,
    export_layout: dict,
    format_version: int,
) -> dict:
    """hf-to-mcore at `save_layout`, rewritten in checkpoint format `format_version` (as an older
    megatron-rl wrote it), then mcore-to-hf at `export_layout`; returns the saved tensor keys
    and the tensors the export copied file to file."""
    dims = _dims(launch, save_layout)
    init_distributed(dims, launch)
    ckpt, back = Path(workdir) / "mcore", Path(workdir) / "hf-again"
    hf_to_mcore(inspect_hf(Path(hf_dir)), ckpt, dims, progress=False)
    metadata = read_metadata(ckpt)
    if format_version != metadata.format_version:
        model = build_gpt_moe(metadata.config, dims, initialize=False)
        wanted = model_sharded_state_dict(model, metadata.format_version)
        model.load_state_dict(dist_checkpointing.load(wanted, str(ckpt / "weights")))
        older = Path(workdir) / "weights-older"
        if dist.get_rank() == 0:
            older.mkdir()
        dist.barrier()
        dist_checkpointing.save(model_sharded_state_dict(model, format_version), str(older))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(ckpt / "weights")
            older.rename(ckpt / "weights")
            fields = json.loads((ckpt / METADATA).read_text())
            (ckpt / METADATA).write_text(json.dumps(fields | {"format": format_version}))
            (ckpt / MANIFEST).unlink()  # no checksums then
        dist.barrier()
    saved_keys = sorted(dist_checkpointing.load_tensors_metadata(str(ckpt / "weights")))
    dims = _dims(launch, export_layout)
    init_distributed(dims, launch)  # megatron-core's groups made again for the export layout
    copied = mcore_to_hf(ckpt, back, dims, max_shard_bytes=40_000, progress=False)
    return {"saved_keys": saved_keys, "copied": copied}


def stream_report(launch: LaunchEnv, hf_dir: str, layout: dict, bucket_bytes: int) -> dict:
    dims = _dims(launch, layout)
    init_distributed(dims, launch)
    source = HFCheckpoint(hf_dir)
    family = family_for(source.config)
    config = family.config_from_hf(source.config)
    model = build_gpt_moe(config, dims)
    load_hf_weights(model, family, config, source.tensor, source.shape)
    buckets = []
    for bucket in stream_hf_weights(model, family, config, bucket_bytes=bucket_bytes):
        buckets.append(
            [
                (name, tuple(t.shape), bool(torch.equal(t, source.tensor(name))))
                for name, t in bucket
            ]
        )
    sizes = [sum(source.tensor(name).numel() * 4 for name, _, _ in bucket) for bucket in buckets]
    return {"buckets": buckets, "bucket_sizes": sizes}
