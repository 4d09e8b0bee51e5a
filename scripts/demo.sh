#!/usr/bin/env bash
# The flux-hpc demo: set up (idempotent), build, then train flux_tiny with flow matching on two
# MPI ranks (data parallel) and show the loss curve. Extra arguments go to `flux-hpc train`
# (e.g. --set training.total_steps=100).
#
#   bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
cargo build --quiet
mpirun --allow-run-as-root --oversubscribe -np 2 --mca btl_vader_single_copy_mechanism none \
    target/debug/flux-hpc train configs/flux_tiny.toml "$@"
