#!/usr/bin/env bash
# Float8 against bf16 (and f32) training on the CPU: benches/side_by_side.toml's reduced-width Flux
# (hidden 512, 2 joint + 4 single layers, 1024 image + 128 text tokens, batch 2) timed with
# `flux-hpc bench step` in f32, bf16 and fp8 under each torchao recipe, the precisions alternated
# over ROUNDS rounds (the best median of each kept), with the peak tensor memory of a step.
#
#   bash benches/fp8.sh                 # ROUNDS=2 STEPS=4
#
# On a CPU the float8 GEMMs are libtorch's `_scaled_mm` fallback (operands widened, then an f32
# GEMM) and bf16 GEMMs run without AMX, so what this measures is the cost of the casts and the
# kernels this machine has, not the speed-up FP8 tensor cores give; benches/gpu.sh measures that.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-4}
BIN=target/debug/flux-hpc
cargo build --quiet --bin flux-hpc

runs=("fp32 tensorwise" "bf16 tensorwise" "fp8 tensorwise" "fp8 rowwise" "fp8 rowwise_gw_hp")
out=$(mktemp -d /tmp/flux-fp8-bench.XXXX)
for round in $(seq "$ROUNDS"); do
    for run in "${runs[@]}"; do
        read -r precision recipe <<<"$run"
        set=(--set training.precision=\""$precision"\")
        [ "$precision" = fp8 ] && set+=(--set fp8.recipe=\""$recipe"\")
        "$BIN" bench step benches/side_by_side.toml --steps "$STEPS" --warmup 1 "${set[@]}" \
            2>/dev/null >"$out/$precision-$recipe-$round.json"
    done
done
python3 - "$out" "$ROUNDS" <<'PY'
import glob, json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for path in sorted(glob.glob(f"{out}/*.json")):
    precision, recipe, _ = path.rsplit("/", 1)[1][:-5].rsplit("-", 2)
    r = json.load(open(path))
    key = precision if precision != "fp8" else f"fp8 {recipe}"
    best = rows.get(key)
    if best is None or r["median_s"] < best["median_s"]:
        rows[key] = r
base = rows["bf16"]
print(f"side_by_side.toml (hidden 512, 1024 + 128 tokens, batch 2), {base['device']}, "
      f"best median of {rounds} rounds")
print(f"{'':<22}{'step s':>9}{'samples/s':>11}{'vs bf16':>9}{'peak tensors MiB':>18}")
for key in ["fp32", "bf16", "fp8 tensorwise", "fp8 rowwise", "fp8 rowwise_gw_hp"]:
    r = rows[key]
    print(f"{key:<22}{r['median_s']:>9.3f}{r['samples_per_s']:>11.2f}"
          f"{base['median_s'] / r['median_s']:>8.2f}×{r['peak_tensor_mib']:>18.0f}")
PY
rm -rf "$out"
