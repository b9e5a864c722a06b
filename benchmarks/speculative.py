"""Speculative decoding on this machine: tokens/s with and without, same run, interleaved rounds.

Workloads (SmolLM2-135M-Instruct in float32, greedy):
  copy     batch 1, copy-heavy prompts (repeat / lightly edit a paragraph given in the prompt): n-gram
           prompt lookup, and draft models (the same model quantised: int8, int4), against no speculation
  open-B   batch B (--open-batches, default 1 and 32), open-ended prompts: adaptive n-gram and draft
           speculation against none (at batch 32 it must not slow down)
Each round runs every configuration once on the same prompts (A, B, C, A, B, C, ...); the figures are
medians over rounds and ratios within the same round. Beside each measured speed-up the cost model's
prediction at the measured acceptance rate (analysis/speculative.py). For a draft: its cost per draft
token (whole proposals: forwards, sampling, copies) over the target's plain decode step, and, with
--draft-alone, the draft's weights decoding alone (no speculation) in the same rounds.

    python benchmarks/speculative.py --rounds 3 --json benchmarks/results/speculative.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PARAGRAPHS = [
    "The history of the city begins in the third century, when a small fishing village grew around the "
    "harbour. Merchants came from the south with salt, wine and cloth, and the town built walls, a market "
    "and a church. By the twelfth century it was the largest port on the coast.",
    "To install the package, first create a virtual environment with python -m venv .venv, then activate "
    "it and run pip install servescope. The command line tool is called servescope; run servescope "
    "generate with a prompt to check that the model loads and answers.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
    "glucose and oxygen. It takes place in the chloroplasts, which contain the pigment chlorophyll, and it "
    "is the source of almost all the oxygen in the air we breathe.",
    "The meeting is moved from Tuesday to Thursday at ten in the morning. Please bring the quarterly report, "
    "the budget for next year and your questions about the new office. Lunch will be served after the "
    "meeting in the small room on the second floor.",
]
COPY_TASKS = ["Repeat the following text exactly, word for word:\n\n{p}",
              "Copy this paragraph, changing nothing but the first word to uppercase:\n\n{p}"]
TOPICS = ["a dragon", "the sea", "a robot", "winter", "a lost key", "the moon", "a market", "a train", "music",
          "a garden", "an old castle", "a storm", "friendship", "a river", "the desert", "a library"]


def copy_prompts(tok) -> list:
    msgs = [[{"role": "user", "content": t.format(p=p)}] for p in PARAGRAPHS for t in COPY_TASKS]
    return [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in msgs]


def open_prompts(tok, n: int) -> list:
    msgs = [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}"
                                         f"{' at night' if i >= len(TOPICS) else ''}."}] for i in range(n)]
    return [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in msgs]


def run_batch(llm, prompts, params, batch: int) -> dict:
    """Generate prompts `batch` at a time; output tokens, decode tokens/s and acceptance."""
    spec = llm.engine.spec
    drafts0, acc0 = (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)
    prop = getattr(spec, "proposer", None) if spec else None
    counters = ("propose_seconds", "num_forwards", "prefill_seconds")
    prop0 = [getattr(prop, c, 0) for c in counters]
    step0 = llm.engine._step_counter
    n_out, decode_s, wall, outs = 0, 0.0, 0.0, []
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        res = llm.generate(prompts[i:i + batch], params)
        wall += time.perf_counter() - t0
        for r in res:
            n_out += len(r.outputs[0].token_ids)
            outs.append(r.outputs[0].token_ids)
        # decode time of the batch: from its last first token to its last token
        decode_s += max(r.outputs[0].metrics.token_times[-1] for r in res) - max(
            r.outputs[0].metrics.token_times[0] for r in res)
        n_out -= len(res)  # the first token of each request is the prefill's
    drafts = (spec.num_draft_tokens - drafts0) if spec else 0
    accepted = (spec.num_accepted_tokens - acc0) if spec else 0
    steps = [r.wall_seconds for r in llm.engine.step_records if r.step > step0 and r.phase == "decode"]
    out = {"decode_tokens": n_out, "decode_seconds": decode_s, "decode_tokens_per_s": n_out / decode_s,
           "wall_seconds": wall, "draft_tokens": drafts, "accepted_tokens": accepted,
           "acceptance_rate": accepted / drafts if drafts else None, "outputs": outs,
           "median_decode_step_seconds": statistics.median(steps) if steps else None}
    if hasattr(prop, "propose_seconds"):  # a draft model: its own time (already inside the decode time)
        d = [getattr(prop, c) - c0 for c, c0 in zip(counters, prop0)]
        # per draft step (k per proposal, over the batch's rows): at batch 1 per draft token
        out.update(draft_propose_seconds=d[0], draft_seconds_per_step=d[0] / max(d[1], 1),
                   draft_prefill_seconds=d[2])
    return out


def predicted(llm, cfg_k: int, acceptance, batch: int, ctx: int) -> dict:
    """The cost model's speed-up at the measured acceptance (per-draft, from accepted / drafted), with
    the draft's forwards as the engine's k chooser predicts them (none for n-gram)."""
    from servescope.analysis.speculative import expected_tokens_per_step, predicted_speedup
    from servescope.labs.speculative import per_draft_rate

    cost = llm.engine.step_cost_predictor
    draft = llm.engine.spec.chooser.draft_step_seconds

    def t(rows):
        return cost.predict([(1, ctx)] * rows, num_logits=rows).predicted_seconds

    a = per_draft_rate(acceptance, 1.0, cfg_k)  # accepted / drafted -> per-draft rate
    t_propose = cfg_k * draft(batch, ctx) if draft is not None else 0.0
    return {"per_draft_acceptance": a, "expected_tokens_per_step": expected_tokens_per_step(a, cfg_k),
            "predicted_draft_step_over_target_step": t_propose / cfg_k / t(batch),
            "predicted_speedup": predicted_speedup(a, cfg_k, t(batch), t(batch * (1 + cfg_k)), t_propose)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--draft-k", type=int, default=3)
    p.add_argument("--draft-quantizations", default="int8,int4",
                   help="comma-separated: one draft (the target's own weights, quantised) per mode")
    p.add_argument("--copy-tokens", type=int, default=96)
    p.add_argument("--copy-prompts", type=int, default=8)
    p.add_argument("--open-batches", default="1,32", help="comma-separated batch sizes of the open workload")
    p.add_argument("--draft-alone", action="store_true",
                   help="also decode the copy prompts with each draft's weights alone (its plain tokens/s)")
    p.add_argument("--open-tokens", type=int, default=48)
    p.add_argument("--only", default="copy,open")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from servescope import LLM, SamplingParams
    from servescope.bench.envinfo import environment_info
    from servescope.config import SpeculativeConfig

    base = LLM(num_kv_blocks=1024, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024,
               num_threads=a.threads)
    tok = base.tokenizer
    configs = {"none": base,
               "ngram": base.with_config(speculative=SpeculativeConfig("ngram", num_speculative_tokens=a.k)),
               **{f"draft-{q}": base.with_config(speculative=SpeculativeConfig(
                   "draft", num_speculative_tokens=a.draft_k, speculative_quantization=q))
                  for q in a.draft_quantizations.split(",") if q}}
    drafts = [n for n in configs if n.startswith("draft-")]
    alone = []
    if a.draft_alone:  # the draft's weights as a model of their own (a second load: weights differ)
        for q in a.draft_quantizations.split(","):
            if q:
                configs[f"alone-{q}"] = LLM(num_kv_blocks=1024, max_model_len=2048, max_num_seqs=64,
                                            max_num_batched_tokens=1024, num_threads=a.threads, quantization=q)
                alone.append(f"alone-{q}")
    results: dict = {"benchmark": "speculative", **environment_info(), "k": a.k, "draft_k": a.draft_k}
    work = {}
    if "copy" in a.only:
        work["copy"] = (copy_prompts(tok)[:a.copy_prompts], SamplingParams(temperature=0, max_tokens=a.copy_tokens), 1,
                        ["none", "ngram", *drafts, *alone])
    if "open" in a.only:
        for b in (int(x) for x in a.open_batches.split(",") if x):
            work[f"open-{b}"] = (open_prompts(tok, max(b, a.copy_prompts)),
                                 SamplingParams(temperature=0, max_tokens=a.open_tokens, ignore_eos=True), b,
                                 ["none", "ngram", *drafts])
    for name, (prompts, params, batch, names) in work.items():
        for n in names:  # warm-up (first-use allocations, kernel JIT, the k chooser's tables), not timed
            run_batch(configs[n], prompts[:batch], params.replace(max_tokens=min(params.max_tokens, 16)), batch)
        rounds = []
        for r in range(a.rounds):
            row = {n: run_batch(configs[n], prompts, params, batch) for n in names}
            for n in names:
                print(f"{name} round {r}: {n:10s} {row[n]['decode_tokens_per_s']:7.1f} decode tok/s "
                      f"acceptance {row[n]['acceptance_rate']}", flush=True)
            rounds.append(row)
        summary = {}
        for n in names:
            tps = [row[n]["decode_tokens_per_s"] for row in rounds]
            ratios = [row[n]["decode_tokens_per_s"] / row["none"]["decode_tokens_per_s"] for row in rounds]
            same = all(row[n]["outputs"] == row["none"]["outputs"] for row in rounds) if n not in alone else None
            acc = [row[n]["acceptance_rate"] for row in rounds if row[n]["acceptance_rate"] is not None]
            summary[n] = {"median_decode_tokens_per_s": statistics.median(tps), "speedup_per_round": ratios,
                          "median_speedup": statistics.median(ratios), "outputs_equal_to_none": same,
                          "acceptance_rate": statistics.median(acc) if acc else None}
            if n not in ("none", *alone) and acc:
                ctx = statistics.median(len(x) for x in prompts) + params.max_tokens // 2
                k = a.k if n == "ngram" else a.draft_k
                if n.startswith("draft"):
                    per_step = [row[n]["draft_seconds_per_step"] / row["none"]["median_decode_step_seconds"]
                                for row in rounds]
                    summary[n]["draft_step_over_target_step"] = statistics.median(per_step)  # same rounds
                    summary[n]["draft_cheaper_by"] = 1 / summary[n]["draft_step_over_target_step"]
                    summary[n]["draft_prefill_share"] = (sum(row[n]["draft_prefill_seconds"] for row in rounds)
                                                         / sum(row[n]["draft_propose_seconds"] for row in rounds))
                    q = n[len("draft-"):]
                    if f"alone-{q}" in names:
                        summary[n]["alone_over_target_tokens_per_s"] = statistics.median(
                            row[f"alone-{q}"]["decode_tokens_per_s"] / row["none"]["decode_tokens_per_s"]
                            for row in rounds)
                summary[n].update(predicted(configs[n], k, summary[n]["acceptance_rate"], batch, ctx))
            print(f"{name}: {n:10s} median {summary[n]['median_decode_tokens_per_s']:7.1f} tok/s, "
                  f"speed-up {summary[n]['median_speedup']:.2f}x (rounds {[round(x, 2) for x in ratios]}), "
                  f"predicted {summary[n].get('predicted_speedup')}, same outputs {same}"
                  + (f", draft {summary[n]['draft_cheaper_by']:.1f}x cheaper per token than the target"
                     if "draft_cheaper_by" in summary[n] else ""), flush=True)
        for row in rounds:
            for n in row:
                row[n].pop("outputs")
        results[name] = {"batch": batch, "max_tokens": params.max_tokens, "num_prompts": len(prompts),
                         "rounds": rounds, "summary": summary}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
