#!/usr/bin/env bash
# Set everything up (idempotent) and run the project's main job: GSPO on the tiny
# Qwen3-MoE-shaped model (examples/moe/tiny_gspo.yaml) on this machine's CPU.
# Extra arguments are recipe overrides (KEY=VALUE) or --resume.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo_root/scripts/setup_env.sh"
cd "$repo_root"
exec .venv/bin/megatron-rl train examples/moe/tiny_gspo.yaml "$@"
