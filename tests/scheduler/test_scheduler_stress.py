"""Randomized stress: add / schedule / run / update / finish / abort with fake sampled tokens.

Besides check_invariants() after every operation, a fake KV store plays the model: each step
writes every scheduled token into its slot (block_ids[pos // S], pos % S), then every scheduled
sequence must find exactly its own tokens in all slots it attends over. That checks prefix-cache
hits, same-step hits, preemption and eviction end to end. At the end every block is free or evictable.
"""

import random

import pytest

from servescope.config import CacheConfig, SamplingParams, SchedulerConfig
from servescope.kvcache.manager import KVCacheManager
from servescope.scheduler.request import Request, RequestStatus
from servescope.scheduler.scheduler import Scheduler


def random_setup(rng):
    bs = rng.choice([1, 2, 4, 8])
    chunked = rng.random() < 0.7
    max_model_len = rng.randint(8, 48)
    budget = rng.randint(bs, 64) if chunked else rng.randint(max(bs, max_model_len), 96)
    cache = CacheConfig(block_size=bs, num_blocks=rng.randint(2, 40), enable_prefix_caching=rng.random() < 0.8)
    sched_cfg = SchedulerConfig(max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=budget,
                                max_model_len=max_model_len, enable_chunked_prefill=chunked, block_size=bs)
    kv = KVCacheManager(cache)
    return kv, Scheduler(sched_cfg, kv), sched_cfg


def check_output(out, kv, cfg):
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert out.total_num_scheduled_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_prefill_tokens + out.num_decode_tokens == out.total_num_scheduled_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    ids = [s.request_id for s in out.scheduled]
    assert len(set(ids)) == len(ids)
    flags = [s.is_prefill for s in out.scheduled]
    assert flags == sorted(flags), "decodes must come before prefills"
    for s in out.scheduled:
        r = s.request
        assert r.status is RequestStatus.RUNNING and s.num_new_tokens > 0
        assert s.num_computed_tokens == r.num_computed_tokens
        assert s.num_computed_tokens + s.num_new_tokens <= r.num_tokens
        assert s.will_sample == (s.num_computed_tokens + s.num_new_tokens == r.num_tokens)
        assert len(s.block_ids) == kv.num_blocks_for(s.num_computed_tokens + s.num_new_tokens)
        assert s.block_ids == kv.get_block_ids(r.request_id)
        if not cfg.enable_chunked_prefill:
            assert s.will_sample


def run_model(out, store, bs):
    """Write each scheduled token's KV, then check every sequence sees only its own tokens."""
    for s in out.scheduled:
        toks = s.request.all_token_ids
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
            store[(s.block_ids[pos // bs], pos % bs)] = toks[pos]
    for s in out.scheduled:
        toks = s.request.all_token_ids
        for pos in range(s.num_computed_tokens + s.num_new_tokens):
            got = store.get((s.block_ids[pos // bs], pos % bs))
            assert got == toks[pos], f"{s.request_id} reads {got} at position {pos}, expected {toks[pos]}"


def drive(seed, steps=150):
    rng = random.Random(seed)
    kv, sched, cfg = random_setup(rng)
    bs = kv.block_size
    store = {}
    live = {}
    n_added = 0
    prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(1, 20))] for _ in range(3)]

    def add():
        nonlocal n_added
        if rng.random() < 0.5:
            prompt = list(rng.choice(prefixes))[: rng.randint(1, 20)]
        else:
            prompt = []
        prompt += [rng.randint(0, 3) for _ in range(rng.randint(0 if prompt else 1, 12))]
        if rng.random() < 0.05:
            prompt = [1] * rng.randint(cfg.max_model_len - 1, cfg.max_model_len + 3)  # maybe too long
        rid = f"r{n_added}"
        n_added += 1
        req = Request(rid, prompt, SamplingParams(max_tokens=rng.randint(1, 12)), arrival_time=float(n_added),
                      priority=rng.choice([0, 0, 0, 1, 2]))
        sched.add_request(req)
        if not req.is_finished:
            live[rid] = req

    for step in range(steps):
        adding = step < steps * 2 // 3
        for _ in range(rng.choice([0, 0, 1, 1, 2]) if adding else 0):
            add()
            kv.check_invariants()
        if not sched.has_unfinished():
            if adding:
                continue
            break
        out = sched.schedule()
        kv.check_invariants()
        check_output(out, kv, cfg)
        for r in out.finished_requests:
            assert r.status is RequestStatus.FINISHED_ERROR and r.error
            live.pop(r.request_id, None)
        run_model(out, store, bs)
        sampled = {s.request_id: rng.randint(0, 3) for s in out.scheduled if s.will_sample}
        sched.update_from_output(out, sampled)
        kv.check_invariants()
        # the engine's part: stop conditions, random aborts
        for rid, req in list(live.items()):
            if req.is_finished:
                live.pop(rid)
                continue
            if req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= cfg.max_model_len:
                sched.finish_request(rid, RequestStatus.FINISHED_LENGTH)
            elif rng.random() < 0.03:
                sched.finish_request(rid, rng.choice([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]))
            elif req.status is RequestStatus.RUNNING and not cfg.enable_chunked_prefill and rng.random() < 0.02:
                sched.discard_kv(rid)  # the no-KV baseline, exercised where a whole sequence fits a step
                kv.check_invariants()
                continue
            else:
                continue
            live.pop(rid)
            kv.check_invariants()
        if rng.random() < 0.01:
            kv.reset_prefix_cache()
            kv.check_invariants()

    # no hang: with no new arrivals everything drains (each request has bounded output)
    assert not sched.has_unfinished(), f"seed {seed}: {sched.num_running} running, {sched.num_waiting} waiting"
    assert not live
    kv.check_invariants()
    assert kv.num_used_blocks == 0
    assert kv.allocator.num_free + kv.num_evictable_blocks == kv.num_blocks
    assert kv.num_cached_blocks == kv.num_evictable_blocks
    return sched.num_preemptions, kv.prefix_cache_hits


@pytest.mark.parametrize("seed", range(60))
def test_random_stress(seed):
    drive(seed, steps=400)


def test_stress_exercises_preemption_and_hits():
    totals = [drive(seed, steps=400) for seed in range(100, 130)]
    assert sum(p for p, _ in totals) > 0
    assert sum(h for _, h in totals) > 0
