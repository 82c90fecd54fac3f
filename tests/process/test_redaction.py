"""Which names are secret, and their values hidden in command lines, environments and configs."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from megatron_rl.config import load_config
from megatron_rl.process.redaction import (
    REDACTED,
    is_secret_name,
    redacted_argv,
    redacted_config,
    redacted_env,
)
from megatron_rl.trainer.recipe import Recipe
from tests.trainer.run_cli import SGLANG_RECIPE


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "WANDB_API_KEY", "--api-key", "--hf-token", "db_password", "AWS_SECRET", "key"],
)
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["--tokenizer-path", "api_key_file", "--skip-tokenizer-init", "PYTHONPATH", "SSH_KEY_DIR", ""],
)
def test_names_that_are_not_secret(name):
    assert not is_secret_name(name)


def test_command_lines_keep_their_words_but_not_secret_values():
    argv = ["python", "-m", "x", "--api-key", "abc", "--hf-token=def", "--port", "1", "--token"]
    assert redacted_argv(argv) == [
        "python",
        "-m",
        "x",
        "--api-key",
        REDACTED,
        f"--hf-token={REDACTED}",
        "--port",
        "1",
        "--token",  # a secret flag with no value: nothing follows to hide
    ]
    # a flag right after a secret flag is a flag, not its value
    assert redacted_argv(["--api-key", "--port", "1"]) == ["--api-key", "--port", "1"]


def test_environments_hide_secret_values():
    env = {"HF_TOKEN": "hf_abc", "SGLANG_USE_CPU_ENGINE": "1"}
    assert redacted_env(env) == {"HF_TOKEN": REDACTED, "SGLANG_USE_CPU_ENGINE": "1"}


def test_a_recipe_as_a_config_hides_its_secrets_and_keeps_the_rest():
    recipe = load_config(Recipe, SGLANG_RECIPE, ["rollout.sglang.api_key_file=/run/key"])
    config = asdict(recipe)
    config["rollout"]["sglang"]["env"]["HF_TOKEN"] = "hf_abc"
    config["rollout"]["sglang"]["extra_args"] += ["--hf-token", "hf_def"]
    shown = redacted_config(config)
    sglang = shown["rollout"]["sglang"]
    assert sglang["env"]["HF_TOKEN"] == REDACTED
    assert sglang["env"]["SGLANG_USE_CPU_ENGINE"] == "1"
    assert sglang["extra_args"][-2:] == ["--hf-token", REDACTED]
    assert sglang["api_key_file"] == "/run/key"  # where the key is, not the key
    assert "hf_abc" not in repr(shown) and "hf_def" not in repr(shown)
    assert shown["optim"] == config["optim"]
    assert config["rollout"]["sglang"]["env"]["HF_TOKEN"] == "hf_abc"  # a copy was changed
