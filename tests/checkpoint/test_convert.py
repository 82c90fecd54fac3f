"""Hugging Face <-> Megatron-Core conversion for Qwen3-MoE and Mixtral: logits agree, the round
trip is bit-exact, the weight stream yields every tensor once, at 1 process and TP=2 / EP=2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint import convert_worker
from tests.checkpoint.tiny_hf import save_tiny
from tests.parallel.harness import run_on_ranks

LAYOUTS = {
    "single": ({}, 1),
    "tp2": ({"tp": 2}, 2),
    "ep2": ({"ep": 2}, 2),
    "tp2_ep2": ({"tp": 2, "ep": 2, "etp": 1}, 2),  # attention split by TP, experts by EP
}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def hf_dir(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param) / "hf")


def _all_tensors(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_of_converted_model_match_hugging_face(hf_dir, layout):
    dims, world = LAYOUTS[layout]
    for report in run_on_ranks(convert_worker.logits_match, str(hf_dir), dims, world_size=world):
        assert report["logit_scale"] > 0.1
        assert report["max_abs_diff"] <= 1e-4, report


@pytest.mark.parametrize("layout", ["single", "tp2_ep2"])
def test_round_trip_is_bit_exact(hf_dir, layout, tmp_path):
    dims, world = LAYOUTS[layout]
    run_on_ranks(
        convert_worker.convert_both_ways, str(hf_dir), str(tmp_path), dims, world_size=world
    )
    back = tmp_path / "hf-again"
    original, converted = _all_tensors(hf_dir), _all_tensors(back)
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert converted[name].shape == tensor.shape, name
        assert converted[name].dtype == tensor.dtype, name
        assert torch.equal(converted[name], tensor), name
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    assert (back / "tokenizer_config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.mark.parametrize("layout", ["single", "tp2_ep2"])
def test_stream_yields_every_tensor_once_within_the_bucket_size(hf_dir, layout):
    layout, world = LAYOUTS[layout]
    bucket_bytes = 20_000
    reports = run_on_ranks(
        convert_worker.stream_report, str(hf_dir), layout, bucket_bytes, world_size=world
    )
    streamed = [entry for bucket in reports[0]["buckets"] for entry in bucket]
    names = [name for name, _, _ in streamed]
    original = _all_tensors(hf_dir)
    assert sorted(names) == sorted(original)  # every tensor, exactly once
    assert all(same for _, _, same in streamed)
    assert all(shape == tuple(original[name].shape) for name, shape, _ in streamed)
    for bucket, size in zip(reports[0]["buckets"], reports[0]["bucket_sizes"], strict=True):
        assert size <= bucket_bytes or len(bucket) == 1
    assert len(reports[0]["buckets"]) > 3
    for other in reports[1:]:
        assert other["buckets"] == []  # only the destination rank yields
