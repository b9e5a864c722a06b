"""Read benchmarks/results/*.json, check the issues' floors, write summary.json, plots and a Markdown table.

    python benchmarks/summarize.py --results benchmarks/results --img docs/img

Floors (issue 3 "Performance", issue 7 "Floors"), each computed from figures measured side by side
in the same run:
- offline throughput (64 mixed requests): ours / transformers output tok/s >= 3 (issue 3), >= 4 (issue 7)
- decode batch 1: float32 >= 1.3x transformers float32; bfloat16 >= 1.8x transformers float32;
  int8 >= 2.5x transformers float32 (goal: above llama.cpp)
- TTFT of a 2048-token prompt <= transformers' at the same dtype; prefill >= 50% of the probed matmul rate
- decode batch 1 moves weights + KV at >= 70% of the probed memory bandwidth
A missing result file leaves its rows out ("not run").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(results: Path, name: str):
    p = results / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _res(d, engine):
    if d is None:
        return None
    r = d["results"].get(engine)
    return None if r is None or "skipped" in r else r


def floors(results: Path) -> list:
    rows = []

    def add(figure, value, floor, ok, source, unit="x"):
        rows.append({"figure": figure, "value": value, "floor": floor, "unit": unit,
                     "pass": None if value is None else bool(ok), "source": source})

    t = _load(results, "throughput_fp32")
    if t:
        r = t["ratios"].get("output_tokens_per_s_vs_hf")
        add("offline throughput fp32, ours / transformers output tok/s (issue 3)", r, 3.0, r and r >= 3.0,
            "throughput_fp32")
        add("offline throughput fp32, ours / transformers output tok/s (issue 7)", r, 4.0, r and r >= 4.0,
            "throughput_fp32")
    tb = _load(results, "throughput_bf16")
    if tb:
        r = tb["ratios"].get("output_tokens_per_s_vs_hf")
        add("offline throughput bf16, ours / transformers bf16 output tok/s", r, 4.0, r and r >= 4.0,
            "throughput_bf16")
    d32 = _load(results, "decode_b1_fp32")
    hf32 = (_res(d32, "hf") or {}).get("decode_tokens_per_s")
    for name, floor in (("decode_b1_fp32", 1.3), ("decode_b1_bf16", 1.8), ("decode_b1_int8", 2.5)):
        d = _load(results, name)
        ours = (_res(d, "servescope") or {}).get("decode_tokens_per_s")
        r = ours / hf32 if ours and hf32 else None
        add(f"decode batch 1 {name.rsplit('_', 1)[1]}, ours / transformers fp32 tok/s", r, floor,
            r and r >= floor, f"{name} + decode_b1_fp32")
    lc = (_res(d32, "llama-cpp") or {}).get("decode_tokens_per_s")
    d8 = (_res(_load(results, "decode_b1_int8"), "servescope") or {}).get("decode_tokens_per_s")
    if lc and d8:
        add("decode batch 1 int8, ours / llama.cpp tok/s (goal)", d8 / lc, 1.0, d8 >= lc, "decode_b1_int8")
    if d32:
        dec = _res(d32, "servescope")["phases"].get("decode", {})
        v = dec.get("pct_of_bandwidth")
        add("decode batch 1 fp32, weights+KV GB/s as % of probed bandwidth (the probe at the start of the run)", v,
            70.0, v and v >= 70, "decode_b1_fp32", "%")
        v = dec.get("pct_of_session_bandwidth")
        if v is not None:
            add("decode batch 1 fp32, weights+KV GB/s as % of the bandwidth measured around the iterations", v, 70.0,
                v >= 70, "decode_b1_fp32", "%")
        pb = _res(d32, "servescope").get("paired_bandwidth")
        if pb:
            add("decode batch 1 fp32, weights+KV GB/s as % of the bandwidth read between its steps (every "
                f"{pb['every_steps']} steps)", pb["pct"], 70.0, pb["pct"] >= 70, "decode_b1_fp32", "%")
    for dt in ("fp32", "bf16"):
        d = _load(results, f"ttft2048_{dt}")
        if not d:
            continue
        r = d["ratios"].get("ttft_vs_hf")
        add(f"TTFT 2048-token prompt {dt}, ours / transformers (lower is better)", r, 1.0, r and r <= 1.0,
            f"ttft2048_{dt}")
        pre = _res(d, "servescope")["phases"].get("prefill", {})
        v = pre.get("pct_of_peak_flops")
        add(f"prefill {dt}, achieved FLOP/s as % of probed matmul rate", v, 50.0, v and v >= 50, f"ttft2048_{dt}", "%")
    return rows


def headline(results: Path) -> list:
    """Rows of (figure, ours, transformers, llama.cpp) with units, for the docs table."""
    out = []
    t = _load(results, "throughput_fp32")
    if t:
        out.append(("offline throughput fp32 (output tok/s)",
                    *[(_res(t, e) or {}).get("output_tokens_per_s") for e in ("servescope", "hf", "llama-cpp")]))
    tb = _load(results, "throughput_bf16")
    if tb:
        out.append(("offline throughput bf16 (output tok/s)",
                    *[(_res(tb, e) or {}).get("output_tokens_per_s") for e in ("servescope", "hf", "llama-cpp")]))
    for name in ("decode_b1_fp32", "decode_b1_bf16", "decode_b1_int8"):
        d = _load(results, name)
        if d:
            out.append((f"decode batch 1 {name.rsplit('_', 1)[1]} (tok/s)",
                        *[(_res(d, e) or {}).get("decode_tokens_per_s") for e in ("servescope", "hf", "llama-cpp")]))
    for dt in ("fp32", "bf16"):
        d = _load(results, f"ttft2048_{dt}")
        if d:
            vals = [(_res(d, e) or {}).get("ttft_s") for e in ("servescope", "hf", "llama-cpp")]
            out.append((f"TTFT 2048-token prompt {dt} (s)", *vals))
    return out


def _f(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(rows, heads) -> str:
    lines = ["| figure | servescope | transformers | llama.cpp |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {h[0]} | {_f(h[1])} | {_f(h[2])} | {_f(h[3])} |" for h in heads]
    lines += ["", "| floor | measured | needs | met |", "| --- | ---: | ---: | :---: |"]
    for r in rows:
        op = "<=" if "lower is better" in r["figure"] else ">="
        met = {True: "yes", False: "**no**", None: "not run"}[r["pass"]]
        lines.append(f"| {r['figure']} | {_f(r['value'])}{r['unit']} | {op} {r['floor']:g}{r['unit']} | {met} |")
    return "\n".join(lines)


def plot_bars(heads, path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tok = [h for h in heads if "tok/s" in h[0]]
    if not tok:
        return
    fig = Figure(figsize=(10, 0.6 + 0.75 * len(tok)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    engines = ("servescope", "transformers", "llama.cpp")
    h = 0.25
    for j, eng in enumerate(engines):
        ys = [i + (1 - j) * h for i in range(len(tok))]
        vals = [row[1 + j] or 0.0 for row in tok]
        bars = ax.barh(ys, vals, height=h, label=eng)
        for b, v in zip(bars, vals):
            if v:
                ax.annotate(f"{v:.1f}", (b.get_width(), b.get_y() + h / 2), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(tok)), [row[0] for row in tok], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (higher is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--img", default="docs/img")
    a = p.parse_args(argv)
    results = Path(a.results)
    rows, heads = floors(results), headline(results)
    any_env = next((json.loads(f.read_text()) for f in sorted(results.glob("*.json"))
                    if f.name != "summary.json"), None)
    env = {k: any_env[k] for k in ("date_utc", "machine", "versions")} if isinstance(any_env, dict) else {}
    summary = {**env, "headline": [dict(zip(("figure", "servescope", "transformers", "llama_cpp"), h))
                                   for h in heads], "floors": rows}
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    Path(a.img).mkdir(parents=True, exist_ok=True)
    if env:
        title = f"SmolLM2-135M on {env['machine']['cpu']}, {env['machine']['torch_threads']} threads, " \
                f"{env['date_utc'][:10]}"
        plot_bars(heads, str(Path(a.img) / "cpu_tokens_per_s.png"), title)
    sb = results / "decode_batch_sweep.json"
    if sb.exists():
        sys.path.insert(0, str(Path(__file__).parent))
        from decode_batch_sweep import plot

        plot(json.loads(sb.read_text()), str(Path(a.img) / "decode_batch_sweep.png"))
    print(markdown(rows, heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
