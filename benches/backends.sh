#!/usr/bin/env bash
# Collective backends side by side: the same data-parallel training step over MPI and over
# libtorch's c10d gloo groups (`[parallelism] backend`), on 2 ranks of one thread each
# (benches/side_by_side.toml, one sample per rank), in f32 and in bf16 with f32 masters, plain
# and with gradients reduced during backward (`overlap_grad_reduce`, 25 MiB buckets). The
# backends are alternated round by round. Prints the median step time of each, the gloo/MPI
# ratio, and what each staged through host f32 buffers per step.
#
#   bash benches/backends.sh              # ROUNDS=3 STEPS=3
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-3}
OUT=${OUT:-$(mktemp -d /tmp/flux-backends.XXXX)}
CONFIG=benches/side_by_side.toml
BIN=target/debug/flux-hpc
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none
        --mca btl_vader_single_copy_mechanism none -np 2)
mkdir -p "$OUT"
results="$OUT/backends.jsonl"
: > "$results"

bash scripts/setup.sh >/dev/null
cargo build --quiet --bin flux-hpc
say() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

# backend precision overlap
flux() {
    "${MPIRUN[@]}" "$BIN" bench step "$CONFIG" --threads 1 --steps "$STEPS" --warmup 1 \
        --device cpu --set training.micro_batch_size=1 --set parallelism.bucket_mib=25 \
        --set "parallelism.backend=\"$1\"" --set "training.precision=\"$2\"" \
        --set "parallelism.overlap_grad_reduce=$3" 2>/dev/null |
        .venv/bin/python -c "import json,sys; r=json.loads(sys.stdin.read()); r['precision']='$2'; print(json.dumps(r))"
}

for round in $(seq "$ROUNDS"); do
    say "round $round/$ROUNDS"
    for precision in fp32 bf16; do
        for overlap in false true; do
            for backend in mpi gloo; do
                flux "$backend" "$precision" "$overlap" >> "$results"
            done
        done
    done
done

.venv/bin/python - "$results" <<'PY'
import json, statistics, sys
runs, staged = {}, {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = (r["precision"], r["overlap_grad_reduce"], r["backend"])
    runs.setdefault(key, []).append(r["median_s"])
    staged[key] = r["host_staged_mib_per_step"]
med = {k: statistics.median(v) for k, v in runs.items()}
print(f"{'2 ranks, 1 thread each':<28}{'mpi s':>8}{'gloo s':>8}{'gloo/mpi':>10}"
      f"{'staged MiB/step mpi':>21}{'gloo':>6}")
for precision in ("fp32", "bf16"):
    for overlap in (False, True):
        m, g = med[(precision, overlap, "mpi")], med[(precision, overlap, "gloo")]
        name = f"{precision}, {'overlapped' if overlap else 'after backward'}"
        print(f"{name:<28}{m:>8.3f}{g:>8.3f}{g / m:>10.2f}"
              f"{staged[(precision, overlap, 'mpi')]:>21.2f}{staged[(precision, overlap, 'gloo')]:>6.2f}")
PY
say "raw results: $results"
