#!/usr/bin/env bash
# Sequence parallelism side by side: flux-hpc at TP2 on 2 ranks of one thread each, with
# `[parallelism] sequence_parallel = true` against without, the same model and batch
# (benches/side_by_side.toml: 1,024 image + 128 text tokens, both samples in one micro-batch),
# f32. The two are alternated round by round. Prints rank 0's peak RSS and the median step time
# of each, and their ratios.
#
#   bash benches/sequence_parallel.sh     # ROUNDS=3 STEPS=3
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-3}
OUT=${OUT:-$(mktemp -d /tmp/flux-sequence.XXXX)}
CONFIG=benches/side_by_side.toml
BIN=target/debug/flux-hpc
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none
        --mca btl_vader_single_copy_mechanism none -np 2)
results="$OUT/sequence.jsonl"
: > "$results"

bash scripts/setup.sh >/dev/null
cargo build --quiet --bin flux-hpc
say() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

flux() {
    "${MPIRUN[@]}" "$BIN" bench step "$CONFIG" --threads 1 --steps "$STEPS" --warmup 1 \
        --device cpu --set parallelism.tensor_parallel_size=2 \
        --set "parallelism.sequence_parallel=$1" 2>/dev/null | tail -1
}

for round in $(seq "$ROUNDS"); do
    say "round $round/$ROUNDS"
    flux false >> "$results"
    flux true >> "$results"
done

.venv/bin/python - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def summary(sp):
    runs = [r for r in rows if r["sequence_parallel"] == sp]
    step = statistics.median(s for r in runs for s in r["seconds"])
    rss = max(r["peak_rss_mib"] for r in runs)
    return step, rss
(t0, m0), (t1, m1) = summary(False), summary(True)
print(f"{'TP2, 2 ranks':<24}{'step s (median)':>16}{'peak RSS MiB':>14}")
print(f"{'tensor parallel':<24}{t0:>16.3f}{m0:>14.0f}")
print(f"{'+ sequence parallel':<24}{t1:>16.3f}{m1:>14.0f}")
print(f"{'ratio':<24}{t1 / t0:>16.2f}{m1 / m0:>14.2f}")
PY
say "raw results: $results"
