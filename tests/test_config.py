"""Typed recipes: YAML, dotted overrides, type conversion, nearest-name errors, validation."""

from __future__ import annotations

import pytest

from megatron_rl.algo import MismatchCorrection
from megatron_rl.config import ConfigError, load_config
from megatron_rl.trainer.recipe import OldLogProbs, Recipe


def _recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides(tmp_path):
    path = _recipe(tmp_path, "algo:\n  loss: grpo\n  clip_high: 0.27\nparallel:\n  tp: 2\n")
    config = load_config(
        Recipe, path, ["algo.routing_replay=r2", "algo.clip_low=3e-4", "parallel.ep=4"]
    )
    assert config.algo.loss == "grpo" and config.algo.clip_high == 0.27
    assert config.algo.clip_low == 3e-4  # YAML reads 3e-4 as a string; the field makes it a float
    assert config.algo.routing_replay == "r2"
    assert (config.parallel.tp, config.parallel.ep, config.parallel.pp) == (2, 4, 1)
    assert config.parallel.etp is None  # expert TP follows tp unless given
    assert load_config(Recipe, path, ["parallel.etp=1"]).parallel.etp == 1
    defaults = load_config(Recipe, None)
    assert defaults.algo.loss == "gspo" and defaults.algo.clip_low is None
    assert load_config(Recipe, None, ["algo.clip_low=none"]).algo.clip_low is None
    bypass = load_config(Recipe, None, ["algo.mismatch=bypass"]).algo
    assert bypass.old_logprobs is OldLogProbs.ENGINE and not bypass.runs_old_policy_forward


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.los=grpo"], r"algo\.los: unknown key; .* did you mean 'loss'"),
        (["algorithm.loss=grpo"], r"algorithm: unknown key; .* did you mean 'algo'"),
        (["algo.loss=ppo"], r"algo\.loss: unknown loss 'ppo'; valid: grpo, gspo"),
        (["algo.routing_replay=r4"], r"algo\.routing_replay: expected one of 'none', 'r2', 'r3'"),
        (["parallel.tp=two"], r"parallel\.tp: expected an int, got 'two'"),
        (["parallel.tp=0"], r"parallel\.tp: expected a positive int"),
        (["parallel.etp=0"], r"parallel\.etp: expected a positive int, got 0"),
        (["algo.clip_low=-0.1"], r"algo\.clip_low: expected >= 0"),
        (["algo.clip_low=wide"], r"algo\.clip_low: expected a number, got 'wide'"),
        (["checkpoint.export_hf=maybe"], r"expected true or false"),
        (["algo.loss_agg=mean"], r"algo\.loss_agg: unknown mode 'mean'"),
        (["algo"], r"expected key=value"),
        (["algo.loss.name=x"], r"algo\.loss: is a value, not a section"),
        (
            ["checkpoint.keep=0"],
            r"^checkpoint\.keep: expected >= 1 \(the newest checkpoint\), got 0$",
        ),
        (["checkpoint.save_every=-2"], r"^checkpoint\.save_every: expected >= 0 .*, got -2$"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Recipe, None, overrides)


def test_bad_recipe_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(Recipe, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"parallel\.tpp: unknown key; .* did you mean 'tp'"):
        load_config(Recipe, _recipe(tmp_path, "parallel:\n  tpp: 2\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Recipe, _recipe(tmp_path, "algo: [unclosed\n"))
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(Recipe, _recipe(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="algo: expected a mapping of AlgoConfig fields"):
        load_config(Recipe, _recipe(tmp_path, "algo: gspo\n"))
    # a section given as a value, then overridden inside
    with pytest.raises(ConfigError, match="run: expected a mapping of RunConfig fields, got 5"):
        load_config(Recipe, _recipe(tmp_path, "run: 5\n"), ["run.dir=/tmp/x"])
    with pytest.raises(ConfigError, match=r"recipe .*recipe\.yaml: empty"):
        load_config(Recipe, _recipe(tmp_path, "# nothing set\n"))
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"recipe .*latin1\.yaml: not UTF-8 text \(byte 16"):
        load_config(Recipe, latin1)


def test_every_shipped_recipe_loads_and_validates():
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples" / "moe"
    # *_drift.yaml are drift grids (tests/bench/drift checks them)
    recipes = sorted(p for p in examples.glob("*.yaml") if not p.name.endswith("_drift.yaml"))
    assert len(recipes) >= 5
    for path in recipes:
        recipe = load_config(Recipe, path)
        if path.name.startswith("tiny_"):  # a tiny model shipped beside them
            model = Path(recipe.model.hf_path)
            assert model.parent == Path("examples/moe") and model.name.startswith("tiny_"), path
            assert (examples / model.name / "config.json").is_file(), path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.group_size=1"], r"rollout\.group_size: expected >= 2"),
        (["rollout.top_p=0"], r"rollout\.top_p: expected a value in \(0, 1\]"),
        (["data.verifier=nope"], r"data\.verifier: unknown verifier 'nope'; valid: arithmetic"),
        (["data.source=jsonl"], r"data\.train_path and data\.eval_path: required"),
        (["run.steps=0"], r"run\.steps: expected > 0"),
        (["optim.lr=0"], r"optim\.lr: expected > 0"),
        (["optim.lr=inf"], r"optim\.lr: expected a finite number, got 'inf'"),
        (["optim.lr=nan"], r"optim\.lr: expected a finite number, got 'nan'"),
        (["optim.adam_beta2=1.5"], r"optim\.adam_beta2: expected in \[0, 1\), got 1\.5"),
        (["checkpoint.save_on_signals=[SIGFOO]"], r"save_on_signals\[0\]: unknown signal 'SIGFOO'"),
        (["checkpoint.save_on_signals=[SIGINT]"], r"save_on_signals\[0\]: SIGINT \(Ctrl-C\)"),
        (
            ["checkpoint.save_on_signals=[SIGUSR2, SIGCHLD]"],
            r"save_on_signals\[1\]: SIGCHLD does not ask a process to stop; accepted: SIGUSR1, "
            r"SIGUSR2, SIGTERM, SIGHUP, SIGQUIT, SIGXCPU$",
        ),
        (["checkpoint.save_on_signals=[KILL]"], r"save_on_signals\[0\]: KILL does not ask"),
        (["metrics.wandb=maybe"], r"metrics\.wandb: expected one of 'auto'"),
        (
            ["algo.use_engine_logprobs=true"],
            r"algo\.use_engine_logprobs: no longer a key; .* are algo\.mismatch=bypass",
        ),
        (["algo.mismatch=tls"], r"algo\.mismatch: unknown mode 'tls'; valid: none, bypass, tis"),
        (["algo.mismatch_upper=3"], r"algo\.mismatch_upper: only used by a correction"),
        (
            ["algo.mismatch=icepop", "algo.mismatch_level=sequence"],
            r"algo\.mismatch_level: icepop works at level token",
        ),
        (
            ["algo.mismatch=tis", "algo.mismatch_upper=0.5"],
            r"algo\.mismatch_upper: tis's cap C must be >= 1",
        ),
        (
            ["algo.mismatch=mis", "algo.mismatch_lower=1.2"],
            r"algo\.mismatch_lower, algo\.mismatch_upper: mis .* 0 <= lower < 1 < upper",
        ),
        (
            ["algo.mismatch=mis", "algo.mismatch_mask_level=geometric"],
            r"algo\.mismatch_mask_level: only tis takes a mask, not algo\.mismatch=mis",
        ),
        (
            ["algo.mismatch=tis", "algo.mismatch_mask_upper=3"],
            r"algo\.mismatch_mask_upper: only used with a mask \(algo\.mismatch_mask_level\)",
        ),
        (
            [
                "algo.mismatch=tis",
                "algo.mismatch_mask_level=geometric",
                "algo.mismatch_mask_lower=1",
            ],
            r"algo\.mismatch_mask_lower, algo\.mismatch_mask_upper: mis .* 0 <= lower < 1",
        ),
        (["algo.dual_clip=1"], r"algo\.dual_clip: expected 0 \(off\) or > 1, got 1"),
        (["algo.loss=cispo", "algo.dual_clip=3"], r"algo\.dual_clip: loss 'cispo' has no"),
        (["algo.entropy_coef=-0.01"], r"algo\.entropy_coef: expected >= 0"),
        (["model.dispatcher=flex"], r"model\.dispatcher: expected one of 'alltoall'"),
        (["model.aux_loss_coeff=-0.01"], r"model\.aux_loss_coeff: expected a finite number >= 0"),
        (["run.micro_batch_tokens=0"], r"run\.micro_batch_tokens: expected > 0, got 0"),
        (
            ["model.router_bias_update_rate=-1"],
            r"model\.router_bias_update_rate: expected a finite number >= 0",
        ),
        (
            ["algo.routing_replay=r2", "algo.mismatch=bypass"],
            r"algo\.routing_replay=r2 records routing in the trainer's old-policy forward",
        ),
        (["rollout.max_staleness=-1"], r"rollout\.max_staleness: expected >= 0 \(0: lock-step\)"),
        (
            ["rollout.max_staleness=4", "run.steps=3"],
            r"rollout\.max_staleness: expected at most run\.steps = 3 .*got 4",
        ),
        (
            ["rollout.local_process=true", "rollout.backend=sglang"],
            r"rollout\.local_process: runs the local engine in a process of its own; rollout\.b",
        ),
        (
            ["rollout.partial_rollouts=true"],
            r"rollout\.partial_rollouts: needs rollout\.max_staleness >= 1",
        ),
        (
            [
                "rollout.partial_rollouts=true",
                "rollout.max_staleness=1",
                "algo.routing_replay=r3",
            ],
            r"rollout\.partial_rollouts: algo\.routing_replay=r3 replays the routing",
        ),
        (
            ["algo.routing_replay=r3_weights", "rollout.backend=sglang"],
            r"algo\.routing_replay=r3_weights replays the engine's gate weights, which only the "
            r"in-process engine returns",
        ),
    ],
)
def test_trainer_sections_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Recipe, None, overrides)


def test_every_recipe_key_is_documented():
    import dataclasses
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    guide = "".join((docs / page).read_text() for page in ("training.md", "recipe.md", "sglang.md"))

    def keys(config: object, prefix: str) -> list[str]:
        found = []
        for item in dataclasses.fields(config):
            value = getattr(config, item.name)
            dotted = f"{prefix}.{item.name}" if prefix else item.name
            found += keys(value, dotted) if dataclasses.is_dataclass(value) else [dotted]
        return found

    all_keys = keys(Recipe(), "")
    assert "rollout.sglang.weight_sync" in all_keys  # nested sections are walked
    for key in all_keys:
        assert f"`{key}`" in guide, key


def test_the_old_engine_logprobs_key_in_a_recipe_file_names_its_replacement(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("algo:\n  use_engine_logprobs: true\n")
    with pytest.raises(ConfigError, match=r"algo\.use_engine_logprobs: no longer a key; .*bypass"):
        load_config(Recipe, path)


def test_the_loss_spec_carries_the_correction_dual_clip_and_entropy_bonus():
    spec = load_config(Recipe, None, ["algo.loss=grpo"]).algo.loss_spec(max_response_len=8)
    assert spec.options.dual_clip == 3.0  # the loss's own default
    assert spec.options.mismatch is None and spec.options.entropy_coef == 0.0
    assert not spec.options.check_finite  # the step is skipped and counted instead
    overrides = [
        "algo.loss=grpo",
        "algo.dual_clip=0",
        "algo.mismatch=mis",
        "algo.entropy_coef=1e-3",
    ]
    spec = load_config(Recipe, None, overrides).algo.loss_spec(max_response_len=8)
    assert spec.options.dual_clip is None  # 0: off
    assert spec.options.mismatch == MismatchCorrection("mis", "sequence", 0.0, 2.0)
    assert spec.options.entropy_coef == 1e-3
    spec = load_config(
        Recipe, None, ["algo.dual_clip=5", "algo.mismatch=tis", "algo.mismatch_level=geometric"]
    ).algo.loss_spec(max_response_len=8)
    assert spec.options.dual_clip == 5.0
    assert spec.options.mismatch == MismatchCorrection("tis", "geometric", None, 2.0)
