"""Grammar masks: per-token mask time of xgrammar vs llguidance on this CPU, and what masking costs
in the engine's decode steps (TPOT) at batch 1 and 16, in the same run.

    PYTHONPATH=src python benchmarks/grammar_mask.py [--rounds 2] [--json benchmarks/results/grammar_mask.json]

Part 1 walks the same valid JSON output (tokenized by SmolLM2's tokenizer) through each engine's
matcher for a JSON schema and times filling the next-token bitmask before every token (median and
p90 over tokens and repeats). Part 2 runs the embedded model (float32) greedy on B prompts, with and
without a JSON-schema constraint, interleaved, and reads the decode steps' StepRecords: the mask's
share of each step (grammar_mask_seconds / wall_seconds), the median mask time over the plain run's
median step (the TPOT it would add), and the ratio of median step times (the noisiest of the three
on a shared machine: it moves with whatever else runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
SAMPLE = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
          "address": {"city": "London", "zip": "12345"}}


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def mask_times(hf_tok, vocab: int, eos: list, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr

    text = json.dumps(SAMPLE, separators=(", ", ": "))
    ids = hf_tok.encode(text, add_special_tokens=False) + [eos[0]]
    out = {"tokens": len(ids)}
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=eos)
    t0 = time.perf_counter()
    cg = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    bm = xgr.allocate_token_bitmask(1, vocab)
    xs = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(cg)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            xs.append(time.perf_counter() - t0)
            assert m.accept_token(t), "xgrammar rejected the sample"
    out["xgrammar"] = {"compile_s": compile_s, "median_us": statistics.median(xs) * 1e6, "p90_us": _pct(xs, 0.9) * 1e6}

    lt = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos[0])
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA),
        defaults={"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "})
    m = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - t0
    bm = llguidance.torch.allocate_token_bitmask(1, vocab)
    xs = []
    for _ in range(repeats):
        m = llguidance.LLMatcher(lt, grammar)
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, bm, 0)
            xs.append(time.perf_counter() - t0)
            assert m.consume_token(t), f"llguidance rejected the sample: {m.get_error()}"
    out["llguidance"] = {"compile_s": compile_s, "median_us": statistics.median(xs) * 1e6,
                         "p90_us": _pct(xs, 0.9) * 1e6}
    return out


def engine_cost(llm, batch: int, rounds: int) -> dict:
    from servescope import SamplingParams
    from servescope.config import StructuredOutput

    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Person {i} as JSON: {SCHEMA}"}]),
                          add_special_tokens=False) for i in range(batch)]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=24, ignore_eos=False,
                                 structured=StructuredOutput("json", json.dumps(SCHEMA)))
    steps = {"plain": [], "grammar": []}
    shares, masks = [], []
    for _ in range(rounds):
        for name, sp in (("plain", plain), ("grammar", constrained)):
            llm.engine.step_records.clear()
            llm.generate(prompts, sp)
            for r in llm.engine.step_records:
                if r.num_prefill_tokens == 0 and r.num_decode_seqs == batch:
                    steps[name].append(r.wall_seconds)
                    if name == "grammar":
                        shares.append(r.grammar_mask_seconds / r.wall_seconds)
                        masks.append(r.grammar_mask_seconds)
    med = {k: statistics.median(v) for k, v in steps.items()}
    return {"batch": batch, "decode_steps": {k: len(v) for k, v in steps.items()},
            "median_step_ms": {k: v * 1e3 for k, v in med.items()},
            "tpot_ratio_grammar_over_plain": med["grammar"] / med["plain"],
            "median_mask_ms": statistics.median(masks) * 1e3,
            "mask_over_plain_step": statistics.median(masks) / med["plain"],
            "mask_share_of_step_median": statistics.median(shares), "mask_share_of_step_p90": _pct(shares, 0.9)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from servescope import LLM

    llm = LLM(num_kv_blocks=512, max_model_len=1024, max_num_seqs=32)
    eos = sorted(llm.engine.eos_token_ids)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": _cpu(),
           "python": platform.python_version(), "torch": torch.__version__,
           "mask": mask_times(llm.tokenizer.hf, llm.engine.model_config.vocab_size, eos, args.repeats),
           "engine": [engine_cost(llm, b, args.rounds) for b in (1, 16)]}
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - the record says unknown rather than fail the run
        return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
