#!/usr/bin/env bash
# Gradient all-reduce overlapped with backward, side by side: flux-hpc's plain data parallelism
# with `[parallelism] overlap_grad_reduce` off and on (25 MiB buckets, as DDP's), and PyTorch's
# DistributedDataParallel (gloo, which always overlaps), on 2 ranks of one thread each with the
# same model and global batch (benches/side_by_side.toml, one sample per rank, f32). The three
# are alternated round by round. Prints the median step time of each and the ratios.
#
#   bash benches/overlap.sh              # ROUNDS=3 STEPS=3
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-3}
OUT=${OUT:-$(mktemp -d /tmp/flux-overlap.XXXX)}
CONFIG=benches/side_by_side.toml
BIN=target/debug/flux-hpc
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none
        --mca btl_vader_single_copy_mechanism none -np 2)
mkdir -p "$OUT"
results="$OUT/overlap.jsonl"
: > "$results"

bash scripts/setup.sh >/dev/null
cargo build --quiet --bin flux-hpc
say() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

step=(step "$CONFIG" --threads 1 --steps "$STEPS" --warmup 1)
flux() {
    "${MPIRUN[@]}" "$BIN" bench "${step[@]}" --device cpu --set training.micro_batch_size=1 \
        --set parallelism.bucket_mib=25 --set "parallelism.overlap_grad_reduce=$1" 2>/dev/null
}
torch() {
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 benches/pytorch_reference.py \
        "${step[@]}" 2>/dev/null
}

for round in $(seq "$ROUNDS"); do
    say "round $round/$ROUNDS"
    flux false >> "$results"
    flux true >> "$results"
    torch >> "$results"
done

.venv/bin/python - "$results" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs.setdefault((r["impl"], r["overlap_grad_reduce"]), []).append(r["median_s"])
med = {k: statistics.median(v) for k, v in runs.items()}
base = med[("flux-hpc", False)]
torch = med[("pytorch", True)]
print(f"{'2 ranks, 1 thread each, f32':<36}{'step s':>9}{'vs no overlap':>15}{'vs DDP':>8}")
for key, name in ((("flux-hpc", False), "flux-hpc, reduce after backward"),
                  (("flux-hpc", True), "flux-hpc, overlap_grad_reduce"),
                  (("pytorch", True), "PyTorch DDP (gloo, overlapped)")):
    print(f"{name:<36}{med[key]:>9.3f}{med[key] / base:>15.2f}{med[key] / torch:>8.2f}")
PY
say "raw results: $results"
