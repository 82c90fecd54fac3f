#!/usr/bin/env bash
# The GPU-only tests, for a machine with CUDA and an existing torch (e.g. a lent GPU machine):
# megatron-core and the project's pure-Python pins come from wheels carried in .whl/ when they
# cannot be installed from an index there. Writes the pytest log to $OUT/gpu-tests.log if OUT
# is set.
#
#   bash scripts/gpu_check.sh [SITE]
#
# The wheels go into SITE, first on PYTHONPATH, and stay there (scripts/gpu_bench.sh runs its
# benchmarks with them); without SITE, into a fresh temporary directory removed on exit. Never a
# fixed path in /tmp: whoever made it first would decide what Python imports here.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root" || exit 1
if [ -d .whl ]; then
    site="${1:-}"
    if [ -z "$site" ]; then
        site="$(mktemp -d)" || exit 1
        trap 'rm -rf "$site"' EXIT
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || exit 1
    export PYTHONPATH="$site:$repo_root"
else
    export PYTHONPATH="$repo_root"
fi
log="${OUT:-/tmp}/gpu-tests.log"
nvidia-smi -L 2>&1 | tee "$log"
PYTHONUNBUFFERED=1 python3 -m pytest tests/gpu -m gpu -v -p no:cacheprovider 2>&1 | tee -a "$log"
