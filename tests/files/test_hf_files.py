"""The streaming safetensors writer: files the safetensors library reads back exactly, sharding,
and announced-vs-arrived checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.files.safetensors_shards import (
    TensorSpec,
    plan_shards,
    shard_file_sizes,
    write_safetensors_shards,
)


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 8, generator=gen),
        "b.weight": torch.randn(3, generator=gen).to(torch.bfloat16),
        "c.weight": torch.randint(0, 9, (2, 5), generator=gen),
        "d.weight": torch.randn(16, 16, generator=gen),
    }


def _specs(tensors):
    return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def test_written_shards_read_back_exactly(tmp_path):
    tensors = _tensors()
    sizes = []
    weight_map = write_safetensors_shards(
        tmp_path,
        _specs(tensors),
        iter(tensors.items()),
        max_shard_bytes=200,
        on_tensor=sizes.append,
    )
    assert sizes == [t.numel() * t.element_size() for t in tensors.values()]
    files = sorted(set(weight_map.values()))
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    # a + b = 134 bytes; c (80) would pass 200: next shard; d (1024) exceeds a shard: alone
    assert [sorted(n for n, f in weight_map.items() if f == file) for file in files] == [
        ["a.weight", "b.weight"],
        ["c.weight"],
        ["d.weight"],
    ]
    for name, tensor in tensors.items():
        with safe_open(str(tmp_path / weight_map[name]), framework="pt") as handle:
            read = handle.get_tensor(name)
        assert read.dtype == tensor.dtype and torch.equal(read, tensor)
    # the sizes known before writing (what a full disk's message says is needed)
    written = [(tmp_path / file).stat().st_size for file in files]
    assert shard_file_sizes(_specs(tensors), 200) == written
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(sizes)
    (tmp_path / "config.json").write_text("{}")
    checkpoint = HFCheckpoint(tmp_path)
    assert checkpoint.names() == set(tensors)
    assert checkpoint.shape("a.weight") == (4, 8)


def test_plan_shards():
    specs = [TensorSpec(str(i), (n,), torch.uint8) for i, n in enumerate([5, 5, 20, 1, 1])]
    assert [[s.name for s in shard] for shard in plan_shards(specs, 10)] == [
        ["0", "1"],
        ["2"],
        ["3", "4"],
    ]


def test_order_shape_and_completeness_are_checked(tmp_path):
    tensors = _tensors()
    specs = _specs(tensors)
    swapped = [("b.weight", tensors["b.weight"]), ("a.weight", tensors["a.weight"])]
    with pytest.raises(ValueError, match=r"'b\.weight' .* arrived where 'a\.weight'"):
        write_safetensors_shards(tmp_path, specs, iter(swapped), max_shard_bytes=1 << 20)
    partial = list(tensors.items())[:2]
    with pytest.raises(ValueError, match=r"'c\.weight' was announced but never arrived"):
        write_safetensors_shards(tmp_path, specs, iter(partial), max_shard_bytes=1 << 20)
    extra = [*tensors.items(), ("e.weight", torch.ones(1))]
    with pytest.raises(ValueError, match=r"'e\.weight' was not announced"):
        write_safetensors_shards(tmp_path, specs, iter(extra), max_shard_bytes=1 << 20)


def test_the_byte_ranges_prefetched_hold_each_tensor(tmp_path):
    """`HFCheckpoint.prefetch` asks the kernel for each tensor's bytes where the file holds
    them: read there, they are the tensor."""
    tensors = _tensors()
    write_safetensors_shards(tmp_path, _specs(tensors), iter(tensors.items()), max_shard_bytes=200)
    (tmp_path / "config.json").write_text("{}")
    checkpoint = HFCheckpoint(tmp_path)
    checkpoint.prefetch(tensors)
    for name, tensor in tensors.items():
        path = checkpoint._path(name)
        start, end = checkpoint._byte_ranges(path)[name]
        with open(path, "rb") as file:
            file.seek(start)
            stored = file.read(end - start)
        assert stored == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
    with pytest.raises(ValueError, match=r"tensor 'e\.weight' is missing from the checkpoint"):
        checkpoint.prefetch(["e.weight"])
