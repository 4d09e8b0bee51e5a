#!/usr/bin/env bash
# flux_535m at 1024×1024 (4096 image + 512 text tokens) in bf16 on one CUDA GPU: samples/s and
# model FLOPs utilisation of a training step and of a forward pass, against the same GPU's
# measured bf16 matmul rate, and the step's peak tensor memory against `flux-hpc plan`; the same
# training step in fp8 (float8 GEMMs, torchao's tensorwise recipe) against bf16; then the
# encoders on the GPU (T5 parity in f32 and bf16, `data encode` throughput against diffusers +
# transformers), fully sharded training of two ranks sharing the GPU against one process, and
# NCCL through c10d (every collective on CUDA tensors, nothing staged through host memory).
# Prints a table and four reports.
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
fp8=$("$BIN" bench step "${common[@]}" --set training.precision=\"fp8\" 2>/dev/null)

python3 - "$peak" "$step" "$forward" "$fp8" <<'PY'
import json, sys
peak, step, forward, fp8 = (json.loads(a) for a in sys.argv[1:])
rate = peak["flops_per_s"]
print(f"flux_535m, 1024² (4096 + 512 tokens), bf16, batch {step['samples']}, {step['device']}")
print(f"{'':<14}{'median s':>10}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>7}")
for name, r in (("training step", step), ("forward", forward)):
    achieved = r["flops"] / r["median_s"]
    print(f"{name:<14}{r['median_s']:>10.4f}{r['samples_per_s']:>11.2f}"
          f"{achieved / 1e12:>9.1f}{achieved / rate:>7.0%}")
print(f"{'bf16 matmul':<14}{'':>10}{'':>11}{rate / 1e12:>9.1f}  (8192², the MFU denominator)")
print(f"peak host RSS {step['peak_rss_mib']:.0f} MiB")
print(f"fp8 training step {fp8['median_s']:.4f} s ({step['median_s'] / fp8['median_s']:.2f}× bf16's), "
      f"peak tensors {fp8['peak_tensor_mib']:.0f} MiB against bf16's {step['peak_tensor_mib']:.0f}")
PY
# The memory plan against the caching allocator's peak of the same training step.
"$BIN" plan configs/flux_535m.toml --gpus 1 --kernels cuda --json "${shape[@]}" |
    python3 -c '
import json, sys
plan, step = json.load(sys.stdin), json.loads(sys.argv[1])
predicted, measured = plan["memory"]["peak"] / 2**20, step["peak_tensor_mib"]
phase = plan["memory"]["peak_phase"]
print(f"tensors at the peak: planned {predicted:.0f} MiB ({phase}), measured {measured:.0f} MiB "
      f"(max allocated), ratio {predicted / measured:.2f}")
' "$step"

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

# Sharded weights on the GPU: flux_tiny trained 5 steps as one process and as two ranks sharing
# the GPU with `sharding = "full"` (weights released in place and refilled by the CUDA caching
# allocator, per-layer gathers, gradient hooks on device tensors); the losses must agree. Over
# MPI: NCCL takes one rank per GPU.
echo
echo "sharding = \"full\" on cuda, 2 ranks against 1 (bound: 1e-4 relative):"
run=$(mktemp -d /tmp/flux-gpu-sharding.XXXX)
tiny=(configs/flux_tiny.toml --device cuda --set training.total_steps=5
      --set training.log_interval=1 --set training.eval_interval=5)
"$BIN" train "${tiny[@]}" --set checkpoint.dir=\""$run/one"\" >/dev/null 2>&1
mpirun --allow-run-as-root --oversubscribe --mca btl_vader_single_copy_mechanism none -np 2 \
    "$BIN" train "${tiny[@]}" \
    --set checkpoint.dir=\""$run/full"\" --set parallelism.sharding=\"full\" \
    --set parallelism.backend=\"mpi\" >/dev/null 2>&1
python3 - "$run" <<'PY'
import json, sys
def losses(d):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(f"{d}/metrics.jsonl")) if "loss" in r]
one, full = losses(f"{sys.argv[1]}/one"), losses(f"{sys.argv[1]}/full")
worst = max(abs(a - b) / max(abs(a), 1.0) for (_, a), (_, b) in zip(one, full))
print(f"steps {len(one)} and {len(full)}, largest relative loss difference {worst:.1e}",
      "ok" if len(one) == len(full) == 5 and worst <= 1e-4 else "FAILED")
PY

# NCCL through libtorch's c10d on a world of one: every collective on f32 and bf16 CUDA tensors
# checked against the expected values (the command fails otherwise), with no byte staged through
# host memory; MPI on the same tensors for contrast (it copies them through the host); then the
# bytes a training step staged under NCCL, which must be 0.
echo
echo "NCCL (c10d ProcessGroupNCCL) on cuda, a world of one:"
one=(mpirun --allow-run-as-root -np 1)
"${one[@]}" "$BIN" check-collectives configs/flux_tiny.toml --device cuda \
    --set parallelism.backend=\"nccl\" 2>&1 | grep -v "^\["
echo "the same over MPI (host staging):"
"${one[@]}" "$BIN" check-collectives configs/flux_tiny.toml --device cuda \
    --set parallelism.backend=\"mpi\" 2>&1 | grep "host staged in all"
"${one[@]}" "$BIN" bench step configs/flux_tiny.toml --device cuda --steps 3 --warmup 1 \
    --set parallelism.backend=\"nccl\" 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin)
staged, backend = r["host_staged_mib_per_step"], r["backend"]
print(f"training step over {backend}: {staged} MiB staged through host memory",
      "ok" if backend == "nccl" and staged == 0 else "FAILED")
'
