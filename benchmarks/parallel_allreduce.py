"""The cost model's gloo all-reduce against measured, 8 KiB .. 64 MiB, two local processes.

Two independent measurements, each in its own pair of processes: first the link probe exactly as the
engine runs it (`servescope hardware probe-link`: parallel/link_probe.py at its sizes, fitted by
analysis/collectives.fit_link), or with --cached the link the engine has cached on this machine; then
a check at every power of two from 8 KiB to 64 MiB (half of them sizes the probe never measured),
sizes interleaved round by round so that a noisy moment of a shared machine hits every size alike.
Each sample is the mean of back-to-back all-reduces (>= 20 ms of them), each size's figure the median
over the rounds.

    PYTHONPATH=src python benchmarks/parallel_allreduce.py [--runs 15] [--cached] [--json out.json]
"""

import argparse
import json

from servescope.analysis.collectives import all_reduce_seconds, fit_link
from servescope.parallel.link_probe import DEFAULT_SIZES, PROBE_SIZES, measure_all_reduce

CHECK_SIZES = tuple(8 * 1024 * 2 ** i for i in range(14))  # 8 KiB ... 64 MiB
FLOOR = 0.25


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15, help="rounds of the check measurement")
    ap.add_argument("--cached", action="store_true", help="predict with the engine's cached local link")
    ap.add_argument("--statistic", default="quartile", choices=["quartile", "median", "min"],
                    help="of each size's rounds, in the check (the probe uses the lower quartile)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.cached:
        from servescope.engine.local_hardware import local_gloo_link  # the engine's own (measures if absent)

        link = local_gloo_link(measure=True)
    else:
        link = fit_link(measure_all_reduce(PROBE_SIZES), ranks=2)
    measured = measure_all_reduce(CHECK_SIZES, runs=a.runs, statistic=a.statistic)
    print(f"link: {link.source or link.name}; alpha-beta {link.bandwidth / 1e9:.2f} GB/s, "
          f"{link.latency_s * 1e6:.0f} us per hop")
    print(f"{'size':>10}  {'probed':<7} {'measured ms':>12} {'predicted ms':>13} {'error':>8}")
    rows = []
    for b, t in sorted(measured.items()):
        p = all_reduce_seconds(b, 2, link)
        probed = b in {s for s, _ in link.all_reduce_table} or (not link.all_reduce_table and b in DEFAULT_SIZES)
        rows.append({"bytes": b, "probed_size": probed, "measured_s": t, "predicted_s": p, "error": (p - t) / t})
        print(f"{b / 1024:>6.0f} KiB  {'yes' if probed else 'no':<7} {t * 1e3:12.3f} {p * 1e3:13.3f} "
              f"{(p - t) / t:+8.1%}")
    within = sum(abs(r["error"]) <= FLOOR for r in rows)
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"within {FLOOR:.0%}: {within} of {len(rows)} sizes; worst {worst['error']:+.1%} at "
          f"{worst['bytes'] / 1024:.0f} KiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "bandwidth": link.bandwidth, "latency_s": link.latency_s,
                       "source": link.source, "within_floor": within}, f, indent=1)


if __name__ == "__main__":
    main()
