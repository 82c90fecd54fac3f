"""A megatron-core distributed checkpoint's files (`weights/` of a megatron-rl checkpoint): checked
before they are read, written item by item, and read in parts with their index read once.

    weights/metadata.json   megatron-core's: which strategy wrote it
    weights/common.pt       megatron-core's: the state every rank shares
    weights/.metadata       torch.distributed.checkpoint's index: each item's file and byte range
    weights/__R_T.distcp    the data, one file per rank and writer

`check_weights` names a damaged file rather than letting it surface as an EOFError deep in
torch.distributed.checkpoint.

`StreamingSave` writes megatron-core's own `torch_dist` format: its planner, its file names and
its items in its order within each file, so that the files are byte for byte those its own save
writes. But a tensor's value can be made only when its first item is written (`TensorValue`),
and is dropped after its last one, in this process; what the next values read is prefetched.
megatron-core's writer first resolves every tensor, cloning each one that is a view (SwiGLU's
fc1 halves are two views of one weight), then forks writer processes that hold all of it, and
passes their results through a queue: a conversion that has its whole model in memory needs
more than twice the model's size.

`PartLoads` is megatron-core's `torch_dist` load for many parts of one checkpoint: the index,
whose reading grows with the number of items (16,000 in the benchmark's 7.35 GiB checkpoint,
docs/conversion.md), is read once, not once per part; each part's bytes are asked of the disk
at once. Where a caller will only copy some of a tensor's bytes elsewhere, unchanged, it names
them (`locate_instead`), and they are found in the files rather than read (`located`).
"""

from __future__ import annotations

import bisect
import json
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    FileSystemWriterAsync,
    _split_by_size_and_type,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.utils import nested_values
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _write_item
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_rl.files.atomic import flush_to_disk
from megatron_rl.files.checksums import FileChecksum, HashingWriter
from megatron_rl.files.file_ranges import FileRange, OpenFiles
from megatron_rl.files.listed_names import listed_path
from megatron_rl.files.plain_data import NotPlainData, load_plain_data, read_distcp_index
from megatron_rl.files.readahead import read_ahead
from megatron_rl.files.torch_records import stored_tensor
from megatron_rl.files.write_behind import WriteBehind
from megatron_rl.parallel.collectives import raise_together

# megatron-core's strategy as its metadata.json names it: its loader reads what StreamingSave
# writes.
BACKEND, BACKEND_VERSION = "torch_dist", 1
# Files per rank: megatron-core's default (its writer's `thread_count`), so that the files and
# the items in each are the ones its own save writes.
FILES_PER_RANK = 2


def check_weights(ckpt: Path) -> Metadata:
    """Raise a ValueError naming the file when checkpoint `ckpt`'s `weights/` is incomplete:
    megatron-core's metadata.json and common.pt, torch.distributed.checkpoint's index
    (`.metadata`), and every data file at least as long as the index says, inside `weights/`.
    common.pt and the index are read as plain data (`megatron_rl.files.plain_data`): one that
    names anything else is refused (`NotPlainData`) before megatron-core or torch reads it.
    Returns the index."""
    weights = ckpt / "weights"
    readers = {
        "metadata.json": lambda: json.loads((weights / "metadata.json").read_text()),
        "common.pt": lambda: load_plain_data(weights / "common.pt"),
        ".metadata": lambda: read_distcp_index(weights / ".metadata"),
    }
    contents = {}
    for name, read in readers.items():
        if not (weights / name).is_file():
            raise ValueError(f"{weights / name}: missing; {ckpt} is not a complete checkpoint")
        try:
            contents[name] = read()
        except NotPlainData:
            raise
        except Exception as error:
            reason = f"{type(error).__name__}: {str(error).split('. ')[0]}"
            raise ValueError(f"{weights / name}: damaged ({reason}); {ckpt} is unusable") from None
    needed: dict[str, int] = {}
    for info in contents[".metadata"].storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = listed_path(weights, name, weights / ".metadata", "storage_data")
        if not path.is_file():
            raise ValueError(f"{path}: missing; {ckpt} is not a complete checkpoint")
        if path.stat().st_size < size:
            raise ValueError(
                f"{path}: truncated ({path.stat().st_size} bytes, its index needs {size}); "
                f"{ckpt} is damaged"
            )
    return contents[".metadata"]


@dataclass(frozen=True)
class TensorValue:
    """A state-dict tensor whose value is made when it is written."""

    tensor: torch.Tensor  # as the state dict holds it: the value's shape and dtype
    make: Callable[[], torch.Tensor]  # its value (converted to the dtype), called once
    prefetch: Callable[[], None]  # called before `make`: start reading what `make` reads


TensorValues = Mapping[int, TensorValue]
"""By the address of each tensor's storage (`tensor.untyped_storage().data_ptr()`). A tensor
of the state dict not in the mapping is written as it is."""

# How far ahead of the writing the values are prefetched: the disk reads what is made next
# while this process serializes and writes (a quarter of a second of a 1 GB/s disk).
PREFETCH_BYTES = 256 * 2**20


class StreamingSave(SaveShardedStrategy):
    """megatron-core's `torch_dist` save written item by item in this process (see the module
    docstring): `dist_checkpointing.save(state, path, sharded_strategy=StreamingSave(values))`.
    A collective; if it fails on one rank, every rank raises before the index is written."""

    def __init__(self, values: TensorValues) -> None:
        super().__init__(BACKEND, BACKEND_VERSION)
        self.values = values
        self.checksums: dict[str, FileChecksum] = {}

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True  # as megatron-core's torch_dist: objects go into the same files

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Write this rank's files; their checksums, hashed as they were written, are then in
        `checksums` (by file name)."""
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True
        )
        writer = _ItemWriter(Path(checkpoint_dir), self.values)
        planned, *_ = save_state_dict_async_plan(
            mcore_to_pyt_state_dict(by_key, is_loading=False),
            writer,
            None,
            0,
            planner=MCoreSavePlanner(flatten_state_dict=False),
        )
        raise_together(writer.write)
        save_state_dict_async_finalize(*planned)
        self.checksums = writer.checksums


@dataclass
class _File:
    """A data file of this rank: its name, its items in order, what writing them returned."""

    name: str
    items: list[WriteItem]
    results: list[WriteResult] = field(default_factory=list)


@dataclass
class _Made:
    """A tensor's value while items of it remain to be written."""

    value: torch.Tensor | None
    items_left: int


class _ItemWriter(FileSystemWriterAsync):
    """The files megatron-core's writer would write, with the same items in the same order,
    written by `write` in this process."""

    def __init__(self, path: Path, values: TensorValues) -> None:
        super().__init__(path, thread_count=FILES_PER_RANK)
        self.values = values
        self.files: list[_File] = []
        self.planner: SavePlanner | None = None
        self.checksums: dict[str, FileChecksum] = {}  # by file name, once written

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        # megatron-core's split of the items into files, and its file names; nothing is read
        buckets = _split_by_size_and_type(self.thread_count, plan.items)
        prefix = plan.storage_data.prefix
        self.files = [
            _File(f"{prefix}{index}{DEFAULT_SUFFIX}", items)
            for index, items in enumerate(items for items in buckets if items)
        ]
        self.planner = planner

    def _in_turn(self) -> list[tuple[_File, WriteItem]]:
        """Every item, one from each file in turn: each file keeps its order, and the halves of
        one tensor, which the split puts into the files in turn (as it does all items of equal
        size), are written one after the other, so that its value is held briefly."""
        longest = max((len(file.items) for file in self.files), default=0)
        return [
            (file, file.items[position])
            for position in range(longest)
            for file in self.files
            if position < len(file.items)
        ]

    def write(self) -> None:
        """Write every item, then flush each file to the disk: each file by a thread of its own
        (`WriteBehind`), while this thread makes the values they write. Each file's bytes are
        hashed as they are written (`checksums`)."""
        assert self.planner is not None, "planned by save_state_dict_async_plan first"
        order = [(file, item, self.planner.resolve_data(item)) for file, item in self._in_turn()]
        made: dict[int, _Made] = {}
        for _, _, data in order:
            address = _address(data)
            if address in self.values:
                made.setdefault(address, _Made(None, 0)).items_left += 1
        self.upcoming = deque(made)  # in the order of their first items
        self.prefetched = 0  # bytes prefetched and not yet made
        self._prefetch_ahead()
        with ExitStack() as stack, WriteBehind(lanes=len(self.files)) as behind:
            streams = {
                file.name: (
                    lane,
                    stack.enter_context(HashingWriter(Path(self.checkpoint_dir) / file.name)),
                )
                for lane, file in enumerate(self.files)
            }
            for file, item, data in order:
                address = _address(data)
                if address in made:
                    data = self._made_view(data, address, made, item)
                elif isinstance(data, torch.Tensor) and data.device.type != "cpu":
                    data = data.cpu()  # torch.save here writes host memory
                nbytes = 0
                if isinstance(data, torch.Tensor):
                    data, nbytes = _own_storage(data), _nbytes(data)
                lane, stream = streams[file.name]
                behind.put(lane, partial(self._write_item, file, stream, item, data), nbytes)
            for lane, stream in streams.values():
                behind.put(lane, partial(flush_to_disk, stream))
        self.checksums = {name: stream.checksum for name, (_, stream) in streams.items()}

    def _write_item(self, file: _File, stream: HashingWriter, item: WriteItem, data: Any) -> None:
        result = _write_item(
            self.transforms, stream, data, item, file.name, SerializationFormat.TORCH_SAVE
        )
        file.results.append(result)

    def _made_view(
        self, data: torch.Tensor, address: int, made: dict[int, _Made], item: WriteItem
    ) -> torch.Tensor:
        """`data`, a view of a state-dict tensor whose value is made: the same view of the
        value, made now if this is its first item and dropped after its last."""
        tensor = self.values[address].tensor
        entry = made[address]
        if entry.value is None:
            value = self.values[address].make()
            self.prefetched -= _nbytes(tensor)
            self._prefetch_ahead()
            if value.shape != tensor.shape:
                raise ValueError(
                    f"{item.index.fqn}: its value is {list(value.shape)}, the state dict's "
                    f"tensor {list(tensor.shape)}"
                )
            # in the tensor's own dtype, as copying the value into it would give, in host memory
            entry.value = value.to("cpu", tensor.dtype).contiguous()
        view = _same_view(data, tensor, entry.value)
        entry.items_left -= 1
        if entry.items_left == 0:
            del made[address]
        return view

    def _prefetch_ahead(self) -> None:
        while self.upcoming and self.prefetched < PREFETCH_BYTES:
            value = self.values[self.upcoming.popleft()]
            value.prefetch()
            self.prefetched += _nbytes(value.tensor)

    def retrieve_write_results(self) -> list[WriteResult]:
        return [result for file in self.files for result in file.results]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _address(data: Any) -> int | None:
    return data.untyped_storage().data_ptr() if isinstance(data, torch.Tensor) else None


def _same_view(view: torch.Tensor, base: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The view of `value` (contiguous, `base`'s shape) that `view` is of `base`."""
    if not base.is_contiguous():
        raise ValueError(f"a state-dict tensor {list(base.shape)} is not contiguous")
    offset = view.storage_offset() - base.storage_offset()
    return value.as_strided(view.shape, view.stride(), value.storage_offset() + offset)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with a storage of exactly its own bytes, which is what torch.save writes: itself,
    the same memory under a storage of its own when it is a contiguous view of a larger one (no
    copy), or else a clone (megatron-core's writer clones every view)."""
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.nbytes() == nbytes:
        return tensor
    if not tensor.is_contiguous():
        return tensor.clone()
    start = tensor.storage_offset() * tensor.element_size()
    own = torch.empty(0, dtype=tensor.dtype)
    return own.set_(storage[start : start + nbytes], 0, tensor.shape, tensor.stride())


_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class PartLoads(TorchDistLoadShardedStrategy):
    """megatron-core's `torch_dist` load of checkpoint parts, the checkpoint's index given (read
    once: `check_weights`): `dist_checkpointing.load(part, weights, sharded_strategy=this)`.
    Not a collective: a rank reads its parts alone."""

    def __init__(self, weights_dir: Path, index: Metadata) -> None:
        super().__init__()
        self.reader = _IndexedReader(weights_dir, index)

    def locate_instead(self, ranges: Mapping[tuple[int, int], str]) -> None:
        """For the next loads: memory address ranges `(start, end)` of the tensors to be loaded
        whose bytes are wanted only as they are stored, by name. A range whose bytes are stored
        unchanged in the files (each a whole item's tensor, in row-major order, of the same
        dtype) is left unread, and its name is given its places in the files in `located`;
        any other range is read as usual."""
        self.reader.instead = dict(ranges)

    @property
    def located(self) -> dict[str, list[FileRange]]:
        """Where the bytes of the ranges left unread are, in order, by the ranges' names."""
        return self.reader.located

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> dict:
        by_key, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state = mcore_to_pyt_state_dict(by_key, is_loading=True)
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        planner = MCoreLoadPlanner(shapes_validation_sharded_tensors=tensors)
        # no_dist: every rank reads its own parts when it needs them, no rank waits for another;
        # torch warns that it assumes a single process, as it does for every such load
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _NO_DIST_WARNING, UserWarning)
            dcp.load(pyt_state, storage_reader=self.reader, planner=planner, no_dist=True)
        loaded = {key: _unwrap_pyt_sharded_tensor(value) for key, value in pyt_state.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, sharded_state_dict)
        return loaded


class _IndexedReader(FileSystemReader):
    """torch.distributed.checkpoint's reader of `weights_dir`, with its index given."""

    def __init__(self, weights_dir: Path, index: Metadata) -> None:
        super().__init__(str(weights_dir))
        self.index = index
        self.instead: dict[tuple[int, int], str] = {}  # PartLoads.locate_instead
        self.located: dict[str, list[FileRange]] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.index

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Every item's bytes asked of the kernel at once before they are read one at a time:
        # the disk reads them in its own order, not one item's after the other's. Not those
        # located instead: the copy reads them, past the page cache (`RangeCopier`).
        items = self._locate(plan.items, planner) if self.instead else plan.items
        by_file: dict[Path, list[tuple[int, int]]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            by_file.setdefault(Path(self.path) / info.relative_path, []).append(
                (info.offset, info.length)
            )
        read_ahead(by_file)
        return super().read_data(replace(plan, items=items), planner)

    def _locate(self, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """`items` less those whose bytes fill ranges of `instead` exactly, whole stored
        tensors one after the other; each such range's places go into `located`."""
        ranges = sorted(self.instead)
        starts = [start for start, _ in ranges]
        pieces: dict[tuple[int, int], list[tuple[int, ReadItem, FileRange]]] = {}
        spoiled: set[tuple[int, int]] = set()  # ranges that some item must be read into
        with OpenFiles() as files:
            for item in items:
                if item.type != LoadItemType.TENSOR:
                    continue
                # as resolve_tensor, less megatron-core's state kept for its commit_tensor
                dest = planner.transform_tensor(item, planner.lookup_tensor(item.dest_index))
                if type(dest) is not torch.Tensor or dest.device.type != "cpu":
                    continue  # not in host memory, where the ranges are
                start, end = _span(dest)
                hit = []
                for r in islice(ranges, max(bisect.bisect_right(starts, start) - 1, 0), None):
                    if r[0] >= end:
                        break
                    if start < r[1]:
                        hit.append(r)
                if not hit:
                    continue
                data = self._stored_bytes(item, dest, files)
                whole = len(hit) == 1 and hit[0][0] <= start and end <= hit[0][1]
                if data is None or not whole:
                    spoiled.update(hit)
                else:
                    pieces.setdefault(hit[0], []).append((start, item, data))
        left_unread: set[int] = set()
        for (start, end), found in pieces.items():
            found.sort(key=lambda piece: piece[0])
            if (start, end) not in spoiled and _tiles(start, end, found):
                self.located[self.instead[(start, end)]] = [data for _, _, data in found]
                left_unread.update(id(item) for _, item, _ in found)
        return [item for item in items if id(item) not in left_unread]

    def _stored_bytes(
        self, item: ReadItem, dest: torch.Tensor, files: OpenFiles
    ) -> FileRange | None:
        """Where the bytes that `item` reads into `dest` are stored unchanged, if they are."""
        info = self.storage_data[item.storage_index]
        if info.transform_descriptors or any(item.storage_offsets) or not dest.is_contiguous():
            return None
        path = Path(self.path) / info.relative_path
        stored = stored_tensor(files.fd(path), path, info.offset, info.length)
        if stored is None or stored.shape != tuple(item.lengths) or stored.dtype != dest.dtype:
            return None
        return stored.data


def _tiles(start: int, end: int, pieces: list[tuple[int, ReadItem, FileRange]]) -> bool:
    """Whether `pieces` (by address, each with its length) fill `start`..`end` exactly."""
    position = start
    for address, _, data in pieces:
        if address != position:
            return False
        position += data.length
    return position == end


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The memory addresses `tensor`'s elements lie between (positive strides)."""
    strides = zip(tensor.shape, tensor.stride(), strict=True)
    last = sum((size - 1) * stride for size, stride in strides)
    if tensor.numel() == 0:
        last = -1
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()
