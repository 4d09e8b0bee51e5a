#!/usr/bin/env bash
# flux-hpc against PyTorch eager (diffusers' FluxTransformer2DModel) on the same work, in one run
# on this machine, with the two alternated round by round so drift in the machine's speed hits
# both. Prints one table (medians, ratios, MFU, scaling, memory, HDF5 read rate).
#
#   bash benches/side_by_side.sh                 # ROUNDS=3 STEPS=3 THREADS="1 2"
#   ROUNDS=5 STEPS=5 bash benches/side_by_side.sh
#
# Work: benches/side_by_side.toml (hidden 512, 8 heads, 2 joint + 4 single layers, 32×32 image +
# 128 text tokens, batch 2, f32): a training step (forward, backward, clipping, AdamW) and a
# forward pass, at each thread count; libtorch's matmul rate at each thread count (MFU);
# data-parallel scaling (1 vs 2 MPI ranks, one thread each, same per-rank batch); the overhead of
# tensor parallelism (2 ranks at TP=2 vs one rank, one thread each); reading a ~200 MB latent shard
# with flux-hpc's reader vs h5py; LoRA fine-tuning (rank 16 on every linear, base frozen) against
# full training and against diffusers + PEFT doing the same at the highest thread count; then
# benches/sharding.sh (optimizer and gradient sharding against plain data parallelism, PyTorch's
# ZeroRedundancyOptimizer and FSDP2). Raw JSON lines are kept in $OUT (default: a temp dir).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-3}
THREADS=${THREADS:-"1 2"}
LORA_RANK=${LORA_RANK:-16}
OUT=${OUT:-$(mktemp -d /tmp/flux-side-by-side.XXXX)}
CONFIG=benches/side_by_side.toml
PY=.venv/bin/python
BIN=target/debug/flux-hpc
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none
        --mca btl_vader_single_copy_mechanism none)
mkdir -p "$OUT"
results="$OUT/results.jsonl"
: > "$results"

bash scripts/setup.sh >/dev/null
cargo build --quiet --bin flux-hpc
say() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

flux() { "$BIN" bench "$@" 2>/dev/null; }
torch() { "$PY" benches/pytorch_reference.py "$@"; }

# The matmul rate MFU divides by: read at each thread count in every round (the best reading
# is the denominator, the spread is printed), so one slow moment of a shared machine does not
# set it.
matmul() {
    for t in $THREADS; do
        flux matmul --threads "$t" --device cpu >> "$results"
    done
}

for round in $(seq "$ROUNDS"); do
    matmul
    for what in step forward; do
        for t in $THREADS; do
            say "round $round/$ROUNDS: $what, $t thread(s)"
            args=("$what" "$CONFIG" --threads "$t" --steps "$STEPS" --warmup 1)
            if (( round % 2 )); then
                flux "${args[@]}" --device cpu >> "$results"; torch "${args[@]}" >> "$results"
            else
                torch "${args[@]}" >> "$results"; flux "${args[@]}" --device cpu >> "$results"
            fi
        done
    done
    top=${THREADS##* }
    say "round $round/$ROUNDS: LoRA rank $LORA_RANK, $top thread(s)"
    lora=(step "$CONFIG" --threads "$top" --steps "$STEPS" --warmup 1)
    flux "${lora[@]}" --device cpu --set "lora.rank=$LORA_RANK" --set 'lora.targets=["*"]' >> "$results"
    torch "${lora[@]}" --lora-rank "$LORA_RANK" >> "$results"
    say "round $round/$ROUNDS: 1 vs 2 data-parallel ranks, TP=2"
    one=(step "$CONFIG" --threads 1 --steps "$STEPS" --warmup 1 --device cpu)
    flux "${one[@]}" >> "$results"
    "${MPIRUN[@]}" -np 2 "$BIN" bench "${one[@]}" \
        --set training.global_batch_size=4 2>/dev/null >> "$results"
    "${MPIRUN[@]}" -np 2 "$BIN" bench "${one[@]}" \
        --set parallelism.tensor_parallel_size=2 2>/dev/null >> "$results"
done
matmul

say "latent shard for the read benchmark"
data="$OUT/data"
if [ ! -d "$data/h5" ]; then
    "$PY" tests/fixtures/make_latent_sources.py "$data" --shards 1 --samples 96 \
        --latent 16,64,64 --text 256,4096 --tars-only
    "$BIN" data ingest --out "$data/h5" --tar "$data/tars/part_00000.tar" >/dev/null 2>&1
fi
shard=$(ls "$data"/h5/*.h5 | head -1)
for round in $(seq "$ROUNDS"); do
    flux read "$shard" >> "$results"
    torch read "$shard" >> "$results"
done

"$PY" benches/report.py "$results"
say "raw results: $results"
ROUNDS=$ROUNDS STEPS=$STEPS OUT=$OUT bash benches/sharding.sh
