#!/usr/bin/env bash
# Two builds of flux-hpc on the same work, alternated round by round (the older first in odd
# rounds, the newer first in even ones) so that drift in the machine's speed hits both: what a
# refactoring that must change nothing is held to. Prints per workload the median seconds of
# each build, their ratio and each build's peak tensor and resident memory.
#
#   cp target/debug/flux-hpc /tmp/flux-hpc-before     # on the older commit
#   bash benches/compare_builds.sh /tmp/flux-hpc-before target/debug/flux-hpc
#   ROUNDS=5 STEPS=5 THREADS="1 2" PRECISIONS="fp32 bf16" bash benches/compare_builds.sh OLD NEW
#
# Work (benches/side_by_side.toml): a training step and a forward pass at each of THREADS
# (default 2) as side_by_side.sh runs them, a fully sharded step on 2 MPI ranks in each of
# PRECISIONS (default fp32: a bf16 step takes over a minute on CPUs without bf16 units) as
# sharding.sh runs it, and a fully sharded FLUX.2 step with TP2 × DP2, sequence parallelism and recompute.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OLD=${1:?usage: compare_builds.sh OLD_BINARY NEW_BINARY}
NEW=${2:?usage: compare_builds.sh OLD_BINARY NEW_BINARY}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-3}
THREADS=${THREADS:-2}
PRECISIONS=${PRECISIONS:-fp32}
CONFIG=benches/side_by_side.toml
OUT=${OUT:-$(mktemp -d /tmp/flux-compare.XXXX)}
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none
        --mca btl_vader_single_copy_mechanism none)
mkdir -p "$OUT"
results="$OUT/compare.jsonl"
: > "$results"
say() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

# One workload (the command after the build and the workload's name): its JSON line, tagged
# with both.
run() {
    local build=$1 name=$2
    shift 2
    "$@" 2>/dev/null | tail -1 | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
r["build"], r["workload"] = sys.argv[1], sys.argv[2]
print(json.dumps(r))' "$build" "$name" >> "$results"
}

workloads() {
    local build=$1 bin=$OLD
    [ "$build" = new ] && bin=$NEW
    local args=("$CONFIG" --steps "$STEPS" --warmup 1 --device cpu)
    for t in $THREADS; do
        run "$build" "step, ${t} thread(s)" "$bin" bench step "${args[@]}" --threads "$t"
        run "$build" "forward, ${t} thread(s)" "$bin" bench forward "${args[@]}" --threads "$t"
    done
    for precision in $PRECISIONS; do
        run "$build" "full sharding, 2 ranks, $precision" "${MPIRUN[@]}" -np 2 "$bin" bench step \
            "${args[@]}" --threads 1 --set training.micro_batch_size=1 \
            --set 'parallelism.sharding="full"' --set "training.precision=\"$precision\"" \
            --set parallelism.bucket_mib=25
    done
    run "$build" "FLUX.2 TP2×DP2 full + SP + recompute" "${MPIRUN[@]}" -np 4 "$bin" bench step \
        configs/flux2_tiny.toml --steps "$STEPS" --warmup 1 --device cpu --threads 1 \
        --set parallelism.tensor_parallel_size=2 --set parallelism.sequence_parallel=true \
        --set 'parallelism.sharding="full"' --set training.recompute=true
}

for round in $(seq "$ROUNDS"); do
    say "round $round/$ROUNDS"
    if (( round % 2 )); then
        workloads old; workloads new
    else
        workloads new; workloads old
    fi
done

python3 - "$results" <<'EOF'
import json, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
order = []
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["workload"] not in order:
        order.append(r["workload"])
    runs[(r["workload"], r["build"])].append(r)
def med(w, b, f):
    values = [r[f] for r in runs[(w, b)] if r.get(f) is not None]
    return statistics.median(values) if values else float("nan")
print(f"{'workload':<40}{'old s':>9}{'new s':>9}{'new/old':>9}{'tensor MiB old/new':>22}{'RSS MiB old/new':>18}")
for w in order:
    o, n = med(w, "old", "median_s"), med(w, "new", "median_s")
    to, tn = med(w, "old", "peak_tensor_mib"), med(w, "new", "peak_tensor_mib")
    ro, rn = med(w, "old", "peak_rss_mib"), med(w, "new", "peak_rss_mib")
    print(f"{w:<40}{o:>9.3f}{n:>9.3f}{n / o:>9.3f}{to:>11.1f}{tn:>11.1f}{ro:>9.0f}{rn:>9.0f}")
print(f"raw: {sys.argv[1]}")
EOF
