"""Pipeline parallel (PP=2, two gloo processes, one thread each) with and without micro-batches, on
the embedded SmolLM2-135M in float32: decode steps at batch 8-32 and one prefill step, beside one
process with the same two cores.

One PP=2 engine serves every micro-batch setting (its executor's `micro_batches` is switched between
measurements, so the same two processes run A and B); the settings are measured in turn, round by
round, and each round's ratio is taken against PP=2 without micro-batches in the same round. The
prediction is the StepRecords' own (the pipeline schedule of analysis/pipeline_schedule.py on the
local probe and the measured gloo link).

    PYTHONPATH=src python benchmarks/pipeline_microbatch.py [--rounds 3] [--micro 1,2,4] \
        [--batches 8,16,32] [--prefill-len 256] [--baseline-threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics


def _measure(engine, rng, batches: list, prompt_len: int, decode_steps: int, prefill_len: int) -> dict:
    """{case: (median wall s, median predicted s)} of one setting, one round."""
    from servescope.labs.common import random_prompt, run_to_completion

    vocab, out = engine.model_config.vocab_size, {}
    for b in batches:
        _, recs = run_to_completion(engine, [random_prompt(rng, prompt_len, vocab) for _ in range(b)],
                                    decode_steps + 1, f"b{b}-")
        dec = [r for r in recs if r.phase == "decode" and r.num_decode_seqs == b]
        out[f"decode b={b}"] = _medians(dec)
    _, recs = run_to_completion(engine, [random_prompt(rng, prefill_len, vocab)], 1, "p-")
    out[f"prefill {prefill_len}"] = _medians([r for r in recs if r.phase == "prefill"])
    return out


def _medians(recs: list) -> tuple:
    pred = [r.predicted_seconds for r in recs if r.predicted_seconds is not None]
    return (statistics.median(r.wall_seconds for r in recs), statistics.median(pred) if pred else None,
            max(r.pipeline_micro_batches for r in recs))


def _set(engine, micro: int) -> None:
    """The micro-batches of the PP engine's next steps (the executor cuts, the cost model predicts)."""
    engine.executor.micro_batches = micro
    if engine.step_cost_predictor is not None:
        engine.step_cost_predictor.micro_batches = micro


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro", default="1,2,4", help="micro-batch settings of the PP=2 engine")
    ap.add_argument("--batches", default="8,16,32")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt of each decoding sequence")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--baseline-threads", type=int, default=2, help="one process with this many threads (0: none)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from servescope.bench.envinfo import environment_info
    from servescope.engine.llm_engine import LLMEngine
    from servescope.measure.local_hardware import local_gloo_link
    from servescope.labs.common import warm_up

    local_gloo_link(measure=True)  # so that the StepRecords predict the hand-overs too
    micro, batches = [int(x) for x in a.micro.split(",")], [int(x) for x in a.batches.split(",")]
    kw = dict(dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False, num_kv_blocks=256,
              max_num_seqs=max(batches), max_num_batched_tokens=max(a.prefill_len, max(batches) * a.prompt_len),
              max_model_len=max(a.prefill_len, a.prompt_len + a.decode_steps) + 16)
    pp = LLMEngine(pipeline_parallel_size=2, num_threads=1, **kw)
    single = LLMEngine(num_threads=a.baseline_threads, **kw) if a.baseline_threads else None
    points = [("PP=2", m) for m in micro] + ([(f"1 process, {a.baseline_threads} threads", 0)] if single else [])
    rng = random.Random(0)
    runs: dict = {p: [] for p in points}
    try:
        for name, m in points:  # first calls (allocator, kernel choices) paid before any round
            torch.set_num_threads(1 if single is None or name == "PP=2" else a.baseline_threads)
            if name == "PP=2":
                _set(pp, m)
            warm_up(pp if name == "PP=2" else single, rng)
        for rnd in range(a.rounds):
            for name, m in points:
                torch.set_num_threads(1 if name == "PP=2" else a.baseline_threads)
                engine = pp if name == "PP=2" else single
                if name == "PP=2":
                    _set(engine, m)
                runs[(name, m)].append(_measure(engine, rng, batches, a.prompt_len, a.decode_steps, a.prefill_len))
                print(f"round {rnd + 1}: {name} {f'micro-batches {m}' if m else ''} done", flush=True)
    finally:
        pp.shutdown()
    _report(runs, points, a, environment_info())


def _report(runs: dict, points: list, a, env: dict) -> None:
    base = ("PP=2", 1) if ("PP=2", 1) in runs else points[0]
    cases = list(runs[points[0]][0])
    rows = []
    print(f"\n{'case':<14} {'setting':<28} {'cut':>4} {'median ms':>10} {'predicted ms':>13} "
          f"{'x PP=2 no micro':>16}  (ratios: median of same-round ratios)")
    for case in cases:
        for p in points:
            walls = [r[case][0] for r in runs[p]]
            preds = [r[case][1] for r in runs[p] if r[case][1] is not None]
            ratio = statistics.median(r[case][0] / b[case][0] for r, b in zip(runs[p], runs[base]))
            label = p[0] + (f", micro-batches {p[1]}" if p[0] == "PP=2" else "")
            cut = max(r[case][2] for r in runs[p])
            row = {"case": case, "setting": label, "micro_batches_cut": cut, "median_s": statistics.median(walls),
                   "walls_s": walls, "predicted_s": statistics.median(preds) if preds else None, "ratio": ratio}
            rows.append(row)
            pred = f"{row['predicted_s'] * 1e3:13.1f}" if preds else f"{'-':>13}"
            print(f"{case:<14} {label:<28} {cut:>4} {row['median_s'] * 1e3:10.1f} {pred} {ratio:16.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "pipeline_microbatch", **env, "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
