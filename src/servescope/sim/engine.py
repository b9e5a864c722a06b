"""SimEngine: the engine's own Scheduler and KVCacheManager, stepped on a virtual clock.

The loop is LLMEngine.step's without the model: Scheduler.schedule() chooses the step's tokens (the
same code the engine runs: continuous batching, chunked prefill, prefix caching, preemption, draft
verification), the step takes the time the cost model predicts for it (sim/step_time.py), every
request whose next token is due gets one (plus its accepted drafts), Scheduler.update_from_output
advances the KV positions, and a request that reached max_tokens (or the context) is finished through
Scheduler.finish_request, which frees its blocks, as the OutputProcessor does. Requests added while a
step runs join the next schedule(), as the engine thread takes them between steps.

Token ids: prompts are whatever the workload gives (shared prefixes hit the prefix cache as they
would in the engine); each request's outputs are a fixed pseudo-random stream of its own, so that its
output blocks hash like any other request's (and never collide with another's). Speculative decoding:
each decode is given k drafts (its stream's next k tokens); each is accepted with the spec's
acceptance rate until the first rejection, and the verification's own token comes after them.
"""

from __future__ import annotations

import random
import zlib
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from servescope.config import CacheConfig, SamplingParams
from servescope.analysis.kv_layout import layers_per_window
from servescope.kvcache.hybrid import HybridKVCacheManager
from servescope.kvcache.manager import KVCacheManager
from servescope.kvcache.prefix_cache import extend_fast_hashes, hash_full_blocks
from servescope.scheduler.request import Request, RequestStatus
from servescope.scheduler.scheduler import Scheduler
from servescope.sim.fast_forward import DecodeRun
from servescope.sim.spec import InstanceSpec
from servescope.sim.step_time import StepTimer
from servescope.telemetry.request_metrics import RequestMetrics
from servescope.telemetry.step_record import StepRecord, kv_bytes_used

_STREAM_MUL = 2654435761  # Knuth's multiplicative hash: a request's output stream, position by position


@dataclass
class Finished:
    """A request the engine is done with: its metrics (engine times), or the error that refused it."""

    request_id: str
    metrics: RequestMetrics
    error: Optional[str] = None


class SimEngine:
    """One engine instance on a virtual clock (seconds from 0). keep_steps: keep a StepRecord per step
    (for traces; a cluster hour leaves it off). timer: a StepTimer of `spec` to share. fast_forward: advance()
    plans stretches of steps that only decode instead of running them (sim/fast_forward.py; step() never does)."""

    def __init__(self, spec: InstanceSpec, name: str = "engine", keep_steps: bool = True, seed: int = 0,
                 timer: Optional[StepTimer] = None, fast_forward: bool = True):
        self.spec, self.name, self.fast_forward = spec, name, fast_forward
        self._run: Optional[DecodeRun] = None  # the planned stretch, not yet applied (commit)
        self.decode_layout: Optional[tuple] = None  # fast_forward._layout's, computed at the first stretch
        self.clock = 0.0  # virtual seconds
        # blocks hashed by the tuple-hash chain: the simulator's caches meet no engine's, and it hashes every
        # prompt and output block of a workload (prefix_cache.extend_fast_hashes)
        # a hybrid's table per group of layers, its pools as the engine's stages size them (InstanceSpec.group_blocks)
        cache = CacheConfig(block_size=spec.block_size, num_blocks=spec.num_blocks,
                            enable_prefix_caching=spec.enable_prefix_caching)
        self.kv_manager = (KVCacheManager(cache, extend_hashes=extend_fast_hashes) if spec.group_blocks is None else
                           HybridKVCacheManager(cache, spec.group_blocks, layers_per_window(spec.model),
                                                spec.max_step_tokens, extend_hashes=extend_fast_hashes))
        self.scheduler = Scheduler(spec.scheduler, self.kv_manager, clock=self.now)  # a bound method: pickles
        self.timer = timer or StepTimer(spec)  # replicas of one spec share one (and its memo)
        self.steps: Optional[list] = [] if keep_steps else None
        self.num_steps = 0
        self.busy_seconds = 0.0  # virtual time spent in steps
        self.outstanding_tokens = 0  # prompt tokens not yet computed + output tokens not yet produced
        # what the steps did, for utilisation and for what binds: tokens and sequences scheduled, seconds
        # of compute- and memory-bound steps, the fullest the KV cache got
        self.tokens_scheduled = self.seqs_scheduled = 0
        self.bound_seconds = {"compute": 0.0, "memory": 0.0}
        self.peak_kv_usage = 0.0
        # request id -> (Request, RequestMetrics, max_tokens, stream seed, its max_tokens stream tokens)
        self._live: dict[str, tuple] = {}
        self._rng = random.Random(seed)
        self._vocab = spec.model.vocab_size
        self._max_model_len = spec.scheduler.max_model_len
        self._params = SamplingParams(temperature=0.0, ignore_eos=True)

    # ---------------------------------------------------------------- requests
    def has_unfinished(self) -> bool:
        return bool(self._live) or self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
                    arrival_time: float, prepared: Optional[tuple] = None) -> Optional[Finished]:
        """Queue a request (arrival_time: the virtual time it was sent). A request the engine would refuse
        (LLMEngine._check_fits: it cannot fit the context) comes back at once as a Finished with its error.
        prepared: prepare()'s result for this request, computed ahead (either part may be None: computed here)."""
        self.settle()
        # token times as float64s in an array (8 bytes a token, no object per token: a cluster hour holds ~46M)
        metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids),
                                 token_times=array("d"))
        max_len = self.spec.scheduler.max_model_len
        if not prompt_token_ids or len(prompt_token_ids) + max_tokens > max_len:
            return Finished(request_id, metrics, f"{len(prompt_token_ids)} prompt tokens + max_tokens {max_tokens} "
                                                 f"do not fit this model's context of {max_len} tokens")
        req = Request(request_id, prompt_token_ids, self._params, arrival_time=arrival_time)
        seed = zlib.crc32(request_id.encode())
        hashes, stream = prepared if prepared is not None else (None, None)
        if stream is None:
            stream = self.stream(seed, 0, max_tokens)
        if hashes is not None:
            self.kv_manager.set_block_hashes(request_id, hashes)
        self._live[request_id] = (req, metrics, max_tokens, seed, stream)
        self.outstanding_tokens += len(prompt_token_ids) + max_tokens
        self.scheduler.add_request(req)
        return None

    def prepare(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int) -> tuple:
        """What add_request computes from the request alone, for add_request(prepared=) later: the hashes of the
        prompt's full blocks under the requests' cache salt (None without prefix caching), its output stream.
        The same on every replica of this spec (sim/parallel.py computes it while a process would wait)."""
        kv = self.kv_manager
        hashes = hash_full_blocks(prompt_token_ids, kv.block_size, salt=self._params.cache_salt,
                                  extend=kv.extend_hashes) if kv.enable_prefix_caching else None
        return hashes, self.stream(zlib.crc32(request_id.encode()), 0, max_tokens)

    # the driver's view (sim/driver.Served)
    def now(self) -> float:
        return self.clock

    def wait_until(self, t: float) -> None:
        """Idle until virtual time t (nothing runs in between)."""
        self.settle()
        self.clock = max(self.clock, t)

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int, arrival_time: float):
        return self.add_request(request_id, prompt, max_tokens, arrival_time)

    def _token(self, seed: int, position: int) -> int:
        return (seed + position * _STREAM_MUL) % self._vocab

    def stream(self, seed: int, start: int, stop: int) -> list:
        """The output tokens at positions [start, stop) of the stream `seed` (_token of each, the same integers:
        below 2**63 for any position a context holds)."""
        return ((np.arange(start, stop, dtype=np.int64) * _STREAM_MUL + seed) % self._vocab).tolist()

    # ---------------------------------------------------------------- the step
    def step(self) -> list:
        """One step: schedule, advance the clock by its predicted time, hand out tokens, finish what is
        done. Returns the requests finished by it (Finished)."""
        if self._run is not None:
            self.settle()
        out = self.scheduler.schedule()
        done = [self._refused(r) for r in out.finished_requests]
        if not out.scheduled:
            if not done and self.has_unfinished():  # the scheduler's invariant: something always runs
                raise RuntimeError(f"{self.name}: {self.num_unfinished} requests wait and nothing can be scheduled")
            return done
        seconds, pred, bound = self.timer.step_seconds(out)
        t0 = self.clock
        self.clock = t1 = t0 + seconds
        self.busy_seconds += seconds
        self.tokens_scheduled += out.total_num_scheduled_tokens
        self.seqs_scheduled += len(out.scheduled)
        self.bound_seconds[bound] += seconds
        self.peak_kv_usage = max(self.peak_kv_usage, self.kv_manager.usage)
        sampled, due, accepted, drafted = self._sample(out)
        self.scheduler.update_from_output(out, sampled)
        self._deliver_all(due, t1, done)
        if self.spec.spec_decode.k:
            self._propose()
        self.num_steps += 1
        if self.steps is not None:
            sched = out.scheduled
            npf = sum(1 for s in sched if s.is_prefill)
            self._record_step(pred, t0, seconds, npf, len(sched) - npf, out.num_prefill_tokens, out.num_decode_tokens,
                              [s.num_computed_tokens + s.num_new_tokens for s in sched],
                              sum(1 for s in sched if s.spec_token_ids), drafted, accepted)
        return done

    # ---------------------------------------------------------------- fast-forward (sim/fast_forward.py)
    def advance(self, t: float) -> list:
        """Run every step that starts before virtual time t (the requests they finish, Finished); with
        fast_forward the steps of a stretch that only decodes are planned, and applied by commit() when
        something needs the state (a request added, a step that is not such a step, the end)."""
        done: list = []
        while True:
            run = self._run
            if run is not None:
                run.extend_to(t)
                if not run.blocked:
                    return done  # planned through t
                planned = run.steps
                done.extend(self.commit())
                if planned:
                    continue  # a new stretch may follow at once
                if self.clock >= t:
                    return done
                done.extend(self.step())  # the step that cannot be in a stretch
                continue
            if self.clock >= t or not self.has_unfinished():
                return done
            if self.fast_forward:
                self._run = DecodeRun.start(self)
                if self._run is not None:
                    continue
            done.extend(self.step())

    def commit(self) -> list:
        """Apply the planned steps of the stretch, if any; the requests its last step finished (Finished)."""
        run, self._run = self._run, None
        return [] if run is None else run.commit()

    def settle(self) -> None:
        """commit() before the state is read or changed. A stretch's finishing step is applied in advance(), which
        planned it: none is pending here."""
        if self._run is not None and self.commit():
            raise RuntimeError(f"{self.name}: requests finished outside advance()")

    def next_start(self) -> float:
        """When the next step that is not planned starts: the clock after the planned steps."""
        return self.clock if self._run is None else self._run.clock

    def planned_steps(self) -> int:
        """Steps planned and not yet applied (commit)."""
        return 0 if self._run is None else self._run.steps

    def steps_taken(self) -> int:
        """Steps run or planned."""
        return self.num_steps + (0 if self._run is None else self._run.steps)

    def load(self) -> int:
        """Outstanding tokens after the planned steps (each takes one token of every request in it)."""
        run = self._run
        return self.outstanding_tokens - (0 if run is None else len(run.rows) * run.steps)

    def _sample(self, out) -> tuple:
        """({request id: its tokens this step}, the live entries of those requests, accepted, drafted) for
        every sequence whose next token is due; drafts accepted one by one with the spec's probability until
        the first rejection, then the target's token."""
        sampled, due, accepted, drafted = {}, [], 0, 0
        p = self.spec.spec_decode.acceptance
        live, vocab = self._live, self._vocab
        for s in out.scheduled:
            if not s.will_sample:
                continue
            req = s.request
            rid = req.request_id
            entry = live[rid]
            due.append(entry)
            seed = entry[3]
            n = len(req.output_token_ids)
            if not s.spec_token_ids:
                sampled[rid] = (seed + n * _STREAM_MUL) % vocab  # self._token(seed, n), inlined: once a row a step
            else:
                k = len(s.spec_token_ids)
                a = 0
                while a < k and self._rng.random() < p:
                    a += 1
                drafted += k
                accepted += a
                sampled[rid] = list(s.spec_token_ids[:a]) + [self._token(seed, n + a)]
        return sampled, due, accepted, drafted

    def _deliver_all(self, due: list, now: float, done: list) -> None:
        """_deliver each entry, appending what finishes to `done`. Its commonest case inline (one new token
        that finishes nothing: once a row a step, where a call per row is a tenth of the simulator's time);
        the others through _deliver."""
        max_len = self._max_model_len
        outstanding = self.outstanding_tokens
        for entry in due:
            req, metrics, max_tokens, _, _ = entry
            times = metrics.token_times
            n_out = len(req.output_token_ids)
            if n_out == len(times) + 1 and n_out < max_tokens and req.num_tokens < max_len:
                times.append(now)
                outstanding -= 1 if n_out > 1 else 1 + req.num_prompt_tokens
                continue
            self.outstanding_tokens = outstanding
            finished = self._deliver(entry, now)
            outstanding = self.outstanding_tokens
            if finished is not None:
                done.append(finished)
        self.outstanding_tokens = outstanding

    def _deliver(self, entry: tuple, now: float) -> Optional[Finished]:
        """Stamp the tokens (the OutputProcessor's RequestMetrics) and finish the request at max_tokens or
        the context length (stops are never hit: the workload's outputs ignore EOS, as bench serve's do).
        entry: the request's live entry (Request, RequestMetrics, max_tokens, stream seed, stream)."""
        req, metrics, max_tokens, _, _ = entry
        times = metrics.token_times
        before = len(times)
        n_out = min(len(req.output_token_ids), max_tokens)
        if n_out == before + 1:
            times.append(now)
        else:
            times.extend([now] * (n_out - before))
        # outstanding: the prompt until its first token, then the outputs still to come
        self.outstanding_tokens -= n_out - before + (req.num_prompt_tokens if before == 0 < n_out else 0)
        if n_out < max_tokens and req.num_tokens < self._max_model_len:
            return None
        if req.num_output_tokens > n_out:
            req.truncate_output(n_out)  # accepted drafts past max_tokens are dropped, as the engine's
        return self.finish(entry, now)

    def finish(self, entry: tuple, now: float) -> Finished:
        """A request that got its last token: finished by the scheduler (its blocks freed), its metrics closed."""
        rid = entry[0].request_id
        self.scheduler.finish_request(rid, RequestStatus.FINISHED_LENGTH)
        return self._close(rid, now)

    def _close(self, rid: str, now: float, error: Optional[str] = None) -> Finished:
        req, metrics, max_tokens, _, _ = self._live.pop(rid)
        metrics.finished_time = now
        metrics.first_scheduled_time = req.first_scheduled_time
        metrics.num_cached_tokens = max(req.num_cached_tokens, 0)
        metrics.num_preemptions = req.num_preemptions
        produced = len(metrics.token_times)
        self.outstanding_tokens -= max_tokens - produced + (req.num_prompt_tokens if produced == 0 else 0)
        return Finished(rid, metrics, error)

    def _refused(self, req: Request) -> Finished:
        return self._close(req.request_id, self.clock, req.error or "refused by the scheduler")

    def _propose(self) -> None:
        """Drafts for the next step: each running decode's next k stream tokens (spec/ proposers set
        Request.spec_token_ids the same way; the scheduler cuts them to its budget)."""
        k = self.spec.spec_decode.k
        for req in self.scheduler.running_requests():
            if req.num_computed_tokens == req.num_tokens - 1:
                seed, n = self._live[req.request_id][3], req.num_output_tokens
                req.spec_token_ids = [self._token(seed, n + j) for j in range(k)]

    def utilisation(self, duration: float) -> dict:
        """What the run asked of this instance: busy share, mean tokens and sequences per step against the
        limits, compute- vs memory-bound time, the fullest KV cache, preemptions, prefix-cache hits."""
        self.settle()
        n, sc = max(self.num_steps, 1), self.spec.scheduler
        return {"name": self.name, "busy": self.busy_seconds / duration if duration > 0 else 0.0,
                "steps": self.num_steps, "token_budget_used": self.tokens_scheduled / n / sc.max_num_batched_tokens,
                "seqs_used": self.seqs_scheduled / n / sc.max_num_seqs,
                "compute_bound_share": self.bound_seconds["compute"] / max(self.busy_seconds, 1e-12),
                "peak_kv_usage": self.peak_kv_usage, "preemptions": self.scheduler.num_preemptions,
                "prefix_hit_rate": self.kv_manager.prefix_cache_hit_rate}

    # ---------------------------------------------------------------- telemetry
    def _record_step(self, pred, t0: float, seconds: float, npf: int, ndec: int, prefill_tokens: int,
                     decode_tokens: int, context_lens: list, num_spec: int, drafted: int, accepted: int) -> None:
        km, sched = self.kv_manager, self.scheduler
        cost = pred.cost
        self.steps.append(StepRecord(
            step=self.num_steps, start_time=t0, wall_seconds=seconds, num_prefill_seqs=npf,
            num_decode_seqs=ndec, num_prefill_tokens=prefill_tokens, num_decode_tokens=decode_tokens,
            context_lens=context_lens,
            kv_blocks_used=km.num_used_blocks, kv_blocks_free=km.num_free_blocks,
            kv_blocks_cached=km.num_cached_blocks, kv_usage=km.usage, num_running=sched.num_running,
            num_waiting=sched.num_waiting, num_preemptions_total=sched.num_preemptions,
            num_spec_seqs=num_spec, num_draft_tokens=drafted,
            num_accepted_tokens=accepted, kv_bytes_used=kv_bytes_used(km, self.spec.kv_bytes_per_token),
            predicted_seconds=pred.seconds, flops=cost.flops, bytes=cost.bytes,
            flops_by_group={o.name: o.flops for o in cost.ops}, bytes_by_group={o.name: o.bytes for o in cost.ops},
            bound=cost.bound, hardware=self.spec.hardware.name,
            # a simulated step's "measured" time is its predicted time plus the batch's host work: the
            # collectives' share is the prediction's own
            comm_seconds=pred.comm_seconds or 0.0, predicted_comm_seconds=pred.comm_seconds))
