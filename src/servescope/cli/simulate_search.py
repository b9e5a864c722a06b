"""`servescope simulate --search`: every layout tried, the cheapest that meets the SLOs, what binds."""

from __future__ import annotations

from rich.table import Table

from servescope.bench.metrics import parse_goodput
from servescope.errors import InvalidParameterError
from servescope.sim.search import Search, binding


def run_search(args, requests, con, hw, spec_for) -> int:
    """spec_for(tp): the instance at that TP (simulate_run.spec_from_args)."""
    if not requests[-1].arrival > 0:
        raise InvalidParameterError("request_rate", "--search needs a finite --request-rate (or a trace)")
    slos = parse_goodput(args.goodput)
    search = Search(spec_for, requests, slos, args.slo_attainment,
                    args.max_devices, args.router, args.kv_link, args.max_concurrency)
    con.print(f"search: {len(requests)} requests at {args.request_rate} req/s, SLOs {slos} for "
              f"{args.slo_attainment:.0%} of requests, up to {args.max_devices} x {hw.name}")
    best = search.run()
    table = Table(title="Layouts tried", box=None)
    for col in ("layout", "devices", "SLO attainment", "goodput (req/s)", "p90 TTFT (ms)", "p90 TPOT (ms)"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for t in sorted(search.trials.values(), key=lambda t: (t.devices, t.layout.describe())):
        r = t.run.result
        table.add_row(t.layout.describe(), str(t.devices), f"{t.attainment:.0%}", f"{r.request_goodput or 0:.2f}",
                      f"{r.ttft.percentiles_ms.get(90.0, float('nan')):.0f}",
                      f"{r.tpot.percentiles_ms.get(90.0, float('nan')):.1f}")
    con.print(table)
    if best is None:
        con.print(f"[red]no layout of up to {args.max_devices} devices meets the SLOs[/red]")
        worst = max(search.trials.values(), key=lambda t: t.devices, default=None)
        if worst is not None:
            con.print(f"at {worst.layout.describe()}: {binding(worst, slos)}")
        return 1
    con.print(f"cheapest: {best.layout.describe()} = {best.devices} x {hw.name} "
              f"({best.attainment:.0%} of requests within the SLOs)")
    short = search.neighbour(best)
    if short is not None:
        con.print(f"one instance fewer ({short.layout.describe()}, {short.attainment:.0%}): {binding(short, slos)}")
    return 0
