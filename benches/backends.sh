#!/usr/bin/env bash
# Collective backends side by side: the same training step over MPI and over libtorch's c10d
# gloo groups (`[parallelism] backend`), on 2 ranks of one thread each
# (benches/side_by_side.toml, global batch 2): data parallel in f32 with gradients reduced after
# backward and during it (`overlap_grad_reduce`, 25 MiB buckets), data parallel in bf16 with f32
# masters, and tensor parallel (TP2) in bf16, whose per-layer activation sums MPI converts to f32
# where gloo moves them as bf16. The backends are alternated round by round. Prints the median
# step time of each, the gloo/MPI ratio, and what each staged through host f32 buffers per step.
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

# The cases: a name, then its overrides.
cases=("DP2 fp32, after backward|training.precision=\"fp32\""
       "DP2 fp32, overlapped|training.precision=\"fp32\" parallelism.overlap_grad_reduce=true"
       "DP2 bf16, after backward|training.precision=\"bf16\""
       "TP2 bf16|training.precision=\"bf16\" parallelism.tensor_parallel_size=2")
# backend case
flux() {
    local name=${2%%|*} sets=() o
    for o in ${2#*|}; do sets+=(--set "$o"); done
    "${MPIRUN[@]}" "$BIN" bench step "$CONFIG" --threads 1 --steps "$STEPS" --warmup 1 \
        --device cpu --set training.global_batch_size=2 --set training.micro_batch_size=1 \
        --set parallelism.bucket_mib=25 --set "parallelism.backend=\"$1\"" "${sets[@]}" \
        2>/dev/null |
        .venv/bin/python -c "import json,sys; r=json.loads(sys.stdin.read()); r['case']='$name'; print(json.dumps(r))"
}

for round in $(seq "$ROUNDS"); do
    say "round $round/$ROUNDS"
    for case in "${cases[@]}"; do
        for backend in mpi gloo; do
            flux "$backend" "$case" >> "$results"
        done
    done
done

.venv/bin/python - "$results" <<'PY'
import json, statistics, sys
runs, staged, cases = {}, {}, []
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = (r["case"], r["backend"])
    cases += [r["case"]] if r["case"] not in cases else []
    runs.setdefault(key, []).append(r["median_s"])
    staged[key] = r["host_staged_mib_per_step"]
med = {k: statistics.median(v) for k, v in runs.items()}
print(f"{'2 ranks, 1 thread each':<26}{'mpi s':>8}{'gloo s':>8}{'gloo/mpi':>10}"
      f"{'staged MiB/step mpi':>21}{'gloo':>7}")
for case in cases:
    m, g = med[(case, "mpi")], med[(case, "gloo")]
    print(f"{case:<26}{m:>8.3f}{g:>8.3f}{g / m:>10.2f}"
          f"{staged[(case, 'mpi')]:>21.2f}{staged[(case, 'gloo')]:>7.2f}")
PY
say "raw results: $results"
