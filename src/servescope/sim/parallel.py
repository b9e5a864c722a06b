"""A data-parallel deployment's replicas simulated in several processes, with the sequential run's results.

Replicas of a `Deployment` share nothing but the router: between two arrivals each replica steps on its
own. The sequential loop (sim/driver.drive over Deployment) adds requests in batches: at the deployment's
`now` (the earliest clock of a busy replica, or the latest time seen when none is busy) it adds every
next request that has arrived by then, on the replicas as they are; then it steps the earliest replica
until the next request has arrived by `now`, i.e. every busy replica runs exactly its steps that start
before that arrival. Here the replicas are split into groups, one per process (this one runs the first
group, forked children the others), and the groups meet at every request: for one that opens a batch
each runs its replicas' steps that start before the arrival, each reports its replicas' outstanding
tokens (and, for the prefix router, the prompt's cached tokens) and its earliest busy and latest clock,
this process computes the batch's `now` and routes with Deployment.choose on the same numbers, and the
chosen replica's group adds the request before going on. Every replica therefore sees
the same requests at the same states and takes the same steps, and every float is summed in the same
order: each request's token times, hence bench serve's report, are identical to the sequential run's
(tests/sim/test_fast_paths.py compares them). At the end the children send back their finished requests
and their replicas (SimEngine pickles), which replace this process's copies in `deployment.engines`.

Between meetings each group runs ahead (_Group.advance_ahead): having answered for request j, it knows
which of its replicas the router could send j to (Deployment.could_choose on its own numbers: least-tokens
its least loaded one, whatever the other groups report); every other replica cannot change before the next
meeting, so it runs now the steps that meeting runs -- unless a request reached it since the last meeting
that opened a batch (the `now` that decides whether j + 1 opens one predates it). Then, until the message
comes, it applies the planned stretches of the replicas j can reach (adding j there applies them), then
long ones. A replica the request reaches therefore has little left to do when the message comes: the
receiving group's prefill, not the other replicas' steps, is what the other group waits for.

What adding a request needs from the request alone (its prompt, its prompt blocks' hashes, its output
stream: SimEngine.prepare) is computed ahead by a group that the request before it leaves waiting: this
process when a child took that request (sent with the routing if the next goes to a child), else the child
whose replica the router will likely choose next (Deployment.likely_next); a wrong guess costs only time
that was waited anyway, and adding a request without it computes it then.

Only without a concurrency limit: with one, when a request is sent depends on when others finish, which
the groups learn only at the next meeting.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import select
import struct
import traceback
from typing import Sequence

from servescope.sim.cluster import Deployment
from servescope.sim.driver import record_of

_LEN = struct.Struct("<Q")  # a message's length, before it on the pipe
_READ = 1 << 16  # bytes one read asks for: a meeting's message whole
_NOTHING = (-1, None, None)  # _Group.prepared when nothing is
PREPAY_STEPS = 8  # the shortest planned stretch applied ahead of need (a split one restarts its plan)
RECORD_BATCH = 8  # records built between two looks for a message (one look ~1 us, one record ~20 us)


class _Group:
    """Replicas of one process: `indices` into the deployment's engines."""

    def __init__(self, deployment: Deployment, indices: Sequence[int], requests: Sequence, arrivals: list,
                 prefix: str, start: float):
        self.dep, self.indices = deployment, list(indices)
        self.engines = [deployment.engines[i] for i in self.indices]
        self.requests, self.arrivals, self.prefix, self.start = requests, arrivals, prefix, start
        self.finished: dict = {}  # request index -> Finished
        self.records: dict = {}  # request index -> its record (sim/driver.record_of), built while waiting
        self.unrecorded: list = []  # finished requests without their record yet
        self.last = 0.0  # the latest finish of a step-finished request
        self.time = 0.0  # the latest clock a step reached (the deployment's `_time` rule)
        self.touched: set = set()  # replicas that got a request since the last meeting that opened a batch
        self.first: Sequence = ()  # replicas whose planned stretch prepay_until applies first
        self.to_prepare = -1  # the next request, when this group is to prepare it (prepare), or -1
        self.prepared: tuple = _NOTHING  # (request index, its prompt or None, SimEngine.prepare's result)

    def meet(self, j: int, opens_batch: bool) -> tuple:
        """Before request j is routed: run every step that starts before it arrives if it opens a batch; then
        (outstanding tokens, prefix-cached tokens of its prompt or None) of each replica, the earliest clock
        of a busy replica (inf if none), the latest clock a step reached."""
        if opens_batch:
            self.touched.clear()
            t = self.arrivals[j]
            for e in self.engines:
                self._advance(e, t)
        loads = [e.load() for e in self.engines]
        hits = None
        if self.dep.router == "prefix":
            prompt = self.requests[j].prompt
            hits = []
            for e in self.engines:
                e.settle()  # the prefix cache as the planned steps leave it
                hits.append(self.dep.cached_prefix(e, prompt))
        busy = min((e.next_start() for e in self.engines if e.has_unfinished()), default=math.inf)
        return loads, hits, busy, self.time

    def _advance(self, e, t: float) -> None:
        before = e.steps_taken()
        self._collect(e.advance(t))
        if e.steps_taken() != before:
            self.time = max(self.time, e.next_start())

    def advance_ahead(self, j: int, loads: list, hits, ready) -> None:
        """After this group answered meeting j with `loads` and `hits`: run, while ready() is false, the steps
        that meeting j + 1 runs if it opens a batch, on each replica that request j cannot be routed to
        (Deployment.could_choose on this group's numbers) and that no request reached since the last meeting
        that opened a batch. Such a replica, busy, starts its next step at or after the `now` the parent
        decides j + 1's batch by, so if j + 1 opens none the advance runs no step; if it opens one, the
        replica's steps are those of that meeting (nothing reaches it before: the module docstring)."""
        if j + 1 >= len(self.arrivals):
            return
        could = self.dep.could_choose(self.indices, loads, hits)
        self.first = [e for i, e in zip(self.indices, self.engines) if i in could]
        t = self.arrivals[j + 1]
        for i, e in zip(self.indices, self.engines):
            if i in could or i in self.touched:
                continue
            if ready():
                return
            self._advance(e, t)

    def prepare(self, ready) -> None:
        """Unless ready(): draw the prompt of the next request, when this group is to prepare it (`to_prepare`), and
        compute what adding it needs from it alone (SimEngine.prepare: its blocks' hashes, its output stream), so
        that adding it, on the path both processes wait on, does not (the module docstring)."""
        j = self.to_prepare
        if j < 0 or ready():
            return
        self.to_prepare = -1
        r = self.requests[j]
        prompt = r.prompt
        self.prepared = (j, prompt, self.engines[0].prepare(f"{self.prefix}-{j}", prompt, r.output_len))

    def prepay_until(self, ready) -> None:
        """Until ready() (a message has come): apply, one replica at a time, stretches this group planned
        (SimEngine.settle: the steps the next request routed there or the stretch's end would apply; the
        stretch goes on from there as a new one with the same steps, sim/fast_forward.py), so that the work
        is not waiting for the meeting that needs it while this process waits for the other. First the stretch of
        each replica that the request being routed can reach (advance_ahead's `first`), however short: adding a
        request there applies it."""
        while not ready():
            e = next((e for e in self.first if e.planned_steps()), None) or \
                next((e for e in self.engines if e.planned_steps() >= PREPAY_STEPS), None)
            if e is None:
                self.record(ready)
                return
            e.settle()

    def record(self, ready) -> None:
        """Build the records of finished requests (a finished request's are final) until ready(), RECORD_BATCH
        between two looks, so that the end of the run has few left to build."""
        todo, records, finished, requests, arrivals = self.unrecorded, self.records, self.finished, \
            self.requests, self.arrivals
        while todo and not ready():
            for j in todo[-RECORD_BATCH:]:
                records[j] = record_of(requests[j], finished[j], arrivals[j], self.start)
            del todo[-RECORD_BATCH:]

    def run_out(self) -> dict:
        """Run the replicas to the end; {request index: its record (sim/driver.record_of)} of this group's."""
        for e in self.engines:
            self._collect(e.advance(math.inf))
            e.settle()
        self.record(_never)
        return self.records

    def _collect(self, finished: list) -> None:
        for f in finished:
            j = int(f.request_id.rsplit("-", 1)[1])
            self.finished[j] = f
            self.unrecorded.append(j)
            self.last = max(self.last, f.metrics.finished_time)

    def add(self, j: int, replica: int) -> None:
        """Send request j to the deployment's replica `replica` (one of this group's), as Deployment.add."""
        engine, r, t = self.dep.engines[replica], self.requests[j], self.arrivals[j]
        self.touched.add(replica)
        engine.wait_until(t)
        k, prompt, prepared = self.prepared
        if k != j:
            prompt, prepared = None, None
        self.prepared = _NOTHING
        refused = engine.add_request(f"{self.prefix}-{j}", r.prompt if prompt is None else prompt, r.output_len, t,
                                     prepared)
        if refused is not None:
            self.finished[j] = refused
            self.unrecorded.append(j)


class _Pipe:
    """One process's end of two pipes to another: pickled messages behind their length, a meeting's read in one
    system call (a multiprocessing Connection reads a message's length and its body apart, each through more
    Python, and the two processes exchange two messages a request). fileno(): what a poll for a message polls."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd, self.write_fd = read_fd, write_fd
        self._rest = b""  # what a read took past its message (a child's error after its answer)

    @classmethod
    def pair(cls) -> tuple:
        a_read, b_write = os.pipe()
        b_read, a_write = os.pipe()
        return cls(a_read, a_write), cls(b_read, b_write)

    def fileno(self) -> int:
        return self.read_fd

    def send(self, obj) -> None:
        body = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        view = memoryview(_LEN.pack(len(body)) + body)
        while view:
            view = view[os.write(self.write_fd, view):]

    def recv(self):
        data = self._rest or self._read(_READ)
        while len(data) < _LEN.size:
            data += self._read(_READ)
        end = _LEN.size + _LEN.unpack_from(data)[0]
        if len(data) < end:
            data = bytearray(data)
            while len(data) < end:
                data += self._read(max(end - len(data), _READ))
        self._rest = bytes(data[end:])
        return pickle.loads(memoryview(data)[_LEN.size:end])

    def _read(self, n: int) -> bytes:
        data = os.read(self.read_fd, n)
        if not data:
            raise EOFError
        return data

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


def _serve(conn: _Pipe, group: _Group, parent_end: _Pipe) -> None:
    """A child's loop: (request to add or -1, its replica, the request to meet for or -1, whether it opens a
    batch) until the last message, then (records, finished, latest finish, its replicas) back."""
    try:
        parent_end.close()  # (the parent's end, inherited: closed, a parent that dies ends this process's reads)
        ready = _readable([conn])
        while True:
            add, replica, shipped, upto, opens_batch, group.to_prepare = conn.recv()
            if add >= 0:
                if shipped is not None:  # its hashes, computed by the parent while this process ran the one before
                    group.prepared = (add, None, (shipped, None))
                group.add(add, replica)
            if upto < 0:
                break
            answer = group.meet(upto, opens_batch)
            conn.send(answer)
            group.advance_ahead(upto, answer[0], answer[1], _never)  # (needed before the next answer in any case)
            group.prepare(ready)
            group.prepay_until(ready)
        records = group.run_out()
        for e in group.engines:
            e.timer = None  # the parent's replicas share its timer (and memo): not sent back
        conn.send(("done", records, group.finished, group.last, group.engines))
    except BaseException:  # noqa: BLE001 -- anything the child hits is reported to the parent, which raises
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def drive_replicas(deployment: Deployment, requests: Sequence, workers: int = 2, prefix: str = "req") -> tuple:
    """sim/driver.drive(deployment, requests) without a concurrency limit, the replicas split over `workers`
    processes; (records in request order, duration in seconds, finished objects), the same as drive's."""
    n_rep = len(deployment.engines)
    workers = max(1, min(workers, n_rep))
    start = deployment.now()
    arrivals = [start + r.arrival for r in requests]
    bounds = [n_rep * g // workers for g in range(workers + 1)]
    groups = [_Group(deployment, range(bounds[g], bounds[g + 1]), requests, arrivals, prefix, start)
              for g in range(workers)]
    owner = [g for g in range(workers) for _ in groups[g].indices]
    ctx = multiprocessing.get_context("fork")  # the children inherit the deployment and the workload as they are
    conns, procs = [], []
    try:
        for g in groups[1:]:
            parent_end, child_end = _Pipe.pair()
            proc = ctx.Process(target=_serve, args=(child_end, g, parent_end), daemon=True)
            proc.start()
            child_end.close()
            conns.append(parent_end)
            procs.append(proc)
        _route_all(deployment, groups, conns, owner, start, prefix)
        records = groups[0].run_out()  # the records of each group's requests built in its process
        finished, last = dict(groups[0].finished), max(start, groups[0].last)
        for g, conn in zip(groups[1:], conns):
            _, more, done, child_last, engines = _reply(conn)
            records.update(more)
            finished.update(done)
            last = max(last, child_last)
            for i, e in zip(g.indices, engines):
                e.timer = deployment.engines[0].timer  # one memo again, as the replicas had
                deployment.engines[i] = e
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for conn in conns:
            conn.close()
    deployment.resync()
    n = len(requests)
    return [records[j] for j in range(n)], max(last - start, 1e-9), [finished[j] for j in range(n)]


def _route_all(deployment: Deployment, groups: list, conns: list, owner: list, start: float, prefix: str) -> None:
    """Meet the groups at every request and route it (the sequential loop's batches: the module docstring).
    The children get each request routed to them with the message that opens the next meeting, sent before
    this process adds one routed here (its replicas only: the children need not wait for it)."""
    arrivals = groups[0].arrivals
    n = len(arrivals)
    now = time_seen = start
    opens = n > 0 and arrivals[0] > now
    for conn in conns:
        conn.send((-1, -1, None, 0 if n else -1, opens, -1))
    all_ready, each_ready = _readable(conns), [_readable([c]) for c in conns]
    for j in range(n):
        loads, hits, busy, seen = groups[0].meet(j, opens)
        if conns:  # while the children answer: the own replicas that request j cannot reach, to j + 1's arrival
            groups[0].prepare(all_ready)
            groups[0].advance_ahead(j, loads, hits, all_ready)
        for conn, ready in zip(conns, each_ready):
            groups[0].prepay_until(ready)
            more = _reply(conn)
            loads = loads + more[0]
            hits = None if hits is None else hits + more[1]
            busy, seen = min(busy, more[2]), max(seen, more[3])
        if opens:  # Deployment.now(): the earliest busy replica's clock, else the latest time seen
            time_seen = max(time_seen, seen)
            if busy == math.inf:
                time_seen = max(time_seen, arrivals[j])  # drive's wait_until
            now = busy if busy < math.inf else time_seen
        replica = deployment.choose(f"{prefix}-{j}", loads, hits)
        opens = j + 1 < n and arrivals[j + 1] > now
        went, likely = owner[replica], -1
        if conns and j + 1 < n:  # the group the next request will likely go to
            r, after = groups[0].requests[j], list(loads)
            after[replica] += r.prompt_len + r.output_len  # (add_request's outstanding tokens)
            likely = owner[deployment.likely_next(after)]
        k, _, prepared = groups[0].prepared
        # prepared here for a child's replica: the hashes go with the routing (a prompt or a stream would cost the
        # pipe's pickling about what drawing it again does)
        ship = prepared[0] if k == j and went else None
        for c, conn in enumerate(conns):
            add = (j, replica, ship) if went == c + 1 else (-1, -1, None)
            conn.send((*add, j + 1 if j + 1 < n else -1, opens, j + 1 if likely == c + 1 and not went else -1))
        if went:
            groups[0].prepared = _NOTHING
        else:
            groups[0].add(j, replica)
        # request j + 1 is prepared by a group that request j keeps free: this one when a child took j (shipped with
        # the routing when j + 1 goes to a child), the likely child when this one took j (or this one, if it is the
        # likely one and the children answer late)
        groups[0].to_prepare = j + 1 if conns and j + 1 < n and (went or likely == 0) else -1


def _readable(conns: list):
    """A check that a message waits on every one of `conns` (Connection.poll builds a selector at every call,
    ~10 us; a Connection keeps nothing read ahead, so its descriptor being readable is the same test)."""
    poller = select.poll()
    for c in conns:
        poller.register(c.fileno(), select.POLLIN)
    n = len(conns)
    return lambda: len(poller.poll(0)) == n


def _never() -> bool:
    return False


def _reply(conn):
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError("a simulator worker process exited without an answer") from None
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"a simulator worker process failed:\n{msg[1]}")
    return msg
