"""The cost model's gloo all-reduce against measured, 8 KiB .. 64 MiB, two local processes.

Each round has two independent measurements, each in its own new pair of processes: first the link
probe exactly as the engine runs it (parallel/link_probe.py at its sizes, fitted by
analysis/collectives.fit_link: gloo's segmented ring through the socket buffer, four rates), or with
--cached the link the engine has cached on this machine; then a check at every power of two from 8 KiB
to 64 MiB (half of them sizes the probe never measured), sizes interleaved within the run so that a
noisy moment of a shared machine hits every size alike. Each sample is the mean of back-to-back
all-reduces (>= 20 ms of them), each size's figure in a run the lower quartile of its samples
(--statistic); over the rounds, each size's measured and predicted figures are the medians, and every
round's own error is kept. Beside it, the model alone: fitted to the check run's own figures at the
probe's sizes (the probe's sizes are among the check's), predicting every size of that run, free of
the drift between two runs.

    PYTHONPATH=src python benchmarks/parallel_allreduce.py [--runs 15] [--rounds 3] [--cached] [--json out.json]
"""

import argparse
import json
import statistics
import time

from servescope.analysis.collectives import all_reduce_seconds
from servescope.parallel.link_probe import PROBE_SIZES, fit_local_link, measure_all_reduce

CHECK_SIZES = tuple(8 * 1024 * 2 ** i for i in range(14))  # 8 KiB ... 64 MiB
FLOOR = 0.25


def one_round(a) -> tuple:
    """(the link, {bytes: measured seconds}, probe seconds) of one probe-then-check round."""
    t0 = time.perf_counter()
    if a.cached:
        from servescope.measure.local_hardware import local_gloo_link  # the engine's own (measures if absent)

        link = local_gloo_link(measure=True)
    else:
        link = fit_local_link(measure_all_reduce(PROBE_SIZES))
    probe_s = time.perf_counter() - t0
    return link, measure_all_reduce(CHECK_SIZES, runs=a.runs, statistic=a.statistic), probe_s


def within_floor(errors: dict) -> int:
    return sum(abs(e) <= FLOOR for e in errors.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15, help="samples per size in each check run")
    ap.add_argument("--rounds", type=int, default=3, help="probe-then-check rounds (new processes each)")
    ap.add_argument("--cached", action="store_true", help="predict with the engine's cached local link")
    ap.add_argument("--statistic", default="quartile", choices=["quartile", "median", "min"],
                    help="of each size's samples in the check (the probe uses the lower quartile)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rounds, same_run = [], []
    for r in range(a.rounds):
        link, measured, probe_s = one_round(a)
        errs = {b: all_reduce_seconds(b, 2, link) / t - 1 for b, t in measured.items()}
        # the model alone, without the drift of a shared machine between two runs: fitted to the check
        # run's own figures at the probe's sizes, predicting all its sizes
        own = fit_local_link({b: measured[b] for b in PROBE_SIZES})
        same = {b: all_reduce_seconds(b, 2, own) / t - 1 for b, t in measured.items()}
        print(f"round {r + 1}: {link.describe()} (probe {probe_s:.1f} s); within {FLOOR:.0%}: "
              f"{within_floor(errs)} of {len(errs)}; fitted in the check's own run: {within_floor(same)} of "
              f"{len(same)} ({own.describe()})")
        rounds.append((link, measured, errs))
        same_run.append(same)
    print(f"{'size':>10}  {'probed':<7} {'measured ms':>12} {'predicted ms':>13} {'error':>8}   per round   "
          f"| same run, per round")
    rows = []
    for b in CHECK_SIZES:
        t = statistics.median(m[b] for _, m, _ in rounds)
        p = statistics.median(all_reduce_seconds(b, 2, link) for link, _, _ in rounds)
        per, same = [e[b] for _, _, e in rounds], [e[b] for e in same_run]
        rows.append({"bytes": b, "probed_size": b in PROBE_SIZES, "measured_s": t, "predicted_s": p,
                     "error": p / t - 1, "round_errors": per, "same_run_errors": same})
        print(f"{b / 1024:>6.0f} KiB  {'yes' if b in PROBE_SIZES else 'no':<7} {t * 1e3:12.3f} {p * 1e3:13.3f} "
              f"{p / t - 1:+8.1%}   {' '.join(f'{e:+.0%}' for e in per)}   | {' '.join(f'{e:+.0%}' for e in same)}")
    within = within_floor({r["bytes"]: r["error"] for r in rows})
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"medians over {a.rounds} rounds: within {FLOOR:.0%}: {within} of {len(rows)} sizes; worst "
          f"{worst['error']:+.1%} at {worst['bytes'] / 1024:.0f} KiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "within_floor": within, "statistic": a.statistic, "runs": a.runs,
                       "links": [vars(link) for link, _, _ in rounds],
                       "measured_s": [{b: m[b] for b in CHECK_SIZES} for _, m, _ in rounds],
                       "rounds_within_floor": [within_floor(errs) for _, _, errs in rounds],
                       "same_run_errors": same_run, "same_run_within_floor": [within_floor(e) for e in same_run]},
                      f, indent=1)


if __name__ == "__main__":
    main()
