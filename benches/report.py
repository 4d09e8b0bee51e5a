#!/usr/bin/env python3
"""Summarise benches/side_by_side.sh's JSON lines as one table.

    .venv/bin/python benches/report.py RESULTS.jsonl

Per workload and thread count: the median over rounds of each run's median time, flux-hpc's
time as a fraction of PyTorch's (target ≤ 0.8 for a training step), model FLOPs utilisation
against libtorch's matmul rate at the same thread count (target ≥ 60% for the forward pass),
data-parallel speed-up of 2 ranks (target ≥ 1.8×), tensor-parallel overhead at TP=2 (target
≤ 15%), peak resident memory, LoRA's step time and memory against full training and against
diffusers + PEFT, and the HDF5 read rate against h5py (target ≥ 1×).
"""
import json
import statistics
import sys
from collections import defaultdict


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    runs = defaultdict(list)
    for r in rows:
        what = r["what"] + ("-lora" if r.get("lora_rank") else "")
        key = (r["impl"], what, r.get("threads"), r.get("ranks", 1), r.get("tp", 1))
        runs[key].append(r)

    def med(impl, what, threads=None, ranks=1, tp=1, field="median_s"):
        found = runs.get((impl, what, threads, ranks, tp), [])
        return statistics.median(r[field] for r in found) if found else float("nan")

    def one(impl, what, threads=None, ranks=1, tp=1):
        found = runs.get((impl, what, threads, ranks, tp), [])
        return found[0] if found else {}

    # The MFU denominator: the best of the matmul readings taken through the run (one reading on a
    # shared VM can be far below what the machine does); their spread is printed.
    readings = defaultdict(list)
    for r in rows:
        if r["what"] == "matmul":
            readings[r["threads"]].append(r["flops_per_s"])
    peak = {t: max(v) for t, v in readings.items()}
    threads = sorted({r["threads"] for r in rows if r["what"] == "step" and r["impl"] == "pytorch"})
    lines = [
        f"{'workload':<34}{'threads':>8}{'flux-hpc':>12}{'PyTorch':>12}{'ratio':>8}  target",
    ]
    for what, label, target in [("step", "training step, median s", "≤ 0.80"),
                                ("forward", "forward pass, median s", "")]:
        for t in threads:
            f, p = med("flux-hpc", what, t), med("pytorch", what, t)
            lines.append(f"{label:<34}{t:>8}{f:>12.3f}{p:>12.3f}{f / p:>8.2f}  {target}")
    for what, label, target in [("forward", "forward MFU (of matmul peak)", "≥ 60%"),
                                ("step", "training step MFU", "")]:
        for t in threads:
            flops = one("flux-hpc", what, t).get("flops", float("nan"))
            f = flops / med("flux-hpc", what, t) / peak.get(t, float("nan"))
            p = flops / med("pytorch", what, t) / peak.get(t, float("nan"))
            lines.append(f"{label:<34}{t:>8}{f:>12.0%}{p:>12.0%}{'':>8}  {target}")
    for t in sorted(peak):
        low = min(readings[t])
        spread = f"best of {len(readings[t])}, lowest {low / 1e9:.1f} ({low / peak[t] - 1:+.0%})"
        lines.append(f"{'libtorch f32 matmul, GFLOP/s':<34}{t:>8}{peak[t] / 1e9:>12.1f}{'':>20}  {spread}")
    single = med("flux-hpc", "step", 1)
    single_rate = med("flux-hpc", "step", 1, field="samples_per_s")
    dp_rate = med("flux-hpc", "step", 1, ranks=2, field="samples_per_s")
    tp = med("flux-hpc", "step", 1, ranks=2, tp=2)
    lines.append(f"{'data parallel, 2 ranks: speed-up':<34}{1:>8}{dp_rate / single_rate:>11.2f}×{'':>20}  ≥ 1.80×")
    lines.append(f"{'tensor parallel TP=2: overhead':<34}{1:>8}{tp / (single / 2) - 1:>12.0%}{'':>20}  ≤ 15%")
    top = max(threads) if threads else None
    f_rss = med("flux-hpc", "step", top, field="peak_rss_mib")
    p_rss = med("pytorch", "step", top, field="peak_rss_mib")
    lines.append(f"{'peak RSS of a training run, MiB':<34}{top:>8}{f_rss:>12.0f}{p_rss:>12.0f}{f_rss / p_rss:>8.2f}")
    f_lora, p_lora = med("flux-hpc", "step-lora", top), med("pytorch", "step-lora", top)
    rank = one("flux-hpc", "step-lora", top).get("lora_rank")
    lines.append(f"{f'LoRA r{rank} step, median s':<34}{top:>8}{f_lora:>12.3f}{p_lora:>12.3f}{f_lora / p_lora:>8.2f}")
    f_full, p_full = med("flux-hpc", "step", top), med("pytorch", "step", top)
    lines.append(f"{'LoRA step / full step':<34}{top:>8}{f_lora / f_full:>12.2f}{p_lora / p_full:>12.2f}")
    f_lrss = med("flux-hpc", "step-lora", top, field="peak_rss_mib")
    p_lrss = med("pytorch", "step-lora", top, field="peak_rss_mib")
    lines.append(f"{'peak RSS of a LoRA run, MiB':<34}{top:>8}{f_lrss:>12.0f}{p_lrss:>12.0f}{f_lrss / p_lrss:>8.2f}")
    lines.append(f"{'LoRA / full peak RSS':<34}{top:>8}{f_lrss / f_rss:>12.2f}{p_lrss / p_rss:>12.2f}")
    f_tp = one("flux-hpc", "step-lora", top).get("trained_params_per_rank", 0)
    p_tp = one("pytorch", "step-lora", top).get("trained_params_per_rank", 0)
    lines.append(f"{'LoRA trained parameters':<34}{top:>8}{f_tp:>12,}{p_tp:>12,}")
    f_read = med("flux-hpc", "read", field="mib_per_s")
    h_read = med("h5py", "read", field="mib_per_s")
    lines.append(f"{'HDF5 latent read, MiB/s (h5py)':<34}{1:>8}{f_read:>12.0f}{h_read:>12.0f}{f_read / h_read:>8.2f}  ≥ 1.00")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
