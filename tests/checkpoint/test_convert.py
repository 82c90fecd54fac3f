"""Hugging Face <-> Megatron-Core conversion for every family (Qwen3-MoE, Mixtral, DeepSeek-V3,
GLM-4.5): logits agree, the round trip is bit-exact, the weight stream yields every tensor once,
at 1 process, TP=2 with EP=2, and PP=2 (for DeepSeek-V3 and GLM-4.5 the first stage holds the
dense layer and an MoE layer), with untied and tied embeddings."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.checkpoint import convert_worker
from tests.checkpoint.tiny_hf import save_tiny
from tests.parallel.harness import run_on_ranks

LAYOUTS = {
    "single": ({}, 1),
    "tp2": ({"tp": 2}, 2),
    "ep2": ({"ep": 2}, 2),
    "tp2_ep2": ({"tp": 2, "ep": 2, "etp": 1}, 2),  # attention split by TP, experts by EP
    "pp2": ({"pp": 2}, 2),  # one layer per stage
}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"])
def hf_dir(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param) / "hf")


# Format 1 predates the families with dense layers: no checkpoint of theirs has it.
@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def format_1_hf_dir(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param) / "hf")


def _all_tensors(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


# tp2_ep2 splits the dense layers by TP and the experts by EP at once
@pytest.mark.parametrize("layout", ["single", "tp2_ep2", "pp2"])
def test_logits_of_converted_model_match_hugging_face(hf_dir, layout):
    dims, world = LAYOUTS[layout]
    reports = run_on_ranks(convert_worker.logits_match, str(hf_dir), dims, world_size=world)
    last_stages = [report for report in reports if report]  # only they have logits
    assert len(last_stages) == (1 if layout == "pp2" else world)
    for report in last_stages:
        assert report["logit_scale"] > 0.1
        assert report["max_abs_diff"] <= 1e-4, report


@pytest.mark.parametrize("layout", ["single", "tp2_ep2", "pp2"])
def test_round_trip_is_bit_exact(hf_dir, layout, tmp_path):
    dims, world = LAYOUTS[layout]
    reports = run_on_ranks(
        convert_worker.convert_both_ways, str(hf_dir), str(tmp_path), dims, world_size=world
    )
    back = tmp_path / "hf-again"
    _assert_same_tensors(back, hf_dir)
    _assert_experts_copied(reports[0]["copied"], hf_dir, all_of_them=layout == "single")
    # the files the conversions wrote before they streamed, byte for byte
    _assert_same_files(tmp_path / "mcore" / "weights", tmp_path / "whole-model" / "weights")
    _assert_same_files(back, tmp_path / "whole-model" / "hf")
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    assert (back / "tokenizer_config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.mark.parametrize("layout", ["single", "pp2"])
def test_tied_embeddings_round_trip_and_stream_once(layout, tmp_path):
    """A tied model: under PP the last stage holds a copy of the embedding as its output layer;
    the round trip writes the embedding once, and the stream yields it once."""
    hf_dir = save_tiny("qwen3_moe", tmp_path / "hf", tie_word_embeddings=True)
    dims, world = LAYOUTS[layout]
    run_on_ranks(
        convert_worker.convert_both_ways, str(hf_dir), str(tmp_path), dims, world_size=world
    )
    _assert_same_tensors(tmp_path / "hf-again", hf_dir)
    assert "lm_head.weight" not in _all_tensors(tmp_path / "hf-again")
    reports = run_on_ranks(
        convert_worker.stream_report, str(hf_dir), dims, 20_000, world_size=world
    )
    streamed = [entry for bucket in reports[0]["buckets"] for entry in bucket]
    assert sorted(name for name, _, _ in streamed) == sorted(_all_tensors(hf_dir))
    assert all(same for _, _, same in streamed)


_EXPERT = re.compile(r"\.experts\.\d+\.")


def _assert_experts_copied(copied, hf_dir, *, all_of_them):
    """The export copied expert weights from the checkpoint's files (all of them when one
    process holds every expert), and no fused QKV's parts (regrouped, so written)."""
    experts = {name for name in _all_tensors(hf_dir) if _EXPERT.search(name)}
    assert experts & set(copied)
    assert set(copied) <= set(_all_tensors(hf_dir))
    if all_of_them:
        assert experts <= set(copied)
    assert not [name for name in copied if name.endswith(("k_proj.weight", "v_proj.weight"))]


def _assert_same_files(directory, reference):
    """The same files, byte for byte; torch.distributed.checkpoint's index (`.metadata`) read,
    as it records where and when it was written."""
    names = sorted(path.name for path in reference.iterdir())
    assert sorted(path.name for path in directory.iterdir()) == names
    for name in names:
        if name == ".metadata":
            ours, theirs = (
                vars(FileSystemReader(str(d)).read_metadata()) for d in (directory, reference)
            )
            assert ours["storage_meta"].checkpoint_id != theirs["storage_meta"].checkpoint_id
            assert ours | {"storage_meta": None} == theirs | {"storage_meta": None}
        else:
            assert (directory / name).read_bytes() == (reference / name).read_bytes(), name


def test_the_export_holds_one_part_at_a_time(tmp_path):
    """mcore-to-hf loads its checkpoint a part at a time as the weight stream reads it: with a
    part per tensor, when the stream reads a tensor, no tensor read before it holds memory."""
    hf_dir = save_tiny("qwen3_moe", tmp_path / "hf")
    (report,) = run_on_ranks(convert_worker.parts_held, str(hf_dir), str(tmp_path), world_size=1)
    assert len(report) > 20
    for name, held in report:
        assert held == [name]


def _assert_same_tensors(directory, reference):
    original, converted = _all_tensors(reference), _all_tensors(directory)
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert converted[name].shape == tensor.shape, name
        assert converted[name].dtype == tensor.dtype, name
        assert torch.equal(converted[name], tensor), name


@pytest.mark.parametrize("format_version", [1, 2])
def test_checkpoint_of_either_format_exports_at_another_layout(
    format_1_hf_dir, format_version, tmp_path
):
    """Saved at TP=2/EP=2, exported at DP=2: the checkpoint reshards. Format 2 keys each expert
    and layer on its own; format 1 (older checkpoints: experts as slices of one tensor) still
    reads."""
    reports = run_on_ranks(
        convert_worker.convert_across_layouts,
        str(format_1_hf_dir),
        str(tmp_path),
        LAYOUTS["tp2_ep2"][0],
        {},
        format_version,
        world_size=2,
    )
    _assert_same_tensors(tmp_path / "hf-again", format_1_hf_dir)
    # Each expert was saved whole, and is copied. The embedding was saved in two halves of its
    # rows: copied as two ranges. The attention output was saved split by columns: read.
    copied = reports[0]["copied"]
    _assert_experts_copied(copied, format_1_hf_dir, all_of_them=True)
    assert "model.embed_tokens.weight" in copied
    assert not [name for name in copied if name.endswith("o_proj.weight")]
    keys = reports[0]["saved_keys"]
    per_expert = [key for key in keys if ".mlp.experts." in key]
    assert per_expert
    if format_version == 2:
        assert "decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_w" in keys
        assert not any(key.startswith("decoder.layers.mlp") for key in keys)
    else:
        assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in keys


@pytest.mark.parametrize("layout", ["tp2_ep2", "pp2"])
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
    original_size = {name: t.numel() * t.element_size() for name, t in original.items()}
    for bucket, size in zip(reports[0]["buckets"], reports[0]["bucket_sizes"], strict=True):
        names = {name for name, _, _ in bucket}
        # DeepSeek-V3: a layer's q_a_proj and kv_a_proj_with_mqa share a bucket (SGLang fuses
        # them per update call), which may take it past the bucket size by the second
        bound = [n for n in names if n.endswith("q_a_proj.weight")]
        partners = [n.replace("q_a_proj", "kv_a_proj_with_mqa") for n in bound]
        assert set(partners) <= names
        assert size - sum(original_size[n] for n in partners) <= bucket_bytes or len(bucket) == 1
    assert len(reports[0]["buckets"]) > 3
    for other in reports[1:]:
        assert other["buckets"] == []  # only the destination rank yields
