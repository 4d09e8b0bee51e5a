#!/usr/bin/env bash
# `flux-hpc data encode` against the same encoding with diffusers + transformers, in one run:
# N images of SIZE² through FLUX.1-shaped random encoders (benches/encode_reference.py setup), the
# two alternated round by round, wall time including model loading (flux-hpc also writes the HDF5
# shards). Prints images/s of each and the ratio. On a GPU (DEVICE=cuda) both run T5 in bf16,
# CLIP and the VAE in f32, as `data encode` does there.
#
#   bash benches/encode.sh              # ROUNDS=2 IMAGES=16 SIZE=512 BATCH=4 TEXT_LEN=512 DEVICE=cpu
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROUNDS=${ROUNDS:-2}
IMAGES=${IMAGES:-16}
SIZE=${SIZE:-512}
BATCH=${BATCH:-4}
TEXT_LEN=${TEXT_LEN:-512}
DEVICE=${DEVICE:-cpu}
OUT=${OUT:-$(mktemp -d /tmp/flux-encode.XXXX)}
PY=.venv/bin/python
BIN=target/debug/flux-hpc

bash scripts/setup.sh >/dev/null
cargo build --quiet --bin flux-hpc
say() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

if [ ! -d "$OUT/flux/vae" ]; then
    say "random FLUX.1-shaped encoders and $IMAGES images of ${SIZE}²"
    "$PY" benches/encode_reference.py setup "$OUT" --images "$IMAGES" --size "$SIZE" >/dev/null
fi
results="$OUT/encode.jsonl"
: > "$results"
flux() {
    rm -rf "$OUT/shards"
    local start end
    start=$(date +%s.%N)
    "$BIN" data encode --images "$OUT/images" --encoders "$OUT/flux" --out "$OUT/shards" \
        --buckets "${SIZE}x${SIZE}" --text-len "$TEXT_LEN" --batch "$BATCH" --device "$DEVICE" \
        >/dev/null 2>&1
    end=$(date +%s.%N)
    echo "{\"impl\": \"flux-hpc\", \"images\": $IMAGES, \"seconds\": $(echo "$end - $start" | bc)}"
}
torch() {
    "$PY" benches/encode_reference.py run "$OUT/images" "$OUT/flux" --batch "$BATCH" \
        --size "$SIZE" --text-len "$TEXT_LEN" --device "$DEVICE" 2>/dev/null
}
for round in $(seq "$ROUNDS"); do
    say "round $round/$ROUNDS"
    if (( round % 2 )); then flux >> "$results"; torch >> "$results"
    else torch >> "$results"; flux >> "$results"; fi
done
"$PY" - "$results" <<'PYEOF'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs.setdefault(r["impl"], []).append(r["images"] / r["seconds"])
f, p = statistics.median(runs["flux-hpc"]), statistics.median(runs["pytorch"])
print(f"images/s (median of rounds): flux-hpc {f:.2f}, diffusers + transformers {p:.2f}, "
      f"ratio {f / p:.2f}")
PYEOF
say "raw results: $results"
