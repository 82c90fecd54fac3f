#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole CPU test suite: lint, format check, pytest.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo_root/scripts/setup_env.sh"
# The SGLang tier (tests/sglang) runs a real SGLang server from its own environment.
bash "$repo_root/scripts/install_sglang_cpu.sh"
# The SLURM tier (tests/launch) runs a real single-node SLURM.
bash "$repo_root/scripts/install_slurm.sh"
cd "$repo_root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two worker processes, one per core of the CI machine: most tests compute on one thread
# (tests/conftest.py); tests/scheduling.py keeps each module whole on one worker, and the
# modules that start servers on fixed ports together on one.
exec .venv/bin/python -m pytest -n 2 "$@"
