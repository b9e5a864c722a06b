"""update_from_output's path for a row's one token as an int (every decode, no drafts) leaves the state its
general path leaves for the same token given as a one-token list: the same outputs, positions, block tables and
prefix-cache state, step after step (chunked prefills, prefix hits and preemptions included)."""

import random

import pytest

from scheduler_harness import Harness


def _run(seed: int, as_list: bool) -> list:
    rng = random.Random(seed)
    h = Harness(num_blocks=12, block_size=4, budget=24, max_seqs=6, max_model_len=64)
    prefix = [rng.randint(0, 3) for _ in range(12)]
    reqs, trace = [], []
    for step in range(120):
        if step < 80 and rng.random() < 0.4:
            tokens = prefix[:rng.randint(0, 12)] + [rng.randint(0, 3) for _ in range(rng.randint(1, 10))]
            reqs.append(h.add(f"r{len(reqs)}", tokens, max_tokens=rng.randint(1, 12)))
        if not h.sched.has_unfinished():
            continue
        out = h.sched.schedule()
        toks = {s.request_id: rng.randint(0, 3) for s in out.scheduled if s.will_sample}
        h.sched.update_from_output(out, {rid: [t] for rid, t in toks.items()} if as_list else toks)
        h.kv.check_invariants()
        for r in reqs:
            if not r.is_finished and r.num_output_tokens >= r.sampling_params.max_tokens:
                h.sched.finish_request(r.request_id, type(r.status).FINISHED_LENGTH)
        trace.append(([(s.request_id, s.num_computed_tokens, s.num_new_tokens, s.block_ids) for s in out.scheduled],
                      [(r.request_id, r.status, r.num_computed_tokens, list(r.all_token_ids)) for r in reqs],
                      h.kv.num_cached_blocks, h.kv.num_evictable_blocks, h.kv.allocator.free_block_ids()))
    return trace, h.sched.num_preemptions, h.kv.prefix_cache_hits


@pytest.mark.parametrize("seed", range(8))
def test_an_int_token_updates_as_a_one_token_list_does(seed):
    assert _run(seed, as_list=False) == _run(seed, as_list=True)


def test_the_runs_compared_preempt_and_hit():
    runs = [_run(seed, as_list=False) for seed in range(8)]
    assert sum(p for _, p, _ in runs) > 0 and sum(h for _, _, h in runs) > 0
