"""`megatron-rl train` end to end on the shipped tiny model: each loss with and without routing
replay, 2 ranks with EP=2, PP=2 or TP=2 (experts whole), exact resume after a kill and what a
resume refuses, non-finite steps, bad input."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.checkpoint.format import verify_checkpoint
from megatron_rl.cli.known_warnings import KNOWN_WARNINGS
from megatron_rl.files.checksums import MANIFEST
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.trainer.checkpoints import check_resumable
from tests.trainer.run_cli import (
    finished_run_metrics,
    read_metrics,
    train_cli,
    train_cli_each,
)

TIMING = ("time/", "throughput/")


def _check_run(result, run_dir, *, entropy_bonus: bool = False) -> dict[int, dict[str, float]]:
    metrics = finished_run_metrics(result, run_dir)
    for step in (1, 2):
        record = metrics[step]
        assert math.isfinite(record["loss/policy"]) and record["steps/skipped"] == 0
        # Groups with equal rewards carry no gradient (but an entropy bonus does); the others do.
        if record["groups/zero_variance_frac"] == 1:
            assert (record["grad_norm"] > 0) if entropy_bonus else (record["grad_norm"] == 0)
        else:
            assert record["grad_norm"] > 0
        assert 0 <= record["reward/mean"] <= 1
        assert record["reward/failures"] == 0
    assert 0 <= metrics[2]["eval/accuracy"] <= 1
    assert any(metrics[step]["grad_norm"] > 0 for step in (1, 2))
    return metrics


@pytest.mark.parametrize(
    ("loss", "replay", "terms"),
    # gspo_token: GSPO's value and gradient (tests/algo), through the same registry
    [
        ("gspo", "none", ["algo.mismatch=tis", "algo.mismatch_level=geometric"]),
        ("sspo", "none", []),
        ("grpo", "r2", ["algo.mismatch=icepop", "algo.entropy_coef=1e-3"]),
        # R3 on packed passes: the engine's routing at each sequence's offset
        ("grpo", "r3", ["run.packed_sequences=true", "run.micro_batch_tokens=1024"]),
        # gate-weight replay: the engine's experts and weights (float32: the trainer's own)
        ("grpo", "r3_weights", []),
    ],
)
def test_each_loss_runs_end_to_end(tmp_path, loss, replay, terms):
    result = train_cli(tmp_path, [f"algo.loss={loss}", f"algo.routing_replay={replay}", *terms])
    bonus = "algo.entropy_coef=1e-3" in terms
    metrics = _check_run(result, tmp_path, entropy_bonus=bonus)
    for step in (1, 2):
        # The engine was synced before the step: the trainer's old log-probs equal its own.
        assert metrics[step]["mismatch/k3"] < 1e-8
        assert metrics[step]["mismatch/abs_max"] < 1e-3
        # ... so a correction weighs every token by ~1 and cuts none
        corrected = [key for key in metrics[step] if key.endswith("_token_frac")]
        assert len(corrected) == (1 if terms and "mismatch" in terms[0] else 0)
        if corrected:
            assert metrics[step][corrected[0]] == 0
            assert metrics[step]["mismatch/weight_mean"] == pytest.approx(1, abs=1e-3)
        assert ("loss/entropy_bonus" in metrics[step]) == bonus
    if loss == "sspo":
        assert metrics[1]["segments/per_seq"] > 1  # one segment per line of working
    packed = "run.packed_sequences=true" in terms
    assert (metrics[1]["trainer/padding_frac"] == 0) == packed  # one TP rank: no tail
    # The routing the updated weights would choose, against the old (or replayed) one.
    assert 0 <= metrics[2]["routing/drift_token_layer"] <= metrics[2]["routing/drift_token_any"]
    assert 0 < metrics[2]["routing/drift_jaccard"] <= 1
    per_layer = [metrics[2][f"routing/drift_layer_{layer}"] for layer in range(4)]
    assert max(per_layer) <= metrics[2]["routing/drift_token_any"]
    # 4 layers x top-2 int64 indices per token of the step's micro-batches.
    assert metrics[2]["routing/record_bytes"] > 0
    assert metrics[2]["routing/record_bytes"] % (4 * 2 * 8) == 0
    # Replay forces the replayed experts exactly; without it there is nothing to miss.
    replays = replay != "none"
    assert metrics[2].get("routing/replay_miss_token_layer") == (0.0 if replays else None)
    # R3: the trainer's routers against the engine's, before the first optimizer step.
    mismatch = metrics[2].get("routing/engine_mismatch_token_layer")
    assert (mismatch is not None) == replay.startswith("r3")
    assert metrics[2]["log_ratio/std"] >= 0
    assert metrics[2]["log_ratio/frac_tau1.25"] >= metrics[2]["log_ratio/frac_tau2"]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000002"


# Seed 1: the first step's groups carry a gradient (the default seed's all have equal rewards),
# so the policy leaves the reference within the short run.
MOVES_AT_ONCE = "run.seed=1"


def test_a_kl_penalty_keeps_the_policy_closer_to_the_reference(tmp_path):
    # The same run twice but for the penalty's weight: by the second step the KL to the starting
    # weights is smaller with the larger weight. (k3's gradient is 0 where the policy equals the
    # reference, so the runs part only after the first update that moved the policy.)
    kl = {}
    for coef in ("1e-6", "0.5"):
        run_dir = tmp_path / coef
        overrides = ["algo.kl_coef=" + coef, "algo.kl_estimator=k3", MOVES_AT_ONCE]
        metrics = _check_run(train_cli(run_dir, overrides), run_dir)
        assert metrics[1]["time/ref_logprob_s"] > 0
        assert metrics[2]["loss/kl_penalty"] == pytest.approx(
            float(coef) * metrics[2]["kl/ref"], rel=1e-6
        )
        kl[coef] = metrics[2]["kl/ref"]
    assert 0 < kl["0.5"] < kl["1e-6"]


def test_the_kl_in_the_reward_is_the_same_on_one_rank_and_split_over_two(tmp_path):
    # The rows of a step lie on different data-parallel ranks (EP=2: dense DP=2), which add up
    # their shares of the per-sample KL before the group advantages are recomputed.
    overrides = ["algo.kl_coef=0.5", "algo.kl_in_reward=true", MOVES_AT_ONCE]
    runs = {}
    for nproc in (1, 2):
        run_dir = tmp_path / str(nproc)
        layout = ["parallel.ep=2"] if nproc == 2 else []
        runs[nproc] = _check_run(train_cli(run_dir, [*overrides, *layout], nproc=nproc), run_dir)
    for metrics in runs.values():
        assert "loss/kl_penalty" not in metrics[2]  # in the reward, not in the loss
        assert metrics[1]["kl/reward_ref"] == 0  # the old policy is the reference at first
        assert metrics[2]["kl/reward_ref"] > 0
        assert metrics[2]["reward/kl_penalty"] == pytest.approx(-0.5 * metrics[2]["kl/reward_ref"])
    assert runs[2][2]["kl/reward_ref"] == pytest.approx(runs[1][2]["kl/reward_ref"], rel=1e-3)


def test_engine_logprobs_export_and_wandb(tmp_path):
    # wandb offline, its files kept inside the test's directory
    wandb_env = {f"WANDB_{name}_DIR": str(tmp_path / "wandb-home") for name in ("CONFIG", "CACHE")}
    result = train_cli(
        tmp_path,
        ["algo.mismatch=bypass", "checkpoint.export_hf=true", "metrics.wandb=offline"],
        extra_env=wandb_env | {"WANDB_SILENT": "true"},
    )
    _check_run(result, tmp_path)
    (wandb_run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("run-*.wandb"))
    export = tmp_path / "export"
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
    (shard,) = export.glob("*.safetensors")
    tensors = load_file(shard)
    # A training checkpoint converts with the conversion CLI, to the same weights.
    converted = tmp_path / "converted"
    command = [sys.executable, "-m", "megatron_rl.cli", "convert", "mcore-to-hf"]
    ckpt = tmp_path / "checkpoints" / "step_000002"
    done = subprocess.run(
        [*command, "--ckpt", str(ckpt), "--out", str(converted)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (converted_shard,) = converted.glob("*.safetensors")
    again = load_file(converted_shard)
    assert again.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(again[name], tensor), name
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in tensors


def test_a_run_without_its_final_checkpoint_logs_the_same_numbers(tmp_path):
    # what the drift harness's runs do (checkpoint.save_last=false), the routing probe on
    probe = ["metrics.routing_probe=true"]
    saved, unsaved = tmp_path / "saved", tmp_path / "unsaved"
    first = train_cli(saved, probe)
    second = train_cli(unsaved, [*probe, "checkpoint.save_last=false"])
    whole, lean = finished_run_metrics(first, saved), finished_run_metrics(second, unsaved)
    assert (saved / "checkpoints" / "latest").is_file()
    assert not (unsaved / "checkpoints").exists()
    # the last lines say so (trainer/run_summary.py)
    assert f"checkpoint: {saved / 'checkpoints' / 'step_000002'}" in first.stdout
    assert "checkpoint: none (checkpoint.save_last: false)" in second.stdout
    assert first.stdout.startswith("run finished: 2 steps in ")
    assert f"best {max(whole[0]['eval/accuracy'], whole[2]['eval/accuracy']):.3f}" in first.stdout
    assert "routing/update_activated_experts" in whole[1]
    for step, record in whole.items():
        assert {k: v for k, v in lean[step].items() if not k.startswith(TIMING)} == {
            k: v for k, v in record.items() if not k.startswith(TIMING)
        }


def test_routes_the_engine_flips_show_as_routing_mismatch_with_the_trainer(tmp_path):
    # the float32 engine routes exactly as the trainer: the flips are the whole mismatch
    overrides = ["metrics.routing_probe=true", "rollout.flip_routes=0.3", "run.steps=1"]
    result = train_cli(tmp_path, overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    step = read_metrics(tmp_path)[1]
    # 30% of the tokens have one of their 2 experts swapped in each of the 4 layers, at every
    # router call (later layers also see the flips' effect)
    assert 0.1 < step["routing/engine_mismatch_token_layer"] < 0.9
    assert step["routing/engine_mismatch_activated_experts"] > 0.05


@pytest.mark.parametrize(
    "layout",
    # the loss under TP (tp2, tp2_etp1): tests/parallel/test_invariance.py
    [["parallel.ep=2"], ["parallel.pp=2"]],
    ids=["ep2", "pp2"],
)
def test_two_ranks(tmp_path, layout):
    result = train_cli(tmp_path, layout, nproc=2)
    metrics = _check_run(result, tmp_path)
    # With data-parallel copies (ep2) the distributed optimizer raises the last known entries.
    log = (tmp_path / "warnings.log").read_text()
    _check_known_warnings(result.stderr, log, ranks=2, every_entry=layout == ["parallel.ep=2"])
    # Rank 0 logs. Under PP=2 it is on the first stage, and the loss metrics, the old-policy
    # log-probs and half of the routers are on the second: all of them must reach the log.
    for step in (1, 2):
        record = metrics[step]
        for key in ("clip_frac/seq", "ratio/mean", "kl/k3", "entropy/mean"):
            assert math.isfinite(record[key]), (step, key)
        assert record["mismatch/k3"] < 1e-8  # the trainer's old log-probs, not the engine's
        assert all(f"routing/drift_layer_{layer}" in record for layer in range(4))
    if layout == ["parallel.ep=2"]:
        _check_resumes_only_as_saved(tmp_path / "checkpoints" / "step_000002")
        _check_every_ranks_files_have_checksums(tmp_path / "checkpoints" / "step_000002")


def _check_every_ranks_files_have_checksums(path: Path) -> None:
    """Each rank's data files and RNG states are in the checkpoint's checksums, which hold."""
    recorded = json.loads((path / MANIFEST).read_text())["files"]
    assert {"rng_rank0.pt", "rng_rank1.pt", "trainer.json", "weights/.metadata"} <= set(recorded)
    for rank in (0, 1):
        assert any(name.startswith(f"weights/__{rank}_") for name in recorded), rank
    assert verify_checkpoint(path)


def _check_known_warnings(stderr: str, log: str, ranks: int, every_entry: bool) -> None:
    """megatron-core's and torch's known, harmless warnings reach RUN_DIR/warnings.log from
    every rank and not the console; with `every_entry`, each known entry is still raised (an
    entry no run raises is not needed any more)."""
    for entry in KNOWN_WARNINGS:
        assert not re.search(entry.message, stderr), entry.reason
        assert re.search(entry.message, log) or not every_entry, entry.reason
    assert {f"[rank {rank}]" for rank in range(ranks)} <= set(re.findall(r"\[rank \d+\]", log))


def _check_resumes_only_as_saved(path: Path) -> None:
    """The ep2 run's last checkpoint `path` resumes only at its layout and with its optimizer."""
    state = json.loads((path / "trainer.json").read_text())
    assert state["distributed_optimizer"] is True  # the default, with data-parallel copies
    saved = ParallelDims(world_size=2, ep=2)
    assert state["layout"] == saved.describe()
    check_resumable(path, state, saved, True)
    with pytest.raises(ValueError, match=r"saved with optim\.distributed_optimizer=true, resumed"):
        check_resumable(path, state, saved, False)
    with pytest.raises(ValueError, match=r"saved at layout \[world 2 = .*ep2.*\], resumed at"):
        check_resumable(path, state, ParallelDims(world_size=2), True)
    with pytest.raises(ValueError, match="saved by 2 ranks, resumed with 1"):
        check_resumable(path, state, ParallelDims(world_size=1), False)
    # written before these fields existed: by the plain optimizer, at an unrecorded layout
    older = {"world_size": 2}
    check_resumable(path, older, ParallelDims(world_size=2, tp=2), False)
    with pytest.raises(ValueError, match=r"set optim\.distributed_optimizer=false to resume it"):
        check_resumable(path, older, ParallelDims(world_size=2), True)


def test_bad_recipes_fail_before_training(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    # a prompt the tokenizer cannot encode (the tiny vocabulary has no unknown token)
    prompts = tmp_path / "prompts.jsonl"
    lines = ['{"prompt": "1+1\\n", "answer": 2}', '{"prompt": "caf\u00e9\\n", "answer": 1}']
    prompts.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    empty_data = ["data.source=jsonl", f"data.train_path={empty}", f"data.eval_path={empty}"]
    cases = {  # each run's overrides, and what its error says
        (run, (*empty_data, "data.verifier=math")): f"{empty}: no records",
        (run, ("rollout.group_size=1",)): "rollout.group_size: expected >= 2",
        (run, ("algo.los=grpo",)): "did you mean 'loss'",
        # an error names the recipe key the path came from
        (run, (f"model.hf_path={tmp_path / 'missing'}",)): (
            f"model.hf_path {tmp_path / 'missing'}: not a directory"
        ),
        (empty, ()): f"run.dir {empty}: exists and is not a directory",
        (empty / "run", ()): f"run.dir {empty / 'run'}: a parent of it is not a directory",
        # named with its file and line before the run starts
        (run, ("data.source=jsonl", f"data.train_path={prompts}", f"data.eval_path={prompts}")): (
            f"{prompts}:2: prompt 'café\\n': the tokenizer cannot encode it"
        ),
    }
    # the first in a process of its own, as users run it; the others in one process, which
    # pays the imports once
    first, *others = cases
    results = [train_cli(first[0], list(first[1]))]
    results += train_cli_each([(run_dir, list(overrides)) for run_dir, overrides in others])
    for result, error in zip(results, cases.values(), strict=True):
        assert result.returncode == 2, result.stderr[-3000:]
        assert error in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("fault", "nonfinite"),
    [("nan_advantages", "loss"), ("inf_gradient", "grad_norm")],
    ids=["nan_loss", "inf_grad_norm"],
)
def test_non_finite_steps_are_skipped_shown_counted_then_the_run_aborts(tmp_path, fault, nonfinite):
    result = train_cli(
        tmp_path, ["run.steps=5", "run.max_bad_steps=3"], module=f"tests.trainer.{fault}"
    )
    assert result.returncode == 3
    assert "3 consecutive steps with a non-finite loss" in result.stderr
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == [0, 1, 2, 3]  # aborted after the third
    for step in (1, 2, 3):
        record = metrics[step]
        assert record["steps/skipped"] == 1.0
        assert record["steps/skipped_updates"] == record["steps/updates"] == 2
        assert record[f"steps/nonfinite_{nonfinite}_updates"] == 2
        # shown as it is (null in JSON), not averaged away
        assert record["grad_norm"] is None
        assert (record["loss/policy"] is None) == (nonfinite == "loss")
        assert f"step {step}: 2 of 2 updates skipped" in result.stderr
    assert "gradient norm in 2" in result.stderr
