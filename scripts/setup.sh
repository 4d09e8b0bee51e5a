#!/usr/bin/env bash
# flux-hpc set-up: installs everything the build and the tests need, idempotently.
#
#   bash scripts/setup.sh
#
# 1. Debian packages (compilers, libclang for rsmpi's bindgen, HDF5, OpenMPI, gloo's headers for
#    c10d's ProcessGroupGloo, Slurm and munge for the local test cluster of scripts/slurm-local.sh).
# 2. A git-ignored virtual environment `.venv/` with torch 2.13.0 (the libtorch tch 0.26 links)
#    and the reference packages used to make test fixtures and benchmarks (diffusers,
#    safetensors, h5py, peft for diffusers' LoRA loader, torchao for float8 training), and the
#    two CUDA header wheels (crt, cccl) the wheel's own CUDA packages leave out, which
#    ProcessGroupNCCL's header needs.
# 3. A `.libtorch` link to the wheel's libtorch, which `.cargo/config.toml` points `LIBTORCH` at,
#    so plain `cargo build` / `cargo test` need no exported variables.
# A second run only checks and skips.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

TORCH_VERSION=2.13.0
DIFFUSERS_VERSION=0.42.1
PEFT_VERSION=0.21.2
TENSORBOARD_VERSION=2.21.0
TORCHAO_VERSION=0.18.0
# The CUDA 13.0 headers torch 2.13's cu13 wheels do not ship (host_config.h, libcu++'s nv/):
# header-only, 40 MB, and needed to compile flux-hpc's c10d NCCL bridge, not to run anything.
CUDA_HEADER_WHEELS=("nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85")
APT_PACKAGES=(build-essential pkg-config clang libclang-dev libhdf5-dev hdf5-tools
              libopenmpi-dev openmpi-bin libgloo-dev fonts-dejavu-core slurm-wlm munge)

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# --- 1. Debian packages -------------------------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
else
    say "Debian packages present: ${APT_PACKAGES[*]}"
fi

# --- 2. Python virtual environment --------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    python3 -m venv .venv
fi
py=.venv/bin/python
have_torch="$($py -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [ "$have_torch" != "$TORCH_VERSION" ]; then
    say "installing torch==$TORCH_VERSION into .venv (about 5 GB with its CUDA libraries)"
    $py -m pip install -q --upgrade pip
    $py -m pip install -q "torch==$TORCH_VERSION"
else
    say "torch $TORCH_VERSION present in .venv"
fi
if ! $py -c "import diffusers, safetensors, h5py; assert diffusers.__version__ == '$DIFFUSERS_VERSION'" 2>/dev/null; then
    say "installing diffusers==$DIFFUSERS_VERSION, safetensors and h5py into .venv"
    $py -m pip install -q "diffusers==$DIFFUSERS_VERSION" safetensors numpy h5py
else
    say "diffusers $DIFFUSERS_VERSION, safetensors and h5py present in .venv"
fi
cuda_include="$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13/include"
if [ ! -f "$cuda_include/crt/host_config.h" ] || [ ! -d "$cuda_include/cccl/nv" ]; then
    say "installing the CUDA header wheels ${CUDA_HEADER_WHEELS[*]} into .venv"
    $py -m pip install -q --no-deps "${CUDA_HEADER_WHEELS[@]}"
else
    say "CUDA headers (crt, cccl) present in .venv"
fi
# PEFT: diffusers' LoRA loader, which the LoRA tests load flux-hpc's adapters through.
if ! $py -c "import peft; assert peft.__version__ == '$PEFT_VERSION'" 2>/dev/null; then
    say "installing peft==$PEFT_VERSION into .venv"
    $py -m pip install -q "peft==$PEFT_VERSION"
else
    say "peft $PEFT_VERSION present in .venv"
fi

# TensorBoard: the tests read the event files training writes back through its own reader.
if ! $py -c "import tensorboard; assert tensorboard.__version__ == '$TENSORBOARD_VERSION'" 2>/dev/null; then
    say "installing tensorboard==$TENSORBOARD_VERSION into .venv"
    $py -m pip install -q "tensorboard==$TENSORBOARD_VERSION"
else
    say "tensorboard $TENSORBOARD_VERSION present in .venv"
fi

# torchao: the float8 training reference the FP8 tests' fixtures come from.
if ! $py -c "import torchao; assert torchao.__version__ == '$TORCHAO_VERSION'" 2>/dev/null; then
    say "installing torchao==$TORCHAO_VERSION into .venv"
    $py -m pip install -q --no-deps "torchao==$TORCHAO_VERSION"
else
    say "torchao $TORCHAO_VERSION present in .venv"
fi

# --- 3. libtorch link used by .cargo/config.toml ------------------------------------------------
torch_dir="$($py -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
if [ "$(readlink .libtorch 2>/dev/null)" != "$torch_dir" ]; then
    say "linking .libtorch -> $torch_dir"
    ln -sfn "$torch_dir" .libtorch
else
    say ".libtorch -> $torch_dir"
fi
say "done"
