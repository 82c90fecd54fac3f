"""The SGLang tier: one real SGLang 0.5.23 server for the whole test session.

The server runs from .venv-sglang (scripts/install_sglang_cpu.sh, which scripts/test.sh runs
first) with the test-only CPU shims of tests/sglang/cpu_shims, on the tiny model in float32,
with routed experts on. Its launch settings are those of the CPU example recipe
(examples/moe/tiny_gspo_sglang.yaml) on a port of its own. Without that environment the tier
fails, loudly: it never skips.

Tests that change the server's weights put the base weights back (`base_weights`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.rollout.sglang import ServerGroup
from megatron_rl.rollout.sglang.api_key import run_key
from megatron_rl.trainer.recipe import Recipe
from tests.trainer.run_cli import SGLANG_RECIPE

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = str(REPO / "examples" / "moe" / "tiny_qwen3_moe")
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
TEST_PORT = 30700
ROUTING_SHAPE = (4, 2)  # the tiny model: 4 MoE layers, top-2


def cpu_servers(
    port: int, log_dir: Path, *, routed_experts: bool = True, model: str = TINY_MODEL
) -> ServerGroup:
    """Servers of the example recipe's CPU settings for `model`, on `port`, with absolute paths
    (the tests may run from any directory), taking a key made in `log_dir`."""
    config = load_config(Recipe, SGLANG_RECIPE).rollout.sglang
    env = dict(config.env) | {"PYTHONPATH": str(REPO / "tests" / "sglang" / "cpu_shims")}
    config = dataclasses.replace(
        config, python=str(SGLANG_PYTHON), env=env, base_port=port, startup_timeout_s=240.0
    )
    return ServerGroup(
        config, model, log_dir, api_key=run_key(log_dir), seed=0, routed_experts=routed_experts
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The session's server starts inside the first test that asks for it (start-up may take its
    240 s): the tier's tests get 600 s each, not the default limit (pyproject.toml), unless they
    say otherwise."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(600))


@pytest.fixture(scope="session")
def sglang_servers(tmp_path_factory):
    if not SGLANG_PYTHON.is_file():
        pytest.fail(
            f"{SGLANG_PYTHON} is missing: the SGLang tier needs "
            "`bash scripts/install_sglang_cpu.sh` (scripts/test.sh runs it)"
        )
    group = cpu_servers(TEST_PORT, tmp_path_factory.mktemp("sglang_logs"))
    with group:
        yield group


@pytest.fixture
def base_weights(sglang_servers):
    """Put the tiny model's own weights back into the session's server after the test."""
    yield
    server = sglang_servers.servers[0]
    if not server.alive():
        sglang_servers.restart(0)
    connection = server.connection
    connection.post(
        "/update_weights_from_disk", {"model_path": TINY_MODEL, "weight_version": "base"}
    )


def tiny_tensor_shapes() -> dict[str, tuple[int, ...]]:
    checkpoint = HFCheckpoint(TINY_MODEL)
    shapes = {name: checkpoint.shape(name) for name in checkpoint.names()}
    checkpoint.close()
    return shapes
