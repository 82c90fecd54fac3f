#!/usr/bin/env bash
# Everything a lent GPU is for, in one run: the GPU tests (scripts/gpu_check.sh), the training
# step of a ~3 B-parameter MoE in bf16 (tokens/s and MFU against the matrix-product peak
# measured in the same run; with and without recompute), the log-prob kernel against the
# memory-bandwidth floor, padding's cost (rows, token budget, packed) and fine-grained experts.
# Results under $OUT (default /tmp/gpu-bench): JSON + markdown per benchmark, the logs, nvidia-smi's view of the GPU. SGLang is not on the GPU machine's image and
# too large to carry (64 MiB), so weight sync into a GPU SGLang server is not measured here.
# Carry megatron-core (and any pin the image lacks) as wheels in .whl/ (scripts/gpu_check.sh).
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root" || exit 1
out="${OUT:-/tmp/gpu-bench}"
mkdir -p "$out"
# the wheels of .whl/, installed by gpu_check.sh into a directory of this run's own
site="$(mktemp -d)" || exit 1
trap 'rm -rf "$site"' EXIT
OUT="$out" bash scripts/gpu_check.sh "$site"
if [ -d .whl ]; then
  export PYTHONPATH="$site:$repo_root"
else
  export PYTHONPATH="$repo_root"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv |
  tee "$out/gpu.csv"
bench() {  # NAME ARGS...: one benchmark, its output under $out/NAME
  local name=$1
  shift
  PYTHONUNBUFFERED=1 python3 -m megatron_rl.cli bench "$@" --out "$out/$name" 2>&1 |
    tee "$out/$name.log"
}
bench train-step train-step --micro-batch 1 --micro-batches 4
bench train-step-recompute train-step --micro-batch 4 --micro-batches 2 --recompute
bench logprobs logprobs --device cuda --tokens 16384 --repeats 10
# rows vs token budget vs packed: Transformer Engine's THD attention where the image has TE,
# megatron_rl.models.packed_attention on CUDA otherwise
bench packing packing
bench experts experts
