#!/usr/bin/env python3
"""The table of benches/sharding.sh: for each implementation and precision, plain data
parallelism against each sharding level on 2 ranks (medians over rounds), and flux-hpc against
PyTorch at each level.

    .venv/bin/python benches/sharding_report.py RESULTS.jsonl
"""
import json
import statistics
import sys

LEVELS = ("none", "optimizer", "gradients", "full")
# PyTorch's counterpart of each sharding level in benches/pytorch_reference.py.
TORCH = {"optimizer": "ZeroRedundancyOptimizer", "gradients": "FSDP2 (no reshard)",
         "full": "FSDP2 (reshard)"}


def main():
    runs = {}
    for line in open(sys.argv[1]):
        r = json.loads(line)
        runs.setdefault((r["impl"], r["precision"], r["sharding"]), []).append(r)

    def med(key, field):
        return statistics.median(r[field] for r in runs[key])

    fields = ("optimizer_state_mib_per_rank", "model_state_mib_per_rank", "peak_rss_mib",
              "median_s")
    print(f"{'2 ranks, 1 thread each':<28}{'sharding':>10}{'state MiB':>11}{'model MiB':>11}"
          f"{'peak RSS MiB':>14}{'step s':>9}{'state':>8}{'model':>7}{'RSS':>7}{'time':>7}")
    for impl, precision in sorted({(i, p) for i, p, _ in runs}):
        plain = (impl, precision, "none")
        for sharding in LEVELS:
            key = (impl, precision, sharding)
            if key not in runs:
                continue
            values = [med(key, f) for f in fields]
            ratios = ""
            if sharding != "none" and plain in runs:
                ratios = "".join(f"{v / med(plain, f):>{w}.2f}"
                                 for v, f, w in zip(values, fields, (8, 7, 7, 7)))
            state, model, rss, step = values
            print(f"{impl + ' ' + precision:<28}{sharding:>10}{state:>11.1f}{model:>11.1f}"
                  f"{rss:>14.0f}{step:>9.3f}{ratios}")
    for sharding in LEVELS[1:]:
        flux, torch = ("flux-hpc", "fp32", sharding), ("pytorch", "fp32", sharding)
        if flux in runs and torch in runs:
            print(f"flux-hpc / PyTorch {TORCH[sharding]}, f32: peak RSS "
                  f"{med(flux, 'peak_rss_mib') / med(torch, 'peak_rss_mib'):.2f}×, step time "
                  f"{med(flux, 'median_s') / med(torch, 'median_s'):.2f}×")

if __name__ == "__main__":
    main()
