"""Run one workload through an engine and keep every step's logits (rank 0's), to compare a parallel
engine with a single process step by step."""

from __future__ import annotations

from servescope import LLM, SamplingParams

# batching (4 prompts at once), chunked prefill (a 100-token prompt over a 32-token budget), then a
# second round whose prompts share the first round's full blocks (prefix-cache hits); the KV cache is
# small enough that decodes preempt.
ROUND_1 = [[5, 6, 7, 8, 9] * 7, [100, 200, 300], list(range(1000, 1100)), [7] * 20]
ROUND_2 = [ROUND_1[2][:64] + [11, 12], ROUND_1[0] + [13], [4, 4, 4]]  # 4 and 2 full blocks seen before
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# one block table for all layers in both engines unless a test asks for a table per group (kv_sizing.kv_group_blocks:
# a pipeline stage cannot lend its windowed layers' saved bytes to another stage's full layers, so its pools may
# differ from one process's); the workload's scheduling (preemptions, hits) must be the same for the steps to compare
ENGINE = dict(num_kv_blocks=12, max_model_len=144, max_num_seqs=4, max_num_batched_tokens=32, num_threads=1,
              disable_hybrid_kv_cache_manager=True)


def record_logits(llm: LLM) -> list:
    """The logits every step returns, appended to the list this returns (a wrapper on the runner)."""
    runner, seen = llm.engine.runner, []
    inner = runner.execute

    def execute(scheduled, rows=None, *more):
        out = inner(scheduled, rows, *more)
        seen.append(out.detach().clone())
        return out

    runner.execute = execute
    return seen


def run_workload(llm: LLM) -> tuple:
    """(token ids of every request, the logits of every step, the engine's KV/scheduler counters)."""
    logits = record_logits(llm)
    outs = llm.generate(ROUND_1, PARAMS) + llm.generate(ROUND_2, PARAMS)
    engine = llm.engine
    stats = dict(preemptions=engine.scheduler.num_preemptions, prefix_hits=engine.kv_manager.prefix_cache_hits,
                 max_prefill=max(r.num_prefill_tokens for r in engine.step_records),
                 mixed=any(r.phase == "mixed" for r in engine.step_records))
    return [o.outputs[0].token_ids for o in outs], logits, stats


def max_logit_diff(a: list, b: list) -> float:
    assert len(a) == len(b), f"{len(a)} steps against {len(b)}"
    return max((x - y).abs().max().item() for x, y in zip(a, b) if x.numel())


def assert_same_as_single_process(path: str, common: dict | None = None, logit_tol: float = 1e-4,
                                  on_engine=None, **parallel) -> list:
    """The parallel engine's greedy tokens equal one process's, its logits within logit_tol (1e-4) at every
    step, and within 1e-4 at nine steps in ten whatever logit_tol is (common: settings of both engines;
    on_engine(llm): called on each engine, the single process's first, before the workload).
    Returns the parallel engine's StepRecords."""
    kw = {**ENGINE, **(common or {})}
    one = LLM(model=path, **kw)
    if on_engine is not None:
        on_engine(one)
    ref_tokens, ref_logits, ref_stats = run_workload(one)
    llm = LLM(model=path, **kw, **parallel)
    try:
        if on_engine is not None:
            on_engine(llm)
        tokens, logits, stats = run_workload(llm)
    finally:
        llm.engine.shutdown(keep_workers=True)  # the next case loads its weights into the same processes
    assert tokens == ref_tokens
    diff = max_logit_diff(logits, ref_logits)
    assert diff <= logit_tol, f"max |logit diff| {diff:.2e}"
    steps = [(x - y).abs().max().item() for x, y in zip(logits, ref_logits) if x.numel()]
    assert sum(d <= 1e-4 for d in steps) >= 0.9 * len(steps), f"steps over 1e-4: {sorted(steps)[-5:]}"
    assert stats == ref_stats
    # the workload exercised what it is meant to: preemption, prefix caching, chunks, mixed steps
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0 and stats["mixed"]
    assert stats["max_prefill"] == ENGINE["max_num_batched_tokens"]
    # each step's record splits rank 0's time: collectives (the plan broadcast at least) and the rest
    recs = [r for r in llm.engine.step_records if r.num_tokens]
    assert all(r.comm_bytes > 0 and 0 < r.comm_seconds <= r.wall_seconds for r in recs)
    assert all(r.compute_seconds == r.wall_seconds - r.comm_seconds for r in recs)
    return recs
