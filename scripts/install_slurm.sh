#!/usr/bin/env bash
# The SLURM tests' cluster (tests/launch/slurm_cluster.py): Debian's slurm-wlm and munge, and the
# linter of the rendered scripts (shellcheck). Idempotent; installs only what is missing, as
# root. Not root (or no apt-get): says so, and the SLURM tests skip with that reason.
set -euo pipefail
missing=()
for tool in sbatch slurmctld slurmd munged shellcheck; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_slurm.sh: ${missing[*]} missing and this is not root with apt-get;" \
    "the SLURM tests will skip" >&2
  exit 0
fi
echo "install_slurm.sh: installing slurm-wlm, munge and shellcheck (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q slurm-wlm munge shellcheck >/dev/null ||
  { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge shellcheck >/dev/null; }
