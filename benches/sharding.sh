#!/usr/bin/env bash
# Sharded data parallelism side by side: flux-hpc's `[parallelism] sharding = "optimizer"`
# (ZeRO-1), `"gradients"` (ZeRO-2) and `"full"` (ZeRO-3) against plain data parallelism, and
# PyTorch's ZeroRedundancyOptimizer under DDP and FSDP2 (`fully_shard`, weights kept gathered
# between forward and backward, or resharded after forward) against plain DDP, all over gloo or MPI on 2 ranks of one thread each,
# the same model and global batch (benches/side_by_side.toml, one sample per rank), f32 and
# (flux-hpc) bf16 with f32 masters. The configurations are alternated round by round. Prints
# per-rank optimizer state and model state (weights present, gradients and optimizer state after
# the last step), rank 0's peak RSS and the median step time. flux-hpc reduces in
# buckets of 25 MiB, DDP's default.
#
#   bash benches/sharding.sh              # ROUNDS=3 STEPS=3
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-3}
OUT=${OUT:-$(mktemp -d /tmp/flux-sharding.XXXX)}
CONFIG=benches/side_by_side.toml
BIN=target/debug/flux-hpc
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none
        --mca btl_vader_single_copy_mechanism none -np 2)
mkdir -p "$OUT"
results="$OUT/sharding.jsonl"
: > "$results"

bash scripts/setup.sh >/dev/null
cargo build --quiet --bin flux-hpc
say() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

step=(step "$CONFIG" --threads 1 --steps "$STEPS" --warmup 1)
flux() {
    "${MPIRUN[@]}" "$BIN" bench "${step[@]}" --device cpu --set training.micro_batch_size=1 \
        --set "parallelism.sharding=\"$1\"" --set "training.precision=\"$2\"" \
        --set parallelism.bucket_mib=25 2>/dev/null
}
torch() {
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 benches/pytorch_reference.py \
        "${step[@]}" "$@" 2>/dev/null
}

for round in $(seq "$ROUNDS"); do
    say "round $round/$ROUNDS"
    flux none fp32 >> "$results"
    torch --sharding optimizer >> "$results"
    flux optimizer fp32 >> "$results"
    torch --sharding gradients >> "$results"
    flux gradients fp32 >> "$results"
    torch --sharding full >> "$results"
    flux full fp32 >> "$results"
    torch --sharding none >> "$results"
    flux none bf16 >> "$results"
    flux optimizer bf16 >> "$results"
    flux gradients bf16 >> "$results"
    flux full bf16 >> "$results"
done

.venv/bin/python benches/sharding_report.py "$results"
say "raw results: $results"
