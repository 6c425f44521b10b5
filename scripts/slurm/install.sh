#!/usr/bin/env bash
# Install Debian's slurm-wlm and munge for the real-SLURM tests (tests/multiprocess/test_slurm.py
# starts its own one-node cluster from them: scripts/slurm/local-cluster.sh). Runs apt-get, so
# only as root; otherwise, or with GRADSYNC_SKIP_SLURM_INSTALL=1, it says why it did nothing
# and the SLURM tests are skipped with the reason. Never fails the caller.
set -uo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
    && command -v munged >/dev/null; then
  echo "SLURM: slurm-wlm and munge are installed"
  exit 0
fi
if [ -n "${GRADSYNC_SKIP_SLURM_INSTALL:-}" ]; then
  echo "SLURM: not installed (GRADSYNC_SKIP_SLURM_INSTALL is set): the SLURM tests will be skipped"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "SLURM: not installed (installing slurm-wlm and munge needs root): the SLURM tests will be skipped"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "SLURM: not installed (no apt-get: the tests use Debian's slurm-wlm and munge): the SLURM tests will be skipped"
  exit 0
fi
echo "SLURM: installing slurm-wlm and munge with apt-get"
log=$(mktemp)
if DEBIAN_FRONTEND=noninteractive apt-get update -q >"$log" 2>&1 \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$log" 2>&1; then
  rm -f "$log"
  echo "SLURM: installed"
else
  tail -n 20 "$log" >&2
  rm -f "$log"
  echo "SLURM: apt-get failed (above): the SLURM tests will be skipped"
fi
exit 0
