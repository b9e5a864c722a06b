"""`servescope generate` and `servescope chat`: stream text, then show what the engine did."""

from __future__ import annotations

import argparse
import contextlib
import sys

from servescope.cli.args import add_engine_args, add_sampling_args, engine_config_from_args, sampling_params_from_args
from servescope.cli.live import DashboardRun, add_dashboard_args
from servescope.cli.output import console, fmt_bytes
from servescope.telemetry.trace import write_chrome_trace


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text for a prompt and show the internals")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (Perfetto) of the steps")
    g.add_argument("--steps", action="store_true", help="print every step record")
    add_dashboard_args(g)
    add_engine_args(g)
    add_sampling_args(g)

    c = sub.add_parser("chat", help="interactive chat with the model")
    c.add_argument("--system", default=None)
    add_engine_args(c)
    add_sampling_args(c, max_tokens=256)


def run(args: argparse.Namespace) -> int:
    return {"generate": run_generate, "chat": run_chat}[args.command](args)


def _engine_from_args(a):
    # the engine (torch, transformers) is imported when a command runs: it is seconds of `--help`
    from servescope.measure.local_hardware import measured_engine

    return measured_engine(engine_config_from_args(a))


def stream_one(engine, prompt, params, out=sys.stdout) -> tuple:
    """Add one request, print its text as it grows; return (final RequestOutput, its step records)."""
    first_step = len(engine.step_records)
    engine.add_request("cli-0", prompt, params)
    printed = 0
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            text = o.outputs[0].text
            if len(text) > printed:
                out.write(text[printed:])
                out.flush()
                printed = len(text)
            if o.finished:
                final = o
    out.write("\n")
    steps = list(engine.step_records)[first_step:]
    return final, steps


def _request_table(engine, final):
    from rich.table import Table  # lazy: rich is 0.13 s of `--help` (cli/output.py)

    m = final.outputs[0].metrics
    req = Table(title="request", show_header=False, box=None, pad_edge=False)
    req.add_column(style="bold")
    req.add_column(justify="right")
    req.add_row("prompt tokens", str(len(final.prompt_token_ids)))
    req.add_row("output tokens", f"{m.num_output_tokens}  (finish: {final.outputs[0].finish_reason})")
    req.add_row("TTFT", f"{m.ttft * 1e3:.1f} ms" if m.ttft is not None else "-")
    req.add_row("TPOT", f"{m.tpot * 1e3:.1f} ms  ({1 / m.tpot:.1f} tokens/s)" if m.tpot else "-")
    kv = engine.kv_bytes_per_token
    req.add_row("KV cache bytes per token",
                f"{kv:,} B  ({fmt_bytes(kv)}, {str(engine.kv_dtype).replace('torch.', '')})")
    used = (len(final.prompt_token_ids) + m.num_output_tokens) * kv
    req.add_row("KV cache in use (this request)", fmt_bytes(used))
    req.add_row("KV cache allocated", f"{fmt_bytes(engine.runner.kv_cache_bytes)} "
                                     f"({engine.cache_config.num_blocks} blocks x {engine.cache_config.block_size})")
    if engine.device.type == "cpu":
        from servescope.kernels.cpu import ops as cpu_ops  # lazy: torch (the CLI's --help stays torch-free)

        req.add_row("CPU kernels", cpu_ops.kernel_path())
    req.add_row("weights", f"{fmt_bytes(engine.weight_bytes)}  ({str(engine.dtype).replace('torch.', '')}"
                           f"{f', {engine.config.quantization} linear weights' if engine.config.quantization else ''})")
    return req


def _phase_table(steps):
    from rich.table import Table  # lazy: rich is 0.13 s of `--help` (cli/output.py)

    hw = (steps[0].hardware or "?") if steps else "?"
    phases = Table(title=f"phases: measured, and predicted by the cost model for {hw}")
    for col in ("phase", "steps", "tokens", "ms", "tok/s", "GFLOP/s", "GB/s", "bound", "pred ms"):
        phases.add_column(col, justify="left" if col in ("phase", "bound") else "right")
    pre = [s for s in steps if s.num_prefill_tokens]
    dec = [s for s in steps if not s.num_prefill_tokens and s.num_decode_tokens]
    for name, ss in (("prefill", pre), ("decode", dec)):
        if not ss:
            continue
        t = sum(s.wall_seconds for s in ss)
        n = sum(s.num_prefill_tokens if name == "prefill" else s.num_decode_tokens for s in ss)
        flops = sum(s.flops or 0 for s in ss)
        byts = sum(s.bytes or 0 for s in ss)
        pred = sum(s.predicted_seconds or 0 for s in ss)
        bounds = {s.bound for s in ss if s.bound}
        phases.add_row(name, str(len(ss)), str(n), f"{t * 1e3:.1f}", f"{n / t:.1f}" if t else "-",
                       f"{flops / t / 1e9:.1f}" if t else "-", f"{byts / t / 1e9:.1f}" if t else "-",
                       "/".join(sorted(bounds)) or "-", f"{pred * 1e3:.1f}" if pred else "-")
    return phases


def internals_summary(engine, final, steps) -> list:
    """Rich tables: the request's latency and the engine's per-phase work."""
    return [_request_table(engine, final), _phase_table(steps)]


def step_table(steps):
    from rich.table import Table  # lazy: rich is 0.13 s of `--help` (cli/output.py)

    t = Table(title="steps")
    for col in ("step", "phase", "tokens", "ctx", "ms", "pred ms", "GB/s", "GFLOP/s", "bound", "KV blocks"):
        t.add_column(col, justify="right")
    for s in steps:
        t.add_row(str(s.step), s.phase, str(s.num_tokens), str(max(s.context_lens or [0])),
                  f"{s.wall_seconds * 1e3:.1f}", f"{(s.predicted_seconds or 0) * 1e3:.1f}",
                  f"{(s.achieved_bytes_per_s or 0) / 1e9:.1f}", f"{(s.achieved_flops_per_s or 0) / 1e9:.1f}",
                  s.bound or "-", str(s.kv_blocks_used))
    return t


def run_generate(a) -> int:
    params = sampling_params_from_args(a)
    con = console()
    with con.status("loading model ...", spinner="dots") if con.is_terminal else contextlib.nullcontext():
        engine = _engine_from_args(a)
    prompt = a.prompt
    if a.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    live = DashboardRun(engine, a.dashboard_port, a.model or "smollm2-135m", not a.no_browser) if a.dashboard else None
    try:
        final, steps = live.generate(prompt, params) if live else stream_one(engine, prompt, params)
        con.print()
        for t in internals_summary(engine, final, steps):
            con.print(t)
        if a.steps:
            con.print(step_table(steps))
        if a.trace:
            write_chrome_trace(a.trace, steps, [final])
            con.print(f"trace written to {a.trace} (open it in https://ui.perfetto.dev, or `servescope replay`)")
        if live:
            live.hold(a.dashboard_hold)
    finally:
        if live:
            live.close()
    return 0


def run_chat(a) -> int:
    params = sampling_params_from_args(a)
    engine = _engine_from_args(a)
    con = console()
    messages = [{"role": "system", "content": a.system}] if a.system else []
    con.print("[bold]servescope chat[/bold] — empty line or Ctrl-D to quit, /stats for the last turn's internals")
    last = None
    while True:
        try:
            user = input("you> ")
        except EOFError:
            break
        if not user.strip():
            break
        if user.strip() == "/stats":
            if last:
                for t in internals_summary(engine, *last):
                    con.print(t)
            continue
        messages.append({"role": "user", "content": user})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        sys.stdout.write("assistant> ")
        final, steps = stream_one(engine, ids, params)
        last = (final, steps)
        messages.append({"role": "assistant", "content": final.outputs[0].text})
        m = final.outputs[0].metrics
        con.print(f"[dim]{m.num_output_tokens} tokens, TTFT {m.ttft * 1e3:.0f} ms"
                  + (f", {1 / m.tpot:.1f} tokens/s" if m.tpot else "") + "[/dim]")
    return 0
