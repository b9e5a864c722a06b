"""LiveView: snapshots of a running LLMEngine for the dashboard, read on the engine thread.

The engine does nothing for viewers while it steps: a step only adds its token counts to two
totals (`on_step`, a step listener: a few additions). A snapshot (`frame`) is taken between steps
when the server asks for one (a few times a second while someone watches) and holds the step
records since the previous snapshot (at most `max_steps` of them, the newest), the KV cache's block
map, the queues and the latency histograms. Everything is plain JSON-ready data; strings that came
from a request (prompt previews) are sent as data, never as markup: the page sets them as text.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

from servescope.telemetry.live import LatencyHistograms, step_event

PREVIEW_HEAD, PREVIEW_TAIL = 8, 12  # prompt tokens decoded for a queue entry's preview (a chat's
# question is at its end, after a system prompt that many requests share)
MAX_QUEUE_ENTRIES = 64  # listed per queue (the counts are always complete)
# The block map is the one part of a snapshot that grows with the cache (a Python pass over every
# block, long on a large GPU's cache): it is rebuilt at most once per (its build time / MAP_SHARE),
# so that it never takes more than 1% of the engine thread.
MAP_SHARE = 0.01


def _run_lengths(values: list) -> list:
    """[[value, run length], ...] of a list (a block map's owners: runs of one request's blocks)."""
    return [[v, len(list(g))] for v, g in itertools.groupby(values)]


class LiveView:
    def __init__(self, engine, histograms: Optional[LatencyHistograms] = None, max_steps: int = 500,
                 previews: bool = True):
        self.engine = engine
        self.previews = previews  # False: queue entries carry no prompt text (prompt None)
        self.histograms = histograms or LatencyHistograms()
        self.max_steps = max_steps
        self.prefill_tokens = self.decode_tokens = 0  # since this view was attached
        self._previews: dict = {}  # request id -> prompt preview (unfinished requests only)
        self._map: Optional[dict] = None
        self._map_due = 0.0  # perf_counter time after which the block map is rebuilt
        engine.step_listeners.append(self.on_step)

    def on_step(self, rec) -> None:
        self.prefill_tokens += rec.num_prefill_tokens
        self.decode_tokens += rec.num_decode_tokens

    # ------------------------------------------------------------ engine thread
    def frame(self, since_step: int) -> dict:
        """The state now and the steps after `since_step` (engine thread, between steps)."""
        engine = self.engine
        recs = engine.step_records
        last = recs[-1].step if recs else 0
        # step numbers are consecutive: the newest max_steps after since_step, read from the end
        newest = itertools.islice(reversed(recs), min(self.max_steps, max(0, last - since_step)))
        kept = [r for r in newest if r.step > since_step][::-1]
        return {
            "time": round(time.perf_counter() - engine.start_time, 4),
            "last_step": last,
            "steps": [step_event(r, engine.start_time) for r in kept],
            "steps_dropped": max(0, last - since_step - len(kept)),
            "totals": {"prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens},
            "kv": self._block_map(),
            "kv_state": engine.kv_cache_state(),
            "queues": self._queues(),
            "latency": self.histograms.as_dict(),
        }

    def _block_map(self) -> dict:
        t0, km = time.perf_counter(), self.engine.kv_manager
        # an idle engine loses nothing to a rebuild: then the map is always the state now
        idle_and_stale = not self.engine.has_unfinished() and self._map is not None and self._map["counts"] != {
            "free": sum(g.allocator.num_free for g in _groups(km)),
            "used": sum(g.num_used_blocks - (g.num_cached_blocks - g.num_evictable_blocks) for g in _groups(km)),
            "cached": sum(g.num_cached_blocks - g.num_evictable_blocks for g in _groups(km)),
            "evictable": sum(g.num_evictable_blocks for g in _groups(km))}
        if self._map is None or t0 >= self._map_due or idle_and_stale:
            self._map = self._build_block_map()
            self._map_due = t0 + (time.perf_counter() - t0) / MAP_SHARE
        return self._map

    def _build_block_map(self) -> dict:
        km = self.engine.kv_manager
        states, owners = km.block_map()
        requests = sorted({o for o in owners if o is not None})
        index = {rid: i for i, rid in enumerate(requests)}
        counts = [0, 0, 0, 0]
        for s in states:
            counts[s] += 1
        out = {"num_blocks": len(states), "block_size": km.block_size,
               "states": "".join(map(str, states)),
               "owners": _run_lengths([-1 if o is None else index[o] for o in owners]),
               "requests": requests,
               "counts": dict(zip(("free", "used", "cached", "evictable"), counts))}
        if km.num_groups > 1:  # a table per group of layers: the groups' blocks one after the other
            offsets = [0]
            for g in km.groups:
                offsets.append(offsets[-1] + g.num_blocks)
            out["groups"] = [{"window": w, "offset": o, "blocks": g.num_blocks}
                             for w, o, g in zip(km.windows, offsets, km.groups)]
        return out

    def _queues(self) -> dict:
        sched = self.engine.scheduler
        queues = sched.queues()
        live = set(queues["running"]) | set(queues["waiting"])
        self._previews = {rid: p for rid, p in self._previews.items() if rid in live}
        out = {}
        for name, ids in queues.items():
            entries = []
            for rid in ids[:MAX_QUEUE_ENTRIES]:
                req = sched.get_request(rid)
                if req is None:
                    continue
                preview = self._preview(rid, req) if self.previews else None
                entries.append({"id": rid, "prompt": preview, "prompt_tokens": req.num_prompt_tokens,
                                "output_tokens": req.num_output_tokens})
            out[name] = {"count": len(ids), "entries": entries}
        return out

    def _preview(self, rid: str, req) -> str:
        if rid not in self._previews:
            tok = self.engine.tokenizer
            ids = req.prompt_token_ids
            text = tok.decode if tok is not None else (lambda part: " ".join(map(str, part)))
            if len(ids) <= PREVIEW_HEAD + PREVIEW_TAIL:
                self._previews[rid] = text(ids)
            else:
                self._previews[rid] = f"{text(ids[:PREVIEW_HEAD])} … {text(ids[-PREVIEW_TAIL:])}"
        return self._previews[rid]

    def hardware(self) -> Optional[dict]:
        """The roofline the steps are predicted on: peak FLOP/s, bandwidth, ridge (None without the
        cost model)."""
        cost = self.engine.step_cost_predictor
        if cost is None:
            return None
        hw = cost.hw
        peak = hw.flops(cost.act_dtype)
        return {"name": hw.name, "dtype": cost.act_dtype, "peak_flops": peak, "bandwidth": hw.memory_bandwidth,
                "ridge": peak / hw.memory_bandwidth}


def _groups(km) -> tuple:
    """The KV managers behind km: its groups' (kvcache/hybrid.py), or km itself."""
    return km.groups if km.num_groups > 1 else (km,)
