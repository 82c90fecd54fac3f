#!/usr/bin/env bash
# Create or reuse the virtual environment at <repo>/.venv and install megatron-rl into it.
# Idempotent: when setup.py (where every pin lives) is unchanged since the last successful
# install, nothing is installed again. Source it or run it; it prints the venv's python path.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3

stamp="$venv/.megatron-rl-installed"
want="$(cat "$repo_root/setup.py" "$repo_root/pyproject.toml" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating virtual environment at $venv" >&2
    "$python_bin" -m venv "$venv"
fi

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing megatron-rl and its pinned dependencies into $venv" >&2
    # torch first and alone, exactly pinned, so that no other package's loose requirement can
    # pull a multi-GB CUDA build; on this machine kind pip takes the CPU wheel that lies on disk
    # (uv does not look there). uv then installs the rest: pip's resolution, in seconds, and
    # compiled to bytecode as pip does (where PYTHONDONTWRITEBYTECODE is set, every process
    # would otherwise compile each module it imports, at every start).
    torch_pin="$(grep -oE '"torch==[^"]+"' "$repo_root/setup.py" | tr -d '"')"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$torch_pin" uv==0.13.8
    "$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" -e "${repo_root}[test]"
    echo "$want" > "$stamp.tmp" && mv "$stamp.tmp" "$stamp"
else
    echo "[setup] $venv is up to date" >&2
fi
