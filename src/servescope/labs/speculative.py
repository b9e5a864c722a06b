"""Lab `speculative`: speculative decoding spends the idle compute of memory-bound decode steps on
verifying guessed tokens; it pays at small batches on text that the guesses can follow, and stops paying
as the batch approaches the compute crossover (every verified row then costs its full FLOPs).

Measured: decode tokens/s with n-gram prompt lookup at k drafts against k = 0, per batch size, on a
copy-heavy workload (each prompt is a random passage followed by the start of its repeat: the model goes
on repeating it, and the lookup guesses the repeat) and an open one (random prompts: few guesses match).
Predicted: the cost model's speed-up for the steps that ran: the same emitted tokens (the measured
acceptance) over the sum of each step's predicted time (its rows, drafts included), against the same for
k = 0; `servescope explain --speculative` gives the closed form E(a, k) t(B) / t(B (1 + k)).
"""

from __future__ import annotations

import random

from servescope.config import SpeculativeConfig
from servescope.labs.common import (
    LabOptions, LabResult, LabSession, blocks_for, context_line, interleaved, lab_hardware, md_table, median,
    new_figure, random_prompt, rel_error, run_to_completion, save_figure, warm_up, write_report,
)

PASSAGE = 48
OUTPUT = 32


def points(quick: bool) -> tuple:
    """(ks, batch sizes)."""
    return ([0, 2, 4], [1, 4]) if quick else ([0, 2, 4, 6], [1, 4, 16, 32])


def per_draft_rate(accepted: int, drafted: int, k: int) -> float:
    """a such that E[accepted] / k = a (1 - a^k) / ((1 - a) k) equals accepted / drafted (bisection)."""
    if not drafted or not accepted:
        return 0.0
    target, lo, hi = accepted / drafted, 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if a * (1 - a ** k) / ((1 - a) * k) < target else (lo, a)
    return (lo + hi) / 2


def prompts(kind: str, rng: random.Random, batch: int, vocab: int) -> list:
    out = []
    for _ in range(batch):
        p = random_prompt(rng, PASSAGE, vocab)
        out.append(p + p[:8] if kind == "copy" else p)
    return out


def measure(opts: LabOptions, session: LabSession) -> tuple:
    ks, sizes = points(opts.quick)
    max_b = max(sizes)
    common = dict(max_num_seqs=max_b, max_num_batched_tokens=max(max_b * (PASSAGE + 8), 1024),
                  num_kv_blocks=max_b * blocks_for(PASSAGE + 8 + OUTPUT + 8, margin=1) + 8,
                  max_model_len=PASSAGE + OUTPUT + 32)
    engines = {k: session.engine(**common, speculative=SpeculativeConfig(
        "ngram", num_speculative_tokens=k, speculative_adaptive=False) if k else SpeculativeConfig()) for k in ks}
    rng = random.Random(opts.seed)
    warm_up(engines[0], rng)
    vocab = engines[0].model_config.vocab_size

    def run(point, rnd):
        kind, b, k = point
        engine = engines[k]
        ps = prompts(kind, random.Random(hash((kind, b, rnd)) & 0xFFFF), b, vocab)
        outs, recs = run_to_completion(engine, ps, OUTPUT, f"{kind}{b}k{k}r{rnd}-")
        dec = [r for r in recs if r.num_prefill_tokens == 0]
        n_tok = sum(len(o.outputs[0].token_ids) for o in outs) - b  # the first token is the prefill's
        ctx = median([c for r in dec for c in r.context_lens]) if dec else PASSAGE
        pred = sum(r.predicted_seconds for r in dec) if all(r.predicted_seconds for r in dec) else None
        return {"tokens": n_tok, "seconds": sum(r.wall_seconds for r in dec), "ctx": ctx, "predicted_seconds": pred,
                "drafted": sum(r.num_draft_tokens for r in dec), "accepted": sum(r.num_accepted_tokens for r in dec)}

    pts = [(kind, b, k) for kind in ("copy", "open") for b in sizes for k in ks]
    got = interleaved(pts, 2 if opts.quick else 1, run)
    return engines[0], ks, sizes, got


def run(opts: LabOptions, session: LabSession) -> LabResult:
    engine, ks, sizes, got = measure(opts, session)
    hw = lab_hardware(opts, engine)
    rows, curves = [], {}

    def pred_tps(rs):
        return None if any(r["predicted_seconds"] is None for r in rs) else median(
            [r["tokens"] / r["predicted_seconds"] for r in rs])

    for kind in ("copy", "open"):
        for b in sizes:
            base = got[(kind, b, 0)]
            base_tps, base_pred = median([r["tokens"] / r["seconds"] for r in base]), pred_tps(base)
            for k in ks[1:]:
                rs = got[(kind, b, k)]
                meas = median([r["tokens"] / r["seconds"] for r in rs]) / base_tps
                drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
                p = pred_tps(rs)
                pred = p / base_pred if p and base_pred else None
                rows.append([kind, b, k, accepted / drafted if drafted else 0.0, per_draft_rate(accepted, drafted, k),
                             meas, pred, 100 * rel_error(pred, meas) if pred else None])
                curves.setdefault((kind, k), []).append((b, meas, pred))
    fig, axes = new_figure(2)
    for ax, kind in zip(axes, ("copy", "open")):
        for k in ks[1:]:
            pts = curves[(kind, k)]
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"k={k} measured")[0]
            if all(p[2] is not None for p in pts):
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", color=line.get_color(),
                        label=f"k={k} predicted")
        ax.axhline(1.0, color="gray", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("speed-up over k = 0 (decode tokens/s)")
        ax.set_title(f"{kind} workload")
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=7)
    plot = save_figure(fig, opts.out / "speculative.png")
    errs = [abs(r[7]) for r in rows if r[7] is not None]
    summary = {"rows": [dict(zip(["workload", "batch", "k", "accepted_per_drafted", "per_draft_acceptance",
                                  "measured_speedup", "predicted_speedup", "error_pct"], r)) for r in rows],
               "max_abs_error_pct": max(errs) if errs else None}
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\nCopy: a {PASSAGE}-token random passage then its first 8 "
         f"tokens; open: the passage alone. Greedy, {OUTPUT} output tokens; n-gram prompt lookup (1..4-grams), "
         f"fixed k; decode tokens/s over the steps without prefill, median of interleaved rounds."),
        ("Results", md_table(["workload", "batch", "k", "accepted/drafted", "per-draft a", "measured x",
                              "predicted x", "error %"], rows)),
        ("What it shows",
         "Where the guesses are right (copy) the verification step costs about what a plain decode step costs "
         "at small batches, since decode is memory-bound, and each step emits several tokens; as the batch grows "
         "the extra rows are no longer free and the gain shrinks, which the cost model predicts from the same "
         "step-time model every StepRecord carries. Where the guesses are rare (open) little is proposed and "
         "the speed-up stays near 1: what is proposed and rejected is the cost."),
    ]
    report = write_report(opts.out, "Lab: speculative decoding", sections, [plot], summary)
    return LabResult("speculative", opts.out, report, [plot], summary)
