"""Lab `validate`'s mixed check: the cost model on a continuous-batching workload, step by step.

The clean points of validate.py (decode batches at one context, single prompts in one step) are the
shapes a probe would pick. A server's steps are not: requests of 20-700 prompt tokens and 8-200 output
tokens join and leave a running batch, so steps mix prefill chunks with decode rows over contexts of
every length. Here MIXED_REQUESTS such requests run through the real engine (chunked prefill, a token
budget, at most CONCURRENCY running: the scheduler admits the next as one finishes), and every step's
measured wall time is set beside the prediction its StepRecord carries. Per phase (prefill-only,
decode-only, mixed) the median and p90 of |predicted - measured| / measured, against the floors of
issue 35 (median <= 15%, p90 <= 30%). Nothing in the prediction is fitted to these steps.
"""

from __future__ import annotations

import random

from servescope.analysis.bandwidth import bandwidth_origin
from servescope.labs.common import (blocks_for, md_table, median, percentile, random_prompt, run_to_completion,
                                    warm_up)

MIXED_REQUESTS = 48
PROMPT_TOKENS = (20, 700)
OUTPUT_TOKENS = (8, 200)
CONCURRENCY = 16
TOKEN_BUDGET = 512
QUICK = (12, (20, 200), (4, 24))  # requests, prompt tokens, output tokens
MEDIAN_FLOOR = 0.15
P90_FLOOR = 0.30
PHASES = ("prefill", "decode", "mixed")


def mixed_requests(rng: random.Random, vocab: int, quick: bool = False) -> list:
    """[(prompt ids, max tokens)] of the workload, random prompts (no shared prefix)."""
    n, prompts, outputs = QUICK if quick else (MIXED_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS)
    return [(random_prompt(rng, rng.randint(*prompts), vocab), rng.randint(*outputs)) for _ in range(n)]


def mixed_engine(session, quick: bool = False):
    _, prompts, outputs = QUICK if quick else (MIXED_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS)
    longest = prompts[1] + outputs[1] + 16
    return session.engine(max_num_seqs=CONCURRENCY, enable_chunked_prefill=True,
                          max_num_batched_tokens=TOKEN_BUDGET,
                          max_model_len=longest, num_kv_blocks=CONCURRENCY * blocks_for(longest) + 16)


def run_mixed(engine, requests: list, prefix: str = "mixed") -> list:
    """Queue every request, step until all finish; the StepRecords of those steps that carry a prediction."""
    _, recs = run_to_completion(engine, [p for p, _ in requests], [n for _, n in requests], prefix)
    return [r for r in recs if r.predicted_seconds is not None and r.wall_seconds > 0]


def phase_errors(records: list) -> dict:
    """{phase: {steps, median_abs, p90_abs, median_signed, measured_s, predicted_s, meets}}, phases run."""
    out = {}
    for phase in PHASES:
        recs = [r for r in records if r.phase == phase]
        if not recs:
            continue
        err = [(r.predicted_seconds - r.wall_seconds) / r.wall_seconds for r in recs]
        abs_err = [abs(e) for e in err]
        med, p90 = median(abs_err), percentile(abs_err, 90)
        out[phase] = {"steps": len(recs), "median_abs": med, "p90_abs": p90, "median_signed": median(err),
                      "measured_s": sum(r.wall_seconds for r in recs),
                      "predicted_s": sum(r.predicted_seconds for r in recs),
                      "meets": med <= MEDIAN_FLOOR and p90 <= P90_FLOOR}
    return out


def measure_mixed(session, seed: int, quick: bool = False) -> dict:
    """The mixed check: its errors per phase, each step's (phase, tokens, sequences, measured, predicted)."""
    engine = mixed_engine(session, quick)
    rng = random.Random(seed + 35)
    warm_up(engine, rng)
    warm_up(engine, rng, prompt_len=(QUICK[1] if quick else PROMPT_TOKENS)[1] // 2, batch=4, max_tokens=8)
    requests = mixed_requests(rng, engine.model_config.vocab_size, quick)
    records = run_mixed(engine, requests)
    steps = [[r.phase, r.num_prefill_tokens + r.num_decode_tokens, len(r.context_lens), r.wall_seconds,
              r.predicted_seconds] for r in records]
    hw = engine.hardware
    priced = bandwidth_origin(hw) if hw is not None else ""
    return {"phases": phase_errors(records), "requests": len(requests), "steps": steps, "bandwidth": priced}


def mixed_section(result: dict) -> str:
    rows = [[ph, v["steps"], f"{100 * v['median_abs']:.1f}", f"{100 * v['p90_abs']:.1f}",
             f"{100 * v['median_signed']:+.1f}", v["measured_s"], v["predicted_s"],
             "met" if v["meets"] else "MISSED"] for ph, v in result["phases"].items()]
    return (f"{result['requests']} requests of {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} prompt tokens and "
            f"{OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} output tokens (quick mode: fewer, shorter), at most "
            f"{CONCURRENCY} running, chunked prefill with a {TOKEN_BUDGET}-token budget; each step's "
            "measured wall time against its StepRecord's prediction. Floors (issue 35): median |error| <= "
            f"{100 * MEDIAN_FLOOR:.0f}%, p90 <= {100 * P90_FLOOR:.0f}% per phase."
            + (f" Its engine's steps were {result['bandwidth']}." if result.get("bandwidth") else "") + "\n\n"
            + md_table(["phase", "steps", "median |err| %", "p90 |err| %", "median signed %",
                        "measured s (sum)", "predicted s (sum)", "floor"], rows))
