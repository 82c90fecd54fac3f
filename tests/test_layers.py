"""The package's layers: every module imports only from its own layer and the ones below it
(docs/architecture.md, "Layers"); `algo` imports only torch; wandb is imported in one module;
nothing imports the CLI. Checked by parsing every import statement, the ones inside functions
included."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_rl"

# Lowest first. A module's layer is its top-level name under megatron_rl/.
LAYERS = (
    "algo",
    "process",
    "config",
    "rewards",
    "parallel",
    "files",
    "models",
    "moe",
    "checkpoint",
    "rollout",
    "trainer",
    "bench",
    "launch",
    "cli",
)


def _imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `source`, absolute or relative to megatron_rl."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(f"line {node.lineno}: relative import; write it absolute")
            if node.module == "megatron_rl":  # from megatron_rl import <subpackage>
                found += [(node.lineno, f"megatron_rl.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def _layer(module: str) -> str | None:
    """The layer of `megatron_rl.X...`; None for the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(module: str, source: str) -> list[str]:
    """The imports of `module` (its `source`) from a layer above its own."""
    own = LAYERS.index(_layer(module))
    violations = []
    for line, imported in _imports(source):
        if imported.split(".")[0] != "megatron_rl" or _layer(imported) is None:
            continue
        if _layer(imported) not in LAYERS:
            violations.append(f"{module}:{line} imports {imported}, which is in no layer")
        elif LAYERS.index(_layer(imported)) > own:
            violations.append(f"{module}:{line} imports {imported} from a higher layer")
    return violations


def _modules() -> dict[str, str]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path.read_text()
    return modules


def test_every_module_belongs_to_a_layer():
    unplaced = [m for m in _modules() if _layer(m) is not None and _layer(m) not in LAYERS]
    assert not unplaced, f"add these to LAYERS and to docs/architecture.md's Layers: {unplaced}"


def test_no_module_imports_from_a_higher_layer():
    violations = [v for m, s in _modules().items() if _layer(m) for v in upward_imports(m, s)]
    assert not violations, "\n".join(violations)


def test_the_check_catches_an_upward_import():
    lazy = "def f():\n    from megatron_rl.trainer.loop import train\n"
    assert upward_imports("megatron_rl.models.build", lazy) == [
        "megatron_rl.models.build:2 imports megatron_rl.trainer.loop from a higher layer"
    ]
    assert upward_imports("megatron_rl.trainer.loop", "import megatron_rl.models.build\n") == []
    assert "in no layer" in upward_imports("megatron_rl.cli", "from megatron_rl import utils2\n")[0]
    with pytest.raises(AssertionError, match="relative import"):
        upward_imports("megatron_rl.cli", "from .trainer import loop\n")


def _third_party(source: str) -> set[str]:
    roots = {imported.split(".")[0] for _, imported in _imports(source)}
    return roots - set(sys.stdlib_module_names) - {"megatron_rl", "__future__"}


def test_algo_imports_only_torch():
    for module, source in _modules().items():
        if _layer(module) == "algo":
            assert _third_party(source) <= {"torch"}, module


def test_wandb_is_imported_in_one_module_and_the_cli_by_none():
    wandb = [m for m, s in _modules().items() if "wandb" in _third_party(s)]
    assert wandb == ["megatron_rl.trainer.metrics"]
    cli_users = [
        m
        for m, s in _modules().items()
        if _layer(m) != "cli" and any(i.startswith("megatron_rl.cli") for _, i in _imports(s))
    ]
    assert not cli_users


def test_the_architecture_guide_draws_the_same_layers():
    guide = (REPO / "docs" / "architecture.md").read_text()
    section = guide.split("## Layers", 1)[1].split("\n#", 1)[0]
    drawn = re.findall(r"^\s*\d+\s+(\w+)", section, flags=re.MULTILINE)
    assert tuple(drawn) == LAYERS
