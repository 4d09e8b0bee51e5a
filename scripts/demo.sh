#!/usr/bin/env bash
# The flux-hpc demo: set up (idempotent), build, and time a Flux forward pass on random inputs.
# Extra arguments go to `flux-hpc demo` (try --help, --heads 24, --resolution 1024x1024).
#
#   bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
cargo run --quiet -- demo configs/flux_535m.toml "$@"
