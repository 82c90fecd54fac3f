"""What makes a directory a megatron-rl checkpoint, and how its weights are keyed.

    megatron_rl.json   format version, model family, the MoEModelConfig
    hf/                the source config.json and tokenizer files (used again on export)
    weights/           megatron-core dist_checkpointing files (loadable at any TP/EP/PP)
    checksums.json     every other file's length and CRC-32, written last
                       (`megatron_rl.files.checksums`; absent from checkpoints saved before it)

Conversions (`convert.py`) and training checkpoints (`megatron_rl.trainer.checkpoints`) both
write this layout.
"""

from __future__ import annotations

import errno
import json
import queue
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_rl.files.checksums import (
    FileChecksum,
    file_checksums,
    record_checksums,
    verify_checksums,
)
from megatron_rl.files.distcp import PartLoads, StreamingSave, TensorValues, check_weights
from megatron_rl.files.file_ranges import FileRange
from megatron_rl.files.hf_checkpoint import asset_files, copy_assets
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import FAMILIES
from megatron_rl.models.families.base import ModelFamily
from megatron_rl.models.hf_weights import global_name
from megatron_rl.process import children
from megatron_rl.process.stop import STOPS

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


# megatron-core's writer hands its results back through a queue that it creates once per process
# in a spawned multiprocessing.Manager: a server process (with a resource tracker beside it) that
# stays until the process exits and, after a SIGKILL, for ever. Every save here is synchronous,
# so the queue never leaves this process, and an in-process one carries the results.
filesystem_async._results_queue = queue.Queue()


def save_weights(
    state: ShardedStateDict, weights_dir: Path, values: TensorValues | None = None
) -> dict[str, FileChecksum]:
    """`dist_checkpointing.save` of `state` into `weights_dir` (a collective); returns the
    checksums of the data files this rank wrote, by name in `weights_dir`. With `values`, the
    values of those tensors are made as they are written, by this process, item by item
    (`megatron_rl.files.distcp.StreamingSave`: the same files), which hashes them as it writes
    them; without, megatron-core's own writer processes write the state as it is, and are
    killed when the save is cut (an error, a stop signal). A save that failed for want of
    space says so (megatron-core's writers report it as a bare position mismatch)."""
    children.forks_die_with_this_process()
    strategy = None if values is None else StreamingSave(values)
    try:
        dist_checkpointing.save(state, str(weights_dir), sharded_strategy=strategy)
    except BaseException as error:
        children.kill_forked()
        # torch.distributed.checkpoint's CheckpointException is a BaseException, not an Exception
        if not isinstance(error, STOPS):
            _raise_if_out_of_space(state, weights_dir)
        raise
    if strategy is not None:
        return strategy.checksums
    # megatron-core's writers are processes of their own that open and write the files
    # themselves (FileSystemWriterAsync.write_preloaded_data), with no hook through which the
    # bytes could be hashed on their way: this rank's files (named `__RANK_N.distcp` by its
    # writer) are read once more, now, while their bytes are still in the page cache.
    rank = dist.get_rank() if dist.is_initialized() else 0
    return file_checksums(weights_dir, sorted(p.name for p in weights_dir.glob(f"__{rank}_*")))


def record_checksums_of_every_rank(ckpt: Path, mine: Mapping[str, FileChecksum]) -> None:
    """Checkpoint `ckpt`'s MANIFEST (`megatron_rl.files.checksums`), written by rank 0 once
    every rank has written its files (a collective): `mine` are the checksums of the files
    this rank wrote and hashed (paths relative to `ckpt`); the others (rank 0's small files:
    metadata, config, tokenizer) are read and hashed there."""
    every = [dict(mine)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, dict(mine))
    if not dist.is_initialized() or dist.get_rank() == 0:
        record_checksums(ckpt, {name: sum_ for sums in every for name, sum_ in sums.items()})


def verify_checkpoint(ckpt: Path, *, past_page_cache: bool = False) -> bool:
    """Check every file of checkpoint `ckpt` against what was saved, reading it once: the
    weights' lengths against their index (`check_weights`), then every file's checksum
    (`verify_checksums`, `past_page_cache` where its bytes are not read again from the page
    cache); a ValueError names the first damaged file. Returns False for a checkpoint saved
    before checksums were recorded (its lengths alone were checked)."""
    check_weights(ckpt)
    return verify_checksums(ckpt, past_page_cache=past_page_cache)


def _raise_if_out_of_space(state: ShardedStateDict, weights_dir: Path) -> None:
    needed = sum(tensor.nbytes for tensor in _local_tensors(state))
    free = shutil.disk_usage(weights_dir).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"no space left for the checkpoint (this rank writes about {needed / 2**20:.0f} "
            f"MiB, {free / 2**20:.0f} MiB are free)",
            str(weights_dir),
        ) from None


def _local_tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors of this rank's shards in a (nested) sharded state dict."""
    if isinstance(state, dict):
        for value in state.values():
            yield from _local_tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _local_tensors(value)
    elif isinstance(getattr(state, "data", None), torch.Tensor):
        yield state.data


def load_weights(state: ShardedStateDict, ckpt: Path) -> dict[str, Any]:
    """`dist_checkpointing.load` of `state` from checkpoint `ckpt`'s weights, checked first
    (`check_weights`) so that a damaged file is named rather than met as an EOFError."""
    check_weights(ckpt)
    return dist_checkpointing.load(state, str(ckpt / "weights"))


class PartByPart:
    """The weights of checkpoint `ckpt` (format `format_version`) loaded into `model` a part at a
    time, in the order a weight stream reads them: `before_tensor` is the stream's hook
    (`stream_hf_weights(..., before_tensor=...)`). Loading a part releases the one before it
    (its memory is freed once the stream has handed its tensors on), so that this rank holds one
    part of at least `part_bytes` (a larger tensor alone), not its whole model.

    The model's tensors are given placeholders of their shapes that hold no memory
    (`_placeholder`), and a part's tensors get memory only while the part is loaded: memory the
    part before has just freed, which the allocator hands out again. The memory the model was
    built with is kept, untouched (address space, not memory): freed, the allocator would hand
    out its pages one part after another, touching new memory for every part and keeping it.

    `order` is the stream's order of global tensor names (the family's rules); a rank takes
    the names it holds. No collective: each rank loads its own parts when its stream needs them.

    `unchanged` names, by tensor, byte ranges `(name, start, end)` of it that are only copied
    elsewhere as they are stored (`megatron_rl.models.hf_weights.unchanged_ranges`). Those
    stored unchanged are not read: `located` gives their places in the checkpoint's files, by
    name, from the time their part is loaded; their memory is left as it is.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ckpt: Path,
        format_version: int,
        order: Iterable[str],
        part_bytes: int,
        unchanged: Mapping[str, list[tuple[str, int, int]]] | None = None,
    ) -> None:
        self.weights_dir = ckpt / "weights"
        self.strategy = PartLoads(self.weights_dir, check_weights(ckpt))
        self.unchanged = unchanged or {}
        # the model's tensors (parameters, persistent buffers) under the sharded state dict's keys
        mine = {
            global_name(model, local): (local, value)
            for local, value in model.state_dict(keep_vars=True).items()
            if isinstance(value, torch.Tensor)
        }
        self.built_with = [tensor.data for _, tensor in mine.values()]  # kept, never touched
        for _, tensor in mine.values():
            tensor.data = _placeholder(tensor)
        state = model_sharded_state_dict(model, format_version)
        self.part_of: dict[str, int] = {}
        self.parts: list[dict[str, Any]] = []  # each part's entries of the sharded state dict
        self.tensors: list[list[tuple[str, str, torch.Tensor]]] = []  # local, global name
        size = part_bytes
        for name in order:
            if name not in mine:
                continue
            local, tensor = mine[name]
            if size >= part_bytes:
                self.parts.append({})
                self.tensors.append([])
                size = 0
            entry = state[local]
            if isinstance(entry, ShardedTensorFactory) and _is_swiglu_merge(entry.merge_fn):
                entry.merge_fn = _merged_in_place(entry.merge_fn)
            self.parts[-1][local] = entry
            self.tensors[-1].append((local, name, tensor))
            size += tensor.numel() * tensor.element_size()
            self.part_of[name] = len(self.parts) - 1
        self.loaded: int | None = None

    def before_tensor(self, name: str) -> None:
        part = self.part_of.get(name)
        if part is None or part == self.loaded:
            return
        if not self.parts[part]:
            raise RuntimeError(
                f"{name}: its part was loaded and released before; the stream "
                "reads the tensors in another order than the one given"
            )
        if self.loaded is not None:
            for _, _, tensor in self.tensors[self.loaded]:
                tensor.data = _placeholder(tensor)
        unread = {}
        for _, name, tensor in self.tensors[part]:
            tensor.data = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            for hf_name, start, end in self.unchanged.get(name, ()):
                unread[(tensor.data_ptr() + start, tensor.data_ptr() + end)] = hf_name
        self.strategy.locate_instead(unread)
        loaded = dist_checkpointing.load(
            self.parts[part],
            str(self.weights_dir),
            sharded_strategy=self.strategy,
            # its check exchanges every rank's shards: ranks load their parts on their own
            validate_access_integrity=False,
        )
        for local, _, tensor in self.tensors[part]:
            tensor.data = loaded[local]
        self.parts[part] = {}  # its entries hold views of the part's tensors
        self.loaded = part

    @property
    def located(self) -> dict[str, list[FileRange]]:
        """Where the unchanged byte ranges of the parts loaded so far are, by name."""
        return self.strategy.located


# megatron-core's merge of a SwiGLU weight's two loaded halves: `torch.cat` of them on dim 0.
_SWIGLU_MERGE = "apply_swiglu_sharded_factory.<locals>.sh_ten_merge_fn"


def _is_swiglu_merge(merge: Callable[..., Any]) -> bool:
    return getattr(merge, "__qualname__", None) == _SWIGLU_MERGE


def _merged_in_place(merge: Callable[[list[torch.Tensor]], torch.Tensor]) -> Callable:
    """megatron-core's SwiGLU `merge`, without its copy when the halves lie one after the other
    in one memory, as they do when loaded into the halves of the model's own tensor: that
    memory, as one tensor. A copy would touch memory (a part's worth) that nothing needs, and
    read the halves whose bytes were left unread (`unchanged`)."""

    def merged(halves: list[torch.Tensor]) -> torch.Tensor:
        first = halves[0]
        address = first.data_ptr()
        for half in halves:
            consecutive = (
                half.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and half.is_contiguous()
                and half.data_ptr() == address
                and half.dtype == first.dtype
                and half.shape[1:] == first.shape[1:]
            )
            if not consecutive:
                return merge(halves)
            address += half.nbytes
        rows = sum(half.shape[0] for half in halves)
        whole = torch.empty(0, dtype=first.dtype, device=first.device)
        return whole.set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))

    return merged


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of `tensor`'s shape, dtype and device that holds one element (expanded)."""
    return torch.empty((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


def write_metadata(ckpt: Path, family: ModelFamily, config: MoEModelConfig, hf_dir: Path) -> None:
    """What makes `ckpt` (with its model in `weights/`) a megatron-rl checkpoint: METADATA and
    `hf/` (config.json and tokenizer files of the Hugging Face checkpoint `hf_dir`)."""
    (ckpt / "hf").mkdir()
    shutil.copy2(hf_dir / "config.json", ckpt / "hf")
    assets = asset_files(hf_dir)
    copy_assets(assets, ckpt / "hf")
    metadata = {
        "format": FORMAT_VERSION,
        "architecture": family.architecture,
        "model": asdict(config),
        "hf_files": ["config.json", *(path.name for path in assets)],
    }
    (ckpt / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")


@dataclass(frozen=True)
class CheckpointMetadata:
    """What `megatron_rl.json` says about a checkpoint."""

    family: ModelFamily
    config: MoEModelConfig
    format_version: int


def read_metadata(ckpt: Path, *, given_as: str | None = None) -> CheckpointMetadata:
    """The metadata of checkpoint `ckpt`, checked; `given_as` is how the user named it (e.g.
    `--ckpt`), for error messages."""
    named = f"{given_as} {ckpt}" if given_as else str(ckpt)
    path = ckpt / METADATA
    if not path.is_file():
        raise ValueError(f"{named}: no {METADATA}; not a megatron-rl checkpoint")
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
        raise ValueError(f"{named}: the weights/ directory is missing")
    # Checkpoints from before the field existed name no files; config.json is in every one.
    expected = metadata.get("hf_files", ["config.json"])
    missing = [name for name in expected if not (ckpt / "hf" / name).is_file()]
    if missing:
        raise ValueError(
            f"{named}: hf/ lacks {', '.join(missing)} (written with the checkpoint); it is "
            "incomplete"
        )
    return CheckpointMetadata(FAMILIES[architecture], config, version)
