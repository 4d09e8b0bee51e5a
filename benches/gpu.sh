#!/usr/bin/env bash
# flux_535m at 1024×1024 (4096 image + 512 text tokens) in bf16 on one CUDA GPU: samples/s and
# model FLOPs utilisation of a training step and of a forward pass, against the same GPU's
# measured bf16 matmul rate; then the encoders on the GPU (T5 parity in f32 and bf16, `data
# encode` throughput against diffusers + transformers). Prints a table and two reports.
#
#   bash benches/gpu.sh                   # MICRO=8 STEPS=10
#
# Needs the CUDA build of torch that scripts/setup.sh installs and a visible GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MICRO=${MICRO:-8}
STEPS=${STEPS:-10}
BIN=target/debug/flux-hpc
bash scripts/setup.sh >/dev/null
cargo build --quiet --bin flux-hpc

shape=(--set training.global_batch_size="$MICRO" --set training.micro_batch_size="$MICRO"
       --set training.precision=\"bf16\" --set training.latent_height=64
       --set training.latent_width=64 --set training.text_len=512)
common=(configs/flux_535m.toml --device cuda --steps "$STEPS" --warmup 3 "${shape[@]}")
peak=$("$BIN" bench matmul --device cuda --bf16 --size 8192 --repeats 20 2>/dev/null)
step=$("$BIN" bench step "${common[@]}" 2>/dev/null)
forward=$("$BIN" bench forward "${common[@]}" 2>/dev/null)

python3 - "$peak" "$step" "$forward" <<'PY'
import json, sys
peak, step, forward = (json.loads(a) for a in sys.argv[1:])
rate = peak["flops_per_s"]
print(f"flux_535m, 1024² (4096 + 512 tokens), bf16, batch {step['samples']}, {step['device']}")
print(f"{'':<14}{'median s':>10}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>7}")
for name, r in (("training step", step), ("forward", forward)):
    achieved = r["flops"] / r["median_s"]
    print(f"{name:<14}{r['median_s']:>10.4f}{r['samples_per_s']:>11.2f}"
          f"{achieved / 1e12:>9.1f}{achieved / rate:>7.0%}")
print(f"{'bf16 matmul':<14}{'':>10}{'':>11}{rate / 1e12:>9.1f}  (8192², the MFU denominator)")
print(f"peak host RSS {step['peak_rss_mib']:.0f} MiB")
PY

# The encoders on the GPU, as `data encode` and `sample` run them there: T5 in f32 and in bf16
# against transformers' outputs (tests/fixtures/make_text_fixtures.py), then `data encode`
# against diffusers + transformers with T5 in bf16 on FLUX.1-shaped random encoders.
if [ ! -f tests/fixtures/data/text/t5_outputs.safetensors ]; then
    .venv/bin/python tests/fixtures/make_text_fixtures.py tests/fixtures/data/text >/dev/null
fi
echo
echo "T5 encoder on cuda against transformers (bounds: f32 1e-5, bf16 0.1):"
FLUX_TEST_DEVICE=cuda cargo test --quiet -p flux-encoders --test t5 -- --nocapture 2>&1 |
    grep -E "max abs error|test result"
DEVICE=cuda IMAGES=${ENCODE_IMAGES:-32} SIZE=1024 BATCH=8 ROUNDS=2 bash benches/encode.sh
