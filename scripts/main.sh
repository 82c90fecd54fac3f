#!/usr/bin/env bash
# Set everything up (idempotent) and run the project's main job.
# Until the RL trainer lands, the main job is the loss comparison table: every registered policy
# loss evaluated on one synthetic rollout batch whose token log-ratios mimic MoE routing drift.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo_root/scripts/setup_env.sh"
cd "$repo_root"
exec .venv/bin/megatron-rl losses "$@"
