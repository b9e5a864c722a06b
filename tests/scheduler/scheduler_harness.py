"""Helpers for scheduler tests (a uniquely named module, not conftest, so imports never clash): a scheduler
over a small cache, requests of plain integer tokens."""

import itertools

from servescope.config import CacheConfig, SamplingParams, SchedulerConfig
from servescope.kvcache.manager import KVCacheManager
from servescope.scheduler.request import Request
from servescope.scheduler.scheduler import Scheduler


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Harness:
    def __init__(self, num_blocks=16, block_size=4, budget=64, max_seqs=8, max_model_len=64,
                 chunked=True, caching=True):
        self.kv = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                             enable_prefix_caching=caching))
        self.clock = FakeClock()
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                            enable_chunked_prefill=chunked, block_size=block_size),
            self.kv, clock=self.clock)
        self._arrival = itertools.count()
        self._tok = itertools.count(1000)

    def add(self, rid, tokens, priority=0, max_tokens=16):
        k = next(self._arrival)
        if isinstance(tokens, int):  # distinct tokens per request: no accidental prefix hits
            tokens = list(range(100_000 * (k + 1), 100_000 * (k + 1) + tokens))
        req = Request(rid, tokens, SamplingParams(max_tokens=max_tokens), arrival_time=float(k),
                      priority=priority)
        self.sched.add_request(req)
        self.kv.check_invariants()
        return req

    def step(self, sampled=None):
        out = self.sched.schedule()
        self.kv.check_invariants()
        if sampled is None:
            sampled = {s.request_id: next(self._tok) for s in out.scheduled if s.will_sample}
        self.sched.update_from_output(out, sampled)
        self.kv.check_invariants()
        return out

    def blocks(self, rid):
        return self.kv.get_block_ids(rid)

    def refs(self, blocks):
        return [self.kv.allocator.ref_count(b) for b in blocks]


def seqs(out):
    """(request id, num_computed_tokens, num_new_tokens) of each scheduled sequence, in output order."""
    return [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
