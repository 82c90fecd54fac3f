"""`megatron-rl plan`: its parameter counts equal megatron-core's built models (the tiny model at
several layouts, a shared expert and tied embeddings; Qwen3-30B-A3B's shape on the meta device),
its memory arithmetic keeps its stated relations, published layouts fit and the same layouts
with one change that must break them do not (for the reason worked out by hand), and it checks
the example cluster recipes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.files.hf_checkpoint import read_config_file
from megatron_rl.launch.plan import Cluster, load_model, make_plan, rank_parameters
from megatron_rl.models.families import family_for
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.trainer.recipe import Recipe
from tests.launch import plan_worker
from tests.parallel.harness import run_on_ranks
from tests.trainer.run_cli import REPO, TINY_MODEL

EXAMPLES = REPO / "examples" / "moe"
QWEN3_CONFIG = EXAMPLES / "configs" / "qwen3_30b_a3b.json"
QWEN3 = EXAMPLES / "qwen3_30b_a3b_gspo.yaml"


def _model(path: Path):
    hf = read_config_file(path)
    return family_for(hf).config_from_hf(hf)


TINY = _model(TINY_MODEL / "config.json")
# MLA with YaRN, a dense first layer, then MoE layers with a shared expert
TINY_DEEPSEEK = _model(EXAMPLES / "tiny_deepseek_v3" / "config.json")


def _check_counts(model, layout: dict, world_size: int, device: str = "cpu") -> None:
    dims = ParallelDims(world_size=world_size, **layout)
    built_ranks = run_on_ranks(
        plan_worker.built_parameters, model, layout, device, world_size=world_size
    )
    for built in built_ranks:
        planned = rank_parameters(model, dims, built["stage"])
        assert (planned.dense, planned.expert) == (built["dense"], built["expert"]), layout


@pytest.mark.parametrize(
    ("variant", "layout"),
    [
        ("plain", {"tp": 2}),
        ("plain", {"ep": 2}),
        ("plain", {"pp": 2}),
        ("plain", {"tp": 2, "ep": 2, "etp": 1}),
        ("plain", {"tp": 2, "etp": 1}),
        ("tied", {"pp": 2}),  # the last stage keeps a copy of the embedding as its output layer
        ("shared_expert", {"tp": 2}),
        ("qkv_bias", {"tp": 2}),  # GLM-4.5's biased query/key/value projections
        ("deepseek", {"tp": 2}),
        ("deepseek", {"pp": 2}),  # stage 0: the dense layer and an MoE layer; stage 1: two MoE
        ("deepseek", {"tp": 2, "ep": 2, "etp": 1}),
    ],
)
def test_tiny_model_counts_equal_the_built_model(variant, layout):
    model = {
        "plain": TINY,
        "tied": dataclasses.replace(TINY, tie_word_embeddings=True),
        "shared_expert": dataclasses.replace(TINY, shared_expert_ffn_hidden_size=48),
        "qkv_bias": dataclasses.replace(TINY, qkv_bias=True),
        "deepseek": TINY_DEEPSEEK,
    }[variant]
    _check_counts(model, layout, world_size=2)


def test_qwen3_30b_a3b_counts_equal_the_model_built_on_the_meta_device():
    qwen3 = _model(QWEN3_CONFIG)
    _check_counts(qwen3, {}, world_size=1, device="meta")
    assert rank_parameters(qwen3, ParallelDims(world_size=1), 0).total == 30_532_122_624
    _check_counts(qwen3, {"pp": 2}, world_size=2, device="meta")
    _check_counts(qwen3, {"ep": 2}, world_size=2, device="meta")


def _plan(overrides: list[str], model=None, recipe: Path = QWEN3, **cluster):
    loaded = load_config(Recipe, recipe, overrides)
    return make_plan(loaded, model or _model(QWEN3_CONFIG), Cluster(**cluster))


def test_memory_relations():
    # 2 nodes x 8: dp 8, edp 1. Adam's 12 bytes per bf16 parameter: the dense part is sharded 8
    # ways by the distributed optimizer, the experts (no data-parallel copy) are not.
    plan = _plan([], nodes=2, rollout_nodes=1)
    stage = plan.stages[0]
    dense, expert = stage.parameters.dense, stage.parameters.expert
    assert stage.weights == 2 * (dense + expert) and stage.gradients == 4 * (dense + expert)
    assert stage.optimizer_plain == 12 * (dense + expert)
    assert stage.optimizer == 12 * dense // 8 + 12 * expert
    plain = _plan(["optim.distributed_optimizer=false"], nodes=2, rollout_nodes=1).stages[0]
    assert plain.optimizer == plain.optimizer_plain
    # only the last stage holds the logits; replay adds its record
    assert plan.stages[0].logits == 0 < plan.stages[1].logits
    assert stage.routing_record == 0
    replayed = _plan(["algo.loss=grpo", "algo.routing_replay=r2"], nodes=2, rollout_nodes=1)
    assert replayed.stages[0].routing_record > 0
    # a KL penalty holds the frozen reference: one more copy of the weights
    assert stage.reference == 0
    penalised = _plan(["algo.kl_coef=0.001"], nodes=2, rollout_nodes=1).stages[0]
    assert penalised.reference == stage.weights
    assert penalised.total == stage.total + stage.weights
    offloaded = ["algo.kl_coef=0.001", "algo.ref_offload=true"]
    assert _plan(offloaded, nodes=2, rollout_nodes=1).stages[0].reference == 0  # in host memory
    # activations: linear in the micro-batch; recompute keeps less
    double = _plan(["run.micro_batch_size=8"], nodes=2, rollout_nodes=1).stages[1]
    assert double.activations == pytest.approx(2 * plan.stages[1].activations, rel=0.01)
    stored = _plan(["model.recompute=false"], nodes=2, rollout_nodes=1).stages[1].activations
    assert stored > 4 * plan.stages[1].activations


def test_the_largest_micro_batch_is_the_boundary():
    plan = _plan([], nodes=2, rollout_nodes=1)
    assert plan.fits and plan.largest_micro_batch >= 4
    at = _plan([f"run.micro_batch_size={plan.largest_micro_batch}"], nodes=2, rollout_nodes=1)
    over = _plan([f"run.micro_batch_size={plan.largest_micro_batch + 1}"], nodes=2, rollout_nodes=1)
    assert at.fits and not over.fits


def test_a_colocated_server_takes_its_share_of_the_first_gpus():
    # The recipe's SGLang servers (TP 4) on the trainer's first node: 0.8 of those GPUs.
    plan = _plan([], nodes=2)
    assert plan.engine_ranks == 4 and not plan.fits and plan.worst().engine == plan.engine_bytes


# NeMo-RL grpo-qwen3-30ba3b-4n8g: 4 nodes, TP1 EP8, micro-batch 1, 4096 tokens, no recompute
NEMO_RL_4N8G = [
    "parallel.pp=1",
    "parallel.ep=8",
    "run.micro_batch_size=1",
    "model.recompute=false",
    "rollout.max_new_tokens=3072",
    "rollout.prompts_per_step=64",
    "rollout.group_size=32",
    "algo.updates_per_batch=4",
]
# verl run_qwen3moe-30b_megatron.sh: 4 nodes, TP4 PP2 EP4, micro-batch 4, 1024 + 2048 tokens,
# gradient checkpointing
VERL_4N8G = [
    "parallel.tp=4",
    "parallel.pp=2",
    "parallel.ep=4",
    "run.micro_batch_size=4",
    "rollout.max_new_tokens=2048",
    "rollout.prompts_per_step=64",
    "rollout.group_size=5",
    "algo.updates_per_batch=1",
]
QWEN3_PARAMETERS = 30_532_122_624


# Published Qwen3-30B-A3B layouts that run on 80 GB H100s without offloading, as this planner
# sees them (the sequence is prompt + response; rollout batch and minibatches as published).
@pytest.mark.parametrize(("name", "overrides"), [("nemo-rl", NEMO_RL_4N8G), ("verl", VERL_4N8G)])
def test_published_layouts_fit(name, overrides):
    plan = _plan(overrides, nodes=4, rollout_nodes=1)
    assert plan.fits, (name, plan.worst())


# The published NeMo-RL layout with one change that must break it, each for the reason its
# test works out by hand. The budget: 80 GiB less the 4 GiB reserve.
BUDGET = 76 * 2**30


def test_without_expert_parallelism_the_weights_and_gradients_alone_overflow():
    plan = _plan([*NEMO_RL_4N8G, "parallel.ep=1"], nodes=4, rollout_nodes=1)
    rank = plan.stages[0]
    # every rank holds every expert: the whole model, 30.5 B parameters
    assert rank.parameters.total == QWEN3_PARAMETERS
    # bf16 weights (2 bytes) and fp32 main_grad (4 bytes): 170.6 GiB before anything else
    assert (rank.weights, rank.gradients) == (2 * QWEN3_PARAMETERS, 4 * QWEN3_PARAMETERS)
    assert 6 * QWEN3_PARAMETERS > BUDGET == plan.cluster.budget_bytes
    assert not plan.fits and plan.largest_micro_batch == 0


def test_the_plain_optimizer_overflows_where_the_distributed_one_fits():
    distributed = _plan(NEMO_RL_4N8G, nodes=4, rollout_nodes=1)
    plain = _plan([*NEMO_RL_4N8G, "optim.distributed_optimizer=false"], nodes=4, rollout_nodes=1)
    rank = plain.stages[0]
    dense, expert = rank.parameters.dense, rank.parameters.expert
    assert (plain.dims.dp, plain.dims.edp) == (32, 4)
    # Adam: an fp32 main weight and two moments, 12 bytes per bf16 parameter; the distributed
    # optimizer shards the dense part over dp = 32 ranks and the experts over edp = 4
    assert rank.optimizer == 12 * (dense + expert)
    assert distributed.stages[0].optimizer == 12 * dense // 32 + 12 * expert // 4
    # weights + gradients + Adam, 18 bytes per parameter: 86.6 GiB before the activations
    assert rank.weights + rank.gradients + rank.optimizer == 18 * (dense + expert) > BUDGET
    assert distributed.fits and not plain.fits and plain.largest_micro_batch == 0


def test_on_one_node_the_experts_optimizer_state_is_not_sharded():
    plan = _plan(NEMO_RL_4N8G, nodes=1, rollout_nodes=1)
    rank = plan.stages[0]
    dense, expert = rank.parameters.dense, rank.parameters.expert
    # 8 ranks, EP 8: each expert on one rank only (edp 1), so its Adam state is not sharded
    assert (plan.dims.dp, plan.dims.edp) == (8, 1)
    assert rank.optimizer == 12 * dense // 8 + 12 * expert
    at_rest = rank.weights + rank.gradients + rank.optimizer  # 71.5 GiB
    assert at_rest < BUDGET < at_rest + rank.activations  # one sequence's activations: 26 GiB
    assert not plan.fits and plan.largest_micro_batch == 0


def test_four_times_the_micro_batch_holds_four_times_the_activations():
    published = _plan(NEMO_RL_4N8G, nodes=4, rollout_nodes=1)
    larger = _plan([*NEMO_RL_4N8G, "run.micro_batch_size=4"], nodes=4, rollout_nodes=1)
    one, four = published.stages[0].activations, larger.stages[0].activations
    # no recompute: every layer keeps its activations, linear in the micro-batch's tokens
    assert four == pytest.approx(4 * one, rel=1e-3)
    assert four > BUDGET  # 104 GiB of activations alone
    assert not larger.fits and larger.largest_micro_batch == published.largest_micro_batch == 1


@pytest.mark.parametrize(
    ("recipe", "nodes", "config"),
    [
        ("qwen3_30b_a3b_gspo.yaml", 2, "qwen3_30b_a3b.json"),
        ("qwen3_30b_a3b_grpo_r2.yaml", 2, "qwen3_30b_a3b.json"),
        ("mixtral_8x7b_gspo.yaml", 2, "mixtral_8x7b.json"),
        ("qwen3_30b_a3b_word_problems.yaml", 2, "qwen3_30b_a3b.json"),
        ("moonlight_16b_a3b_gspo.yaml", 1, "moonlight_16b_a3b.json"),
    ],
)
def test_the_cluster_recipes_fit_their_documented_clusters(recipe, nodes, config):
    model = load_model(load_config(Recipe, EXAMPLES / recipe), EXAMPLES / "configs" / config)
    plan = _plan([], model=model, recipe=EXAMPLES / recipe, nodes=nodes, rollout_nodes=1)
    assert plan.fits, plan.worst()


def test_the_command(tmp_path):
    def plan(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "megatron_rl.cli", "plan", str(QWEN3), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )

    config = f"--model-config={QWEN3_CONFIG}"
    fits = plan("--nodes=2", "--rollout-nodes=1", config)
    assert fits.returncode == 0, fits.stderr
    assert "world 16 = tp1 * cp1 * pp2 * dp8" in fits.stdout and "\nfits: " in fits.stdout
    assert "largest micro-batch that fits: " in fits.stdout
    small = plan("--nodes=2", "--rollout-nodes=1", "--gpu-memory-gb=24", config)
    assert small.returncode == 1 and "DOES NOT FIT" in small.stdout
    split = plan("--nodes=1", "--gpus-per-node=6", config)
    assert split.returncode == 2 and "6 is not a multiple of 16" in split.stderr
    missing = plan("--nodes=2", f"--model-config={tmp_path / 'none.json'}")
    assert missing.returncode == 2 and "none.json: cannot be read" in missing.stderr
    # the recipe's model is not on this machine: the message says how to plan without it
    without = plan("--nodes=2")
    assert without.returncode == 2
    assert "model.hf_path /shared/models/Qwen3-30B-A3B: not a directory here" in without.stderr
    assert "pass the model's config.json: --model-config FILE" in without.stderr
