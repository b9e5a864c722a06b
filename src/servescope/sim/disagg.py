"""Prefill/decode disaggregation: P prefill instances and D decode instances, the KV sent between them.

A request goes to the prefill instance with the fewest outstanding tokens and runs there for one token (which
is dropped, as vLLM's disaggregation proxy drops it). The KV of the prompt's full blocks that a prefix hit can
use ((prompt - 1) // block_size of them) then crosses the link: kv_cache_bytes_per_token x their tokens, each
of the instance's T x P ranks sending its share over its own port at once (bytes / ranks / bandwidth + the
link's latency; between two local engine processes the link is the measured KV send path, measure/kv_send.py:
gather, header, gloo send/recv, scatter). When it lands, the decode instance with the fewest outstanding
tokens receives it: the KV goes into that instance's cache as full blocks findable by their hashes (the
engine's prefix cache: KVCacheManager.allocate_slots hashes them, free() leaves them cached and evictable),
and the request (its prompt and max_tokens) is added to its scheduler, which admits it with those blocks as a
prefix hit and computes only the prompt's last partial block, sampling the first token there (TTFT = queueing
+ prefill + transfer + that step). This is what engine/disaggregated.py runs for real. If the decode
instance's cache cannot take the blocks, the request recomputes its prompt there (counted).

Where requests come in (`front`): through a proxy of their own (vLLM's), at once; or, in servescope's own 1P1D
(engine/disaggregated.py: the default for the measured local link), through the decode engine's process: a
request goes to the prefill instance when the decode engine's running step ends (its engine thread takes
requests between steps); a finished prefill's KV starts across at once (the decode process's receiver thread
runs beside the step: the C++ kernels run without the interpreter lock).
"""

from __future__ import annotations

import heapq
import os
from typing import Optional, Sequence

from servescope.analysis.kv_layout import handed_over_bytes
from servescope.analysis.probe import cpu_model
from servescope.analysis.collectives import LOCAL_GLOO, LinkSpec, cached_local_link, get_link, kv_send_key
from servescope.config import SamplingParams
from servescope.errors import InvalidParameterError
from servescope.kvcache.prefix_cache import max_hit_blocks
from servescope.scheduler.request import Request
from servescope.sim.engine import Finished, SimEngine
from servescope.sim.step_time import StepTimer
from servescope.sim.spec import InstanceSpec

DEFAULT_KV_LINK = {"gpu": "ib-ndr400"}  # prefill and decode instances on different nodes
FRONTS = ("decode", "proxy")  # where requests come in (Disaggregated's front)


def kv_link_for(spec: InstanceSpec, name: "str | LinkSpec | None") -> LinkSpec:
    """The link a finished prefill's KV crosses: named, the network between GPU nodes, or the measured KV
    send path between two engine processes of this machine (measure/local_hardware.local_kv_link)."""
    if isinstance(name, LinkSpec):
        return name
    if name is None:
        name = DEFAULT_KV_LINK.get(spec.hardware.kind, LOCAL_GLOO)
    if name == LOCAL_GLOO:
        link = cached_local_link(kv_send_key(f"{cpu_model()} / {os.cpu_count()} cores"))  # measure's key
        if link is None:
            raise InvalidParameterError("kv_link", "the local KV send path is not measured (`servescope simulate` "
                                                   "on local-cpu measures it), or name a link with --kv-link")
        return link
    return get_link(name)


def inject_kv(engine: SimEngine, request_id: str, tokens: Sequence[int]) -> bool:
    """Put the KV of `tokens`' full blocks into the engine's cache as cached, evictable blocks (what a
    transfer writes); False (nothing changed) when the cache has no room."""
    km = engine.kv_manager
    holder = Request(f"{request_id}/kv-in", tokens, SamplingParams(), arrival_time=engine.clock)
    if not km.allocate_slots(holder, len(tokens)):
        return False
    holder.num_computed_tokens = len(tokens)  # written: free() keeps the hashed blocks findable
    km.free(holder)
    return True


class Disaggregated:
    """P prefill + D decode instances of `spec` (sim/driver.Served)."""

    def __init__(self, spec: InstanceSpec, prefill: int, decode: int, kv_link: "str | LinkSpec | None" = None,
                 keep_steps: bool = True, seed: int = 0, front: Optional[str] = None):
        if prefill < 1 or decode < 1:
            raise InvalidParameterError("disaggregation", "needs at least one prefill and one decode instance")
        if front not in (None,) + FRONTS:
            raise InvalidParameterError("front", f"front must be one of {', '.join(FRONTS)}, got {front!r}")
        if not spec.enable_prefix_caching:
            raise InvalidParameterError("disaggregation", "the decode instances take the transferred KV as cached "
                                                          "blocks: prefix caching must be on")
        self.spec = spec
        self.link = kv_link_for(spec, kv_link)
        # where requests come in: servescope's own 1P1D between local processes takes them in its decode engine's
        # step loop (engine/disaggregated.py), anything else through a proxy of its own (vLLM's)
        self.front = front or ("decode" if self.link.name == LOCAL_GLOO else "proxy")
        timer = StepTimer(spec)  # one memo for every instance of the spec
        self.prefill = [SimEngine(spec, f"prefill-{i}", keep_steps, seed + i, timer) for i in range(prefill)]
        self.decode = [SimEngine(spec, f"decode-{i}", keep_steps, seed + prefill + i, timer) for i in range(decode)]
        self.engines = self.prefill + self.decode
        self._time = 0.0
        self._events: list = []  # heap of (time, request id, "dispatch" | "land")
        self._origin: dict = {}  # request id -> (prompt, max_tokens, prefill Finished or None)
        self._home: dict = {}
        self.transfer_seconds = 0.0
        self.recomputed = 0
        # request id -> {stage: time} of its hand-over, the stages engine/disaggregated.py records for real:
        # dispatched (sent to a prefill instance), scheduled / prefilled (its first step / its token), receiving /
        # landed (the KV on its way / received), decode_scheduled / first_token (the decode instance's first step
        # / its first token)
        self.timelines: dict = {}

    @property
    def num_devices(self) -> int:
        return len(self.engines) * self.spec.num_devices

    def describe(self) -> str:
        one = f"TP={self.spec.tp} x PP={self.spec.pp} on {self.spec.hardware.name}"
        return (f"{len(self.prefill)} prefill + {len(self.decode)} decode instances of {one} "
                f"({self.num_devices} devices), KV over {self.link.name}")

    def served_by(self, instance: int) -> set:
        return {rid for rid, homes in self._home.items() if instance in homes}

    def sent_tokens(self, prompt_len: int) -> int:
        """Tokens whose KV is sent: the prompt's full blocks a prefix hit can use."""
        return max_hit_blocks(prompt_len, self.spec.block_size) * self.spec.block_size

    def transfer_time(self, num_tokens: int) -> float:
        """The hand-over of num_tokens (whole blocks): a hybrid model's windowed layers send their view only."""
        ranks = self.spec.tp * self.spec.pp
        sent = handed_over_bytes(self.spec.model, self.spec.dtypes[1], num_tokens, self.spec.block_size)
        return sent / ranks / self.link.bandwidth + self.link.latency_s

    # ---------------------------------------------------------------- Served
    def now(self) -> float:
        times = [e.clock for e in self.engines if e.has_unfinished()]
        if self._events:
            times.append(self._events[0][0])
        return min(times) if times else self._time

    def wait_until(self, t: float) -> None:
        self._time = max(self._time, t)

    def has_unfinished(self) -> bool:
        return bool(self._events) or any(e.has_unfinished() for e in self.engines)

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int, arrival_time: float):
        """To a prefill instance now, or (front "decode") once the decode engine's running step ends: the real
        1P1D's engine thread takes a request between its steps."""
        self._origin[request_id] = (tuple(prompt), max_tokens, None)
        self.timelines[request_id] = {"arrival": arrival_time}
        start = self._front_free_at(arrival_time) if self.front == "decode" else arrival_time
        if start > arrival_time:
            heapq.heappush(self._events, (start, request_id, "dispatch"))
            return None
        return self._dispatch(request_id, arrival_time)

    def _dispatch(self, request_id: str, now: float):
        i = min(range(len(self.prefill)), key=lambda k: self.prefill[k].outstanding_tokens)
        prompt = self._origin[request_id][0]
        self._home[request_id] = {i}
        engine = self.prefill[i]
        engine.wait_until(now)
        timeline = self.timelines[request_id]
        timeline["dispatched"] = now
        return engine.add_request(request_id, prompt, 1, timeline["arrival"])

    def step(self) -> list:
        busy = [e for e in self.engines if e.has_unfinished()]
        engine = min(busy, key=lambda e: e.clock) if busy else None
        if self._events and (engine is None or self._events[0][0] <= engine.clock):
            t, rid, kind = heapq.heappop(self._events)
            self._time = max(self._time, t)
            if kind == "land":
                self._land(rid, t)
                return []
            refused = self._dispatch(rid, t)
            if refused is not None:
                self._origin.pop(rid)
            return [refused] if refused is not None else []
        done = engine.step()
        self._time = max(self._time, engine.clock)
        return [f for f in (self._after(engine, f) for f in done) if f is not None]

    # ---------------------------------------------------------------- the hand-over
    def _after(self, engine: SimEngine, f: Finished) -> Optional[Finished]:
        prompt, max_tokens, first = self._origin[f.request_id]
        if engine in self.prefill:
            if f.error or max_tokens == 1:
                self._origin.pop(f.request_id)
                return f
            self._origin[f.request_id] = (prompt, max_tokens, f)
            done_at = f.metrics.finished_time
            self.timelines[f.request_id].update(scheduled=f.metrics.first_scheduled_time, prefilled=done_at)
            self._send(f.request_id, done_at)
            return None
        self._origin.pop(f.request_id)
        m, d = first.metrics, f.metrics  # the request's metrics: its arrival, the decode instance's tokens
        self.timelines[f.request_id].update(decode_scheduled=d.first_scheduled_time,
                                            first_token=d.token_times[0] if d.token_times else None)
        m.token_times = d.token_times
        m.finished_time = d.finished_time
        m.num_cached_tokens = d.num_cached_tokens
        m.num_preemptions += d.num_preemptions
        return Finished(f.request_id, m, f.error)

    def _send(self, rid: str, start: float) -> None:
        seconds = self.transfer_time(self.sent_tokens(len(self._origin[rid][0])))
        self.transfer_seconds += seconds
        self.timelines[rid].update(receiving=start, landed=start + seconds)
        heapq.heappush(self._events, (start + seconds, rid, "land"))

    def _front_free_at(self, t: float) -> float:
        """When the decode process of servescope's 1P1D takes a request that came at `t`: at once when its engine
        is idle, else when its running step ends (the engine thread takes requests between steps)."""
        front = self.decode[0]
        return front.clock if front.has_unfinished() and front.clock > t else t

    def _land(self, rid: str, now: float) -> None:
        prompt, max_tokens, _ = self._origin[rid]
        k = min(range(len(self.decode)), key=lambda j: self.decode[j].outstanding_tokens)
        engine = self.decode[k]
        engine.wait_until(now)
        self._home[rid].add(len(self.prefill) + k)
        if not inject_kv(engine, rid, prompt[:self.sent_tokens(len(prompt))]):
            self.recomputed += 1
        refused = engine.add_request(rid, prompt, max_tokens, now)
        if refused is not None:  # cannot happen for a request the prefill instance took (same spec)
            raise RuntimeError(f"decode instance refused {rid}: {refused.error}")

    def stats(self, duration: float) -> dict:
        out = [e.utilisation(duration) for e in self.engines]
        n = max(len(self._home), 1)
        return {"devices": self.num_devices, "instances": out, "kv_link": self.link.name,
                "mean_transfer_ms": self.transfer_seconds / n * 1e3, "recomputed_prompts": self.recomputed}
