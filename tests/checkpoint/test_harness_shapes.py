"""The drift harness's base-model shapes (`examples/moe/make_tiny_model.py --shape`): a randomly
initialised model of each, after one SFT step with its load balancing, converts Hugging Face ->
Megatron-Core -> Hugging Face bit-exactly (the expert bias included) and gives transformers'
logits in Megatron-Core. The real models (8 layers, SFT'd) are built outside the test suite."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.bench.drift import base_models
from megatron_rl.models.families import family_for
from megatron_rl.rewards import ArithmeticTask
from tests.checkpoint import convert_worker
from tests.checkpoint.test_convert import _assert_same_tensors
from tests.parallel.harness import run_on_ranks

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "moe" / "make_tiny_model.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


script = _script()
SHAPES = script.SHAPES
BIAS_RATE = 0.05  # large, so that the bias moves routing


def _one_sft_step(name: str, directory: Path) -> Path:
    """A random model of shape `name` after one step of the script's SFT with its balancing
    (a large step and bias-update rate, so that both show), saved with its tokenizer."""
    shape = SHAPES[name]
    tokenizer = script.char_tokenizer()
    torch.manual_seed(0)
    model = script.FAMILIES[shape.family][0](shape.hf_config(tokenizer))
    problems = ArithmeticTask().problems("train", 8, seed=0)
    solutions = [script.sloppy_solution(p.prompt, 0.8, random.Random(0)) for p in problems]
    batch = script.training_batch(tokenizer, [p.prompt for p in problems], solutions)
    if shape.router_bias_update_rate > 0:
        shape = dataclasses.replace(shape, router_bias_update_rate=BIAS_RATE)
    balancing = script.Balancing(model, shape)
    balancing.start(batch["attention_mask"])
    loss = model(**batch).loss + balancing.aux_loss()
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 1e-2 * param.grad
    balancing.update_biases()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.timeout(300)
# The DeepSeek-V3 shape (MLA, a dense first layer, groups, a bias) runs every time; the others
# (rules every other family test already covers) in the extended tier.
@pytest.mark.parametrize(
    "name",
    [
        name if name == "fine_deepseek" else pytest.param(name, marks=pytest.mark.extended)
        for name in sorted(SHAPES)
    ],
)
def test_a_harness_shape_converts_both_ways_bit_exactly(name, tmp_path):
    hf_dir = _one_sft_step(name, tmp_path / "hf")
    shape = SHAPES[name]
    hf_config = json.loads((hf_dir / "config.json").read_text())
    config = family_for(hf_config).config_from_hf(hf_config)
    assert (config.num_layers, config.num_experts, config.router_topk) == (
        shape.layers,
        shape.experts,
        shape.topk,
    )
    assert config.moe_ffn_hidden_size == shape.moe_ffn
    if shape.family == "deepseek_v3":
        assert config.router_expert_bias and config.first_dense_layers == 1
        assert config.shared_expert_ffn_hidden_size == shape.moe_ffn
    (report,) = run_on_ranks(convert_worker.logits_match, str(hf_dir), {}, world_size=1)
    assert report["logit_scale"] > 0.1 and report["max_abs_diff"] <= 1e-4, report
    run_on_ranks(convert_worker.convert_both_ways, str(hf_dir), str(tmp_path), {}, world_size=1)
    _assert_same_tensors(tmp_path / "hf-again", hf_dir)
    if shape.router_bias_update_rate > 0:
        tensors = load_file(next(hf_dir.glob("*.safetensors")))
        biases = [t for n, t in tensors.items() if n.endswith("e_score_correction_bias")]
        assert len(biases) == shape.layers - 1
        for bias in biases:  # the sign rule from 0: +-rate, 0 only at an exactly even load
            assert bias.abs().max() == BIAS_RATE and set(bias.abs().unique().tolist()) <= {
                0.0,
                float(torch.tensor(BIAS_RATE)),
            }


SHIPPED = SCRIPT.parent / "drift_models"
DEFAULT_GRID_MODELS = ("fine_qwen3_e128", "fine_deepseek_e128", "dense_control")


@pytest.mark.timeout(300)
# The default grid's main model every time; the other two in the extended tier.
@pytest.mark.parametrize(
    "name",
    [
        name if name == "fine_qwen3_e128" else pytest.param(name, marks=pytest.mark.extended)
        for name in DEFAULT_GRID_MODELS
    ],
)
def test_a_shipped_drift_model_is_its_shape_and_converts_bit_exactly(name, tmp_path):
    """The default grid's base models, shipped as built: what the script's shape says, with its
    RL balancing, used by the grid instead of a rebuild, and converting both ways bit-exactly."""
    model = SHIPPED / name
    made = json.loads((model / "training.json").read_text())
    assert made["shape"] == {"name": name, **dataclasses.asdict(SHAPES[name])}
    assert made["rl_options"] == SHAPES[name].rl_options()
    assert base_models.model_path(tmp_path / "cache", {"shape": name}) == model
    assert base_models.is_built(tmp_path / "cache", {"shape": name})
    run_on_ranks(convert_worker.convert_both_ways, str(model), str(tmp_path), {}, world_size=1)
    _assert_same_tensors(tmp_path / "hf-again", model)


def test_a_shape_not_shipped_is_built_into_the_cache(tmp_path):
    shape = {"shape": "fine_qwen3"}
    assert not (SHIPPED / "fine_qwen3").exists()
    assert base_models.model_path(tmp_path, shape) == tmp_path / "fine_qwen3"
    assert not base_models.is_built(tmp_path, shape)
    command = base_models.build_command(tmp_path, shape)
    assert command[-4:] == ["--out", str(tmp_path / "fine_qwen3"), "--shape", "fine_qwen3"]
