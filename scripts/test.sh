#!/usr/bin/env bash
# Run the whole flux-hpc test suite: set-up (idempotent), reference fixtures, lints, a local
# one-node Slurm, tests.
#
#   bash scripts/test.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

if [ ! -f tests/fixtures/data/flux_guidance_on/io.safetensors ]; then
    echo "[test] making model fixtures from diffusers"
    .venv/bin/python tests/fixtures/make_flux_fixtures.py
fi
if [ ! -f tests/fixtures/data/flux2/bfl.safetensors ]; then
    echo "[test] making FLUX.2 fixtures from diffusers"
    .venv/bin/python tests/fixtures/make_flux2_fixtures.py
fi
if [ ! -f tests/fixtures/data/text/clip_outputs.safetensors ]; then
    echo "[test] making tokenizer and text-encoder fixtures from transformers"
    .venv/bin/python tests/fixtures/make_text_fixtures.py tests/fixtures/data/text
fi
if [ ! -f tests/fixtures/data/vae/bfl_outputs.safetensors ]; then
    echo "[test] making autoencoder fixtures from diffusers"
    .venv/bin/python tests/fixtures/make_vae_fixtures.py tests/fixtures/data/vae
fi
if [ ! -f tests/fixtures/data/fp8/bad_shape.safetensors ]; then
    echo "[test] making float8 linear fixtures from torchao and float8 weight files"
    .venv/bin/python tests/fixtures/make_fp8_fixtures.py
fi
if [ ! -f tests/fixtures/data/scheduler.json ]; then
    echo "[test] making scheduler fixtures from diffusers"
    .venv/bin/python tests/fixtures/make_scheduler_fixtures.py
fi

echo "[test] cargo fmt --check"
cargo fmt --all -- --check
echo "[test] cargo clippy -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
# The Slurm tests submit to a one-node cluster on this machine; start it for the run (the tests
# would start it themselves) and stop it afterwards unless it was already running.
if bash scripts/slurm-local.sh status >/dev/null 2>&1; then
    echo "[test] using the running local Slurm"
else
    bash scripts/slurm-local.sh start >/dev/null
    trap 'bash scripts/slurm-local.sh stop' EXIT
fi

echo "[test] cargo test"
cargo test --workspace
