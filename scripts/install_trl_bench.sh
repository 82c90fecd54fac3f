#!/usr/bin/env bash
# Install TRL 1.16.0 into its own virtual environment, <repo>/.venv-trl, for `megatron-rl bench
# step`, which runs TRL's GRPOTrainer beside megatron-rl on the same work. TRL is not a
# dependency of megatron-rl: only the benchmark's peer script (megatron_rl/bench/peers) runs
# there. The pins follow setup.py where the two share a package (torch, transformers, datasets).
# Idempotent: nothing is installed when this script is unchanged since the last install.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv-trl"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3
packages=(trl==1.16.0 transformers==5.19.0 accelerate==1.15.0 datasets==5.2.0)

stamp="$venv/.trl-bench-installed"
want="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[trl-bench] $venv is up to date" >&2
    exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "[trl-bench] creating virtual environment at $venv" >&2
    "$python_bin" -m venv "$venv"
fi
echo "[trl-bench] installing ${packages[*]} into $venv" >&2
# torch first and alone: pip takes the CPU wheel that lies on disk on this machine kind (uv does
# not look there); uv then installs the rest.
torch_pin="$(grep -oE '"torch==[^"]+"' "$repo_root/setup.py" | tr -d '"')"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$torch_pin" uv==0.13.8
"$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" "${packages[@]}"
"$venv/bin/python" -c "import trl" || { echo "[trl-bench] trl does not import" >&2; exit 1; }
echo "$want" >"$stamp.tmp" && mv "$stamp.tmp" "$stamp"
echo "[trl-bench] ready: $venv/bin/python" >&2
