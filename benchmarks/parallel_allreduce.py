"""The cost model's gloo all-reduce against measured, 8 KiB .. 64 MiB, two local processes.

The link probe's sizes (8 KiB x 4^i) calibrate the local link (analysis/collectives.fit_link); the
sizes between them (16 KiB x 4^i) and 64 MiB check it. Both are measured in the same processes,
interleaved round by round, so that a noisy minute of a shared machine hits every size alike.

    PYTHONPATH=src python benchmarks/parallel_allreduce.py [--runs 15] [--json out.json]
"""

import argparse
import json

from servescope.analysis.collectives import all_reduce_seconds, fit_link
from servescope.parallel.link_probe import DEFAULT_SIZES, measure_all_reduce


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    checks = tuple(2 * s for s in DEFAULT_SIZES[:-1]) + (64 * 2 ** 20,)
    measured = measure_all_reduce(tuple(sorted(DEFAULT_SIZES + checks)), runs=a.runs)
    link = fit_link({b: measured[b] for b in DEFAULT_SIZES}, ranks=2)
    rows = []
    print(f"fitted: {link.bandwidth / 1e9:.2f} GB/s, {link.latency_s * 1e6:.0f} us per hop")
    for b, t in sorted(measured.items()):
        p = all_reduce_seconds(b, 2, link)
        role = "calibrates" if b in DEFAULT_SIZES else "checks"
        rows.append({"bytes": b, "role": role, "measured_s": t, "predicted_s": p, "error": (p - t) / t})
        print(f"{b / 1024:>8.0f} KiB  {role:<10} measured {t * 1e3:8.3f} ms  predicted {p * 1e3:8.3f} ms  "
              f"{(p - t) / t:+.1%}")
    worst = max(abs(r["error"]) for r in rows if r["role"] == "checks")
    print(f"worst error at the checked sizes: {worst:.1%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "bandwidth": link.bandwidth, "latency_s": link.latency_s}, f, indent=1)


if __name__ == "__main__":
    main()
