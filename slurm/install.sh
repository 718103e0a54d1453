#!/usr/bin/env bash
# Install Debian's SLURM (slurmctld, slurmd, client) and munge when any is missing.
# Idempotent; needs root (or sudo) and a Debian/Ubuntu apt source.
set -euo pipefail

need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd    >/dev/null 2>&1 || need+=(slurmd)
command -v sinfo     >/dev/null 2>&1 || need+=(slurm-client)
command -v munged    >/dev/null 2>&1 || need+=(munge)
if [ ${#need[@]} -eq 0 ]; then
  echo "slurm/install.sh: slurmctld, slurmd, slurm-client and munge already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
echo "slurm/install.sh: installing ${need[*]}"
# A fresh container may have no package lists yet.
if ! $SUDO apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge; then
  $SUDO apt-get update
  $SUDO apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
fi
for b in slurmctld slurmd sinfo munged; do
  command -v "$b" >/dev/null 2>&1 || { echo "slurm/install.sh: $b still missing after install" >&2; exit 1; }
done
echo "slurm/install.sh: done ($(slurmctld -V))"
