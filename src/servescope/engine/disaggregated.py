"""Prefill/decode disaggregation on one machine: 1 prefill engine process + 1 decode engine (1P1D).

The decode engine is an ordinary LLMEngine in this process (the one `servescope serve` answers from);
the prefill engine is another LLMEngine, built from the same EngineConfig in a spawned process. A
request whose prompt has at least one full KV block goes first to the prefill process, which computes
the prompt (one sampled token, dropped) and sends the KV of its full blocks back over a gloo process
group of the two (engine/kv_transfer.py: out of its prefix cache, into the decode engine's as cached
blocks). The decode engine then admits the request as a prefix-cache hit and computes the rest: the
prompt's last partial block, the first token and every further one. So every token a client sees comes
from the decode engine and its sampler (greedy output is the single engine's), the decode engine's
scheduler and KV manager are the engine's own, and TTFT = queueing + prefill + transfer + the decode
engine's first step, as sim/disagg.py models it.

Channels: requests, aborts and STOP go to the worker on a multiprocessing queue; the worker answers on
another with ("kv", request id, shape, dtype, its times) right before it sends that tensor (one contiguous
buffer, as bytes) on the gloo group, or
("error", request id, message) for a request it refused, or ("failed", message) before it exits on a
bug. A receiver thread here posts the matching gloo receive and hands (request id, KV) to the engine
thread, which adopts the KV and adds the request between steps. A dead worker (or a broken group) is a
WorkerFailedError from step(): AsyncEngine then fails every request in flight with it.

Each hand-over's times (perf_counter: CLOCK_MONOTONIC, one clock for both processes) are kept in
`timelines` (request id -> {stage: time}, the latest TIMELINES of them): dispatched (sent to the worker),
received (the worker took it), scheduled / prefilled (the prefill engine's first step / its token),
exported (the KV gathered), announced (the header read here), landed (the bytes received), adopting /
adopted (the engine thread took it / the KV is in the decode engine's cache and the request queued). The
decode engine's own metrics add its first step and first token (benchmarks/disagg_1p1d.py lays them
beside sim/disagg.py's).

CPU tensors over gloo only (NCCL would send the device tensors without the copy; not built here).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import threading
import time
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from servescope.config import EngineConfig, SamplingParams
from servescope.engine.kv_transfer import BufferPool, adopt_prompt_kv, export_prompt_kv
from servescope.kvcache.prefix_cache import max_hit_blocks
from servescope.engine.llm_engine import LLMEngine
from servescope.errors import InvalidParameterError, WorkerFailedError
from servescope.parallel.groups import WORKER_TIMEOUT_S, free_port, master_store, worker_store
from servescope.parallel.launcher import WorkerGroup, watch_parent

logger = logging.getLogger(__name__)

LAYOUTS = ("1P1D",)
START_TIMEOUT_S = 600.0  # for the prefill process to load its weights
IDLE_WAIT_S = 0.002  # the engine thread's wait for a transfer when the decode engine has nothing to run
TIMELINES = 4096  # hand-over timelines kept (the oldest go first)


def check_layout(layout: str, config: EngineConfig) -> None:
    """InvalidParameterError unless `layout` is one this module runs with this config."""
    if layout not in LAYOUTS:
        raise InvalidParameterError("disaggregate", f"--disaggregate must be one of {', '.join(LAYOUTS)}, "
                                                    f"got {layout!r}")
    if config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size != 1:
        raise InvalidParameterError("disaggregate",
                                    "disaggregation runs one device per engine: TP and PP must be 1")
    if not config.cache.enable_prefix_caching or config.cache.no_kv_cache:
        raise InvalidParameterError("disaggregate", "the decode engine takes the sent KV as cached blocks: "
                                                    "disaggregation needs prefix caching on (and a KV cache)")


class DisaggregatedEngine:
    """LLMEngine's interface (what AsyncEngine and the server use) over a decode engine in this process
    and a prefill engine in a worker process. Attributes not defined here are the decode engine's."""

    def __init__(self, decode: LLMEngine, layout: str = "1P1D", start_timeout_s: float = START_TIMEOUT_S):
        check_layout(layout, decode.config)
        self.decode, self.layout = decode, layout
        self._pending: dict = {}  # request id -> (text, ids, params, priority, arrival, ticket) meanwhile
        # the worker knows each prefill by a ticket only: KV that arrives for an aborted request (its ticket
        # gone from here) is dropped, never taken for a later request of the same id
        self._ticket_of: dict = {}  # ticket -> request id
        self._tickets = itertools.count()
        self._arrived: queue.Queue = queue.Queue()  # (ticket, KV tensor | error message) for the engine thread
        self._failure: Optional[str] = None
        self._buffers = BufferPool()  # received KV lands in reused memory (kv_transfer.BufferPool: page faults)
        self.timelines: dict = {}  # request id -> {stage: perf_counter time} of its hand-over (module docstring)
        ctx = mp.get_context("spawn")
        self._to_worker, self._from_worker = ctx.Queue(), ctx.Queue()
        port = free_port()
        self._store = master_store(port, 2)
        self._workers = WorkerGroup(_prefill_worker, 2, (decode.config, port, self._to_worker, self._from_worker))
        self._worker = self._workers.procs[0]
        # the group's rendezvous blocks until the worker joins: in a thread, so that a worker that dies
        # first is reported (by _wait_ready) instead of waiting out the timeout
        joined: list = []
        threading.Thread(target=lambda: joined.append(dist.ProcessGroupGloo(
            self._store, 0, 2, datetime.timedelta(seconds=WORKER_TIMEOUT_S))), daemon=True).start()
        try:
            self._wait_ready(start_timeout_s, joined)
        except BaseException:
            self._stop_worker()
            raise
        self._group = joined[0]
        self._receiver = threading.Thread(target=self._receive, name="servescope-kv-receiver", daemon=True)
        self._receiver.start()

    def __getattr__(self, name):  # the decode engine's tokenizer, config, outputs, step records...
        if name == "decode":
            raise AttributeError(name)
        return getattr(self.decode, name)

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: Union[str, Sequence[int]],
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None) -> None:
        """Validate (the decode engine's validate_request, once), then send the prompt to the prefill process
        (a prompt without a full block goes to the decode engine at once). Raises InvalidParameterError,
        nothing queued."""
        params = params or SamplingParams()  # a dead worker is step()'s to report (it closes the engine)
        if request_id in self._pending or request_id in self.decode.outputs:
            raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
        text, ids = self.decode.validate_request(prompt, params)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        if max_hit_blocks(len(ids), self.decode.cache_config.block_size) == 0:
            self.decode.enqueue(request_id, text, ids, params, priority, arrival)
            return
        ticket = next(self._tickets)
        self._pending[request_id] = (text, ids, params, priority, arrival, ticket)
        self._ticket_of[ticket] = request_id
        while len(self.timelines) >= TIMELINES:
            del self.timelines[next(iter(self.timelines))]
        self.timelines[request_id] = {"arrival": arrival, "dispatched": time.perf_counter()}
        self._to_worker.put(("prefill", ticket, ids, params.cache_salt))

    def abort(self, request_id: str) -> bool:
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            del self._ticket_of[entry[-1]]
            self._to_worker.put(("abort", entry[-1]))  # its KV, if already on the way, is dropped on arrival
            return True
        return self.decode.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.decode.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self._pending) + self.decode.num_unfinished

    # ---------------------------------------------------------------- the step
    def step(self) -> list:
        """Adopt the KV that arrived and add those requests, then one decode-engine step (or, with nothing
        to run there, a short wait for the next transfer)."""
        self._check_alive()
        if not self.decode.has_unfinished() and self._arrived.empty():
            try:
                self._adopt(*self._arrived.get(timeout=IDLE_WAIT_S))
            except queue.Empty:
                return []
        while not self._arrived.empty():
            self._adopt(*self._arrived.get_nowait())
        self._check_alive()
        return self.decode.step() if self.decode.has_unfinished() else []

    def _adopt(self, ticket: int, kv, num_blocks: int, times: dict) -> None:
        try:
            self._adopt_kv(ticket, kv, num_blocks, times)
        finally:
            if not isinstance(kv, str):
                self._buffers.give(kv)

    def _adopt_kv(self, ticket: int, kv, num_blocks: int, times: dict) -> None:
        adopting = time.perf_counter()
        request_id = self._ticket_of.pop(ticket, None)
        if request_id is None:  # aborted while in the prefill process
            return
        text, ids, params, priority, arrival, _ = self._pending.pop(request_id)
        if isinstance(kv, str):  # the prefill engine refused it: the decode engine prefills it itself
            logger.warning("prefill of %s failed (%s); the decode engine computes its prompt", request_id, kv)
        else:
            adopt_prompt_kv(self.decode, request_id, ids, params.cache_salt, kv, num_blocks)
        self.decode.enqueue(request_id, text, ids, params, priority, arrival)
        timeline = self.timelines.get(request_id)
        if timeline is not None:
            timeline.update(times, adopting=adopting, adopted=time.perf_counter())

    # ---------------------------------------------------------------- the worker
    def _receive(self) -> None:
        """The receiver thread: one gloo receive per announced transfer, in the worker's order."""
        while self._failure is None:
            try:
                msg = self._from_worker.get(timeout=0.5)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                break
            try:
                self._on_message(msg)
            except Exception as e:  # noqa: BLE001 - a broken group: step() reports it
                self._failure = f"the KV transfer from the prefill process failed: {type(e).__name__}: {e}"
                break

    def _on_message(self, msg: tuple) -> None:
        if msg[0] == "kv":
            _, ticket, shape, dtype, num_blocks, times = msg
            announced = time.perf_counter()
            kv = self._buffers.take(shape, dtype)
            if kv.numel():
                self._group.recv([kv.view(-1).view(torch.uint8)], 1, 0).wait()
            landed = time.perf_counter()
            self._arrived.put((ticket, kv, num_blocks, {**times, "announced": announced, "landed": landed,
                                                        "blocks": num_blocks, "bytes": kv.numel() * kv.element_size()}))
        elif msg[0] == "error":
            self._arrived.put((msg[1], msg[2], 0, {}))
        elif msg[0] == "failed":
            self._failure = f"the prefill process failed: {msg[1]}"

    def _wait_ready(self, timeout_s: float, joined: list) -> None:
        """Until the worker said ready and the group is up; WorkerFailedError when the worker failed."""
        deadline = time.monotonic() + timeout_s
        ready = False
        while not (ready and joined):
            if ready:  # only the group's rendezvous is left
                if self._worker.exitcode is not None or time.monotonic() > deadline:
                    raise WorkerFailedError("the prefill process did not join the KV transfer group")
                time.sleep(0.01)
                continue
            try:
                msg = self._from_worker.get(timeout=0.2)
            except queue.Empty:
                if self._worker.exitcode is not None:
                    raise WorkerFailedError(f"the prefill process exited with code {self._worker.exitcode} "
                                            f"while loading") from None
                if time.monotonic() > deadline:
                    raise WorkerFailedError(
                        f"the prefill process was not ready within {timeout_s:g} s") from None
                continue
            if msg[0] != "ready":
                raise WorkerFailedError(f"the prefill process failed while loading: {msg[-1]}")
            ready = True

    def _check_alive(self) -> None:
        if self._failure is None and self._worker.exitcode is not None:
            self._failure = f"the prefill process exited with code {self._worker.exitcode}"
        if self._failure is not None:
            raise WorkerFailedError(f"{self._failure}; the engine must be restarted")

    def _stop_worker(self) -> None:
        if self._worker.is_alive():
            self._to_worker.put(("stop",))
        self._workers.shutdown()  # waits for it, then terminates, then kills

    def shutdown(self, keep_workers: bool = False) -> None:
        """Stop the prefill process, then the decode engine's own workers; idempotent."""
        if self._failure is None:
            self._failure = "the engine was shut down"
        self._stop_worker()
        self.decode.shutdown(keep_workers)


def _prefill_worker(rank: int, config: EngineConfig, port: int, inbox, outbox, parent_pid: int) -> None:
    """The prefill process (rank 1 of the pair): its own engine on the same config; prefill each request (one
    token), send the KV of its prompt's full blocks."""
    watch_parent(parent_pid)
    try:
        store = worker_store(port, 2)
        group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=WORKER_TIMEOUT_S))
        engine = LLMEngine(config)
    except Exception as e:  # noqa: BLE001 - reported to the server, which refuses to start
        outbox.put(("failed", f"{type(e).__name__}: {e}"))
        return
    outbox.put(("ready",))
    try:
        _prefill_loop(engine, group, inbox, outbox)
    except Exception as e:  # noqa: BLE001 - a bug: the server fails what is in flight with this message
        logger.exception("the prefill process failed")
        outbox.put(("failed", f"{type(e).__name__}: {e}"))


def _prefill_loop(engine: LLMEngine, group, inbox, outbox) -> None:
    buffers = BufferPool()  # the KV is gathered into reused memory; each send ends before the next gather
    salts: dict = {}  # engine request id (the ticket) -> (prompt ids, cache salt, when it was received)
    while True:
        try:  # block while idle; between steps only take what is there
            msgs = [inbox.get(timeout=None if not engine.has_unfinished() else 0.0)]
        except queue.Empty:
            msgs = []
        while True:
            try:
                msgs.append(inbox.get_nowait())
            except queue.Empty:
                break
        for msg in msgs:
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                if salts.pop(str(msg[1]), None) is not None:
                    engine.abort(str(msg[1]))
                continue
            _, ticket, ids, salt = msg
            received = time.perf_counter()
            try:  # greedy, one token: the decode engine samples every token the client sees
                one = SamplingParams(max_tokens=1, temperature=0.0, cache_salt=salt)
                engine.add_request(str(ticket), ids, one)
            except Exception as e:  # noqa: BLE001 - the decode engine prefills it then
                outbox.put(("error", ticket, f"{type(e).__name__}: {e}"))
                continue
            salts[str(ticket)] = (ids, salt, received)
        if not engine.has_unfinished():
            continue
        for out in engine.step():
            if out.finished and out.request_id in salts:
                ids, salt, received = salts.pop(out.request_id)
                kv, num_blocks = export_prompt_kv(engine, ids, salt, buffers)  # one contiguous buffer, sent as it is
                m = out.metrics
                times = {"received": received, "scheduled": m.first_scheduled_time,
                         "prefilled": m.token_times[-1] if m.token_times else None, "exported": time.perf_counter()}
                outbox.put(("kv", int(out.request_id), tuple(kv.shape), kv.dtype, num_blocks, times))
                if kv.numel():
                    group.send([kv.view(-1).view(torch.uint8)], 0, 0).wait()
                buffers.give(kv)
