"""Deployments: engine instances on one virtual timeline, behind a router.

`Deployment` is data parallelism: N replicas of one instance spec, each request routed on arrival by
  round-robin   replica i mod N;
  least-tokens  the replica with the fewest outstanding tokens (prompt tokens until the first token,
                then the outputs still to come), SGLang's and vLLM's production routers' load measure;
  prefix        the replica whose prefix cache holds the longest prefix of the prompt (its real block
                hashes, looked up without touching the cache, as the engine's hit rule takes them: a hybrid's
                every group of layers, KVCacheManager.cached_tables), unless that replica's load exceeds the
                least loaded one's by more than `balance_tokens`, then least-tokens (SGLang's
                cache-aware router's rule).
One replica is the single-engine case. Time: every replica has its own clock; the deployment always
steps the replica whose next step starts first, so steps of different replicas interleave in time
order and a request is routed on the state the replicas have at its arrival.
"""

from __future__ import annotations

from typing import Sequence

from servescope.errors import InvalidParameterError
from servescope.kvcache.prefix_cache import hash_full_blocks, max_hit_blocks
from servescope.sim.engine import SimEngine
from servescope.sim.spec import InstanceSpec
from servescope.sim.step_time import StepTimer

ROUTERS = ("round-robin", "least-tokens", "prefix")
DEFAULT_BALANCE_TOKENS = 4096
_STALE = object()  # Deployment._due before the next replica to step is looked up


class Deployment:
    """N data-parallel replicas of `spec` behind a router (sim/driver.Served)."""

    def __init__(self, spec: InstanceSpec, replicas: int = 1, router: str = "least-tokens",
                 keep_steps: bool = True, balance_tokens: int = DEFAULT_BALANCE_TOKENS, seed: int = 0,
                 fast_forward: bool = True):
        if replicas < 1:
            raise InvalidParameterError("replicas", f"replicas must be at least 1, got {replicas}")
        if router not in ROUTERS:
            raise InvalidParameterError("router", f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        self.spec, self.router, self.balance_tokens = spec, router, balance_tokens
        timer = StepTimer(spec)
        self.fast_forward = fast_forward  # sim/run.simulate drives it through sim/parallel.py, whose replicas plan
        self.engines = [SimEngine(spec, f"replica-{i}", keep_steps, seed + i, timer, fast_forward)
                        for i in range(replicas)]
        self._time = 0.0
        self._next = 0
        self._home: dict = {}  # request id -> replica index
        self._due = _STALE  # the busy replica to step next (None: none is busy), until a step or a request

    @property
    def num_devices(self) -> int:
        return len(self.engines) * self.spec.num_devices

    def describe(self) -> str:
        n = len(self.engines)
        one = f"TP={self.spec.tp} x PP={self.spec.pp} on {self.spec.hardware.name}"
        return one if n == 1 else f"{n} replicas of {one} ({self.num_devices} devices), router {self.router}"

    def served_by(self, instance: int) -> set:
        return {rid for rid, i in self._home.items() if i == instance}

    # ---------------------------------------------------------------- Served
    def now(self) -> float:
        engine = self._due_replica()
        return self._time if engine is None else engine.clock

    def _due_replica(self):
        """The busy replica whose next step starts first (the first of equals), or None; found once between
        two steps or requests (the driver asks now(), has_unfinished() and step() for each step)."""
        if self._due is _STALE:
            best = None
            for e in self.engines:  # a plain loop: once a simulated step
                if (best is None or e.clock < best.clock) and e.has_unfinished():
                    best = e
            self._due = best
        return self._due

    def wait_until(self, t: float) -> None:
        self._time = max(self._time, t)

    def resync(self) -> None:
        """After the replicas were stepped elsewhere (sim/parallel.py): the latest time is their latest clock,
        the next replica to step is looked up again."""
        self._time = max([self._time] + [e.clock for e in self.engines])
        self._due = _STALE

    def has_unfinished(self) -> bool:
        return self._due_replica() is not None

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int, arrival_time: float):
        self._due = _STALE  # the request may wake an idle replica or move one's clock
        engine = self.engines[self._route(request_id, prompt)]
        engine.wait_until(arrival_time)  # an idle replica starts its next step when the request arrives
        return engine.add_request(request_id, prompt, max_tokens, arrival_time)

    def step(self) -> list:
        engine = self._due_replica()
        self._due = _STALE
        done = engine.step()
        self._time = max(self._time, engine.clock)
        return done

    # ---------------------------------------------------------------- routing
    def _route(self, request_id: str, prompt: Sequence[int]) -> int:
        if len(self.engines) == 1:
            return self.choose(request_id, [0], None)
        loads = [e.outstanding_tokens for e in self.engines]
        hits = [self.cached_prefix(e, prompt) for e in self.engines] if self.router == "prefix" else None
        return self.choose(request_id, loads, hits)

    def choose(self, request_id: str, loads: Sequence[int], hits) -> int:
        """The replica the router sends the request to, from each replica's outstanding tokens and (the prefix
        router only, else None) the tokens of the prompt its prefix cache holds; it is the request's home
        from now on (served_by). Advances round-robin."""
        self._home[request_id] = i = self._pick(loads, hits)
        return i

    def _pick(self, loads: Sequence[int], hits) -> int:
        n = len(loads)
        if n == 1:
            return 0
        if self.router == "round-robin":
            self._next = (self._next + 1) % n
            return (self._next - 1) % n
        least = min(range(n), key=loads.__getitem__)
        if self.router == "least-tokens":
            return least
        best = max(range(n), key=lambda i: (hits[i], -loads[i]))
        if hits[best] == 0 or loads[best] - loads[least] > self.balance_tokens:
            return least
        return best

    def likely_next(self, loads: Sequence[int]) -> int:
        """The replica the next request will likely be routed to, from each replica's outstanding tokens now (the
        request just routed counted in): round-robin's next turn, else the least loaded one (a guess: the loads
        move before the next arrival, and the prefix router's hits are not looked at)."""
        if self.router == "round-robin":
            return self._next % len(loads)
        return min(range(len(loads)), key=loads.__getitem__)

    def could_choose(self, indices: Sequence[int], loads: Sequence[int], hits) -> set:
        """The replicas among `indices` that _pick could choose for the next request whatever the other
        replicas' numbers, from these replicas' loads and hits (as choose takes them, in the order of
        `indices`): least-tokens the first least loaded of them, prefix that and the first with the most
        hits (then the least load); round-robin all of them (its turn is not among the numbers)."""
        if self.router == "round-robin" or len(self.engines) == 1:
            return set(indices)
        k = min(range(len(indices)), key=loads.__getitem__)
        out = {indices[k]}
        if self.router == "prefix":
            out.add(indices[max(range(len(indices)), key=lambda i: (hits[i], -loads[i]))])
        return out

    @staticmethod
    def cached_prefix(engine: SimEngine, prompt: Sequence[int]) -> int:
        """Tokens of the prompt that a prefix hit on the replica would take now: the engine's own rule
        (the KV manager's cached_tables, get_computed_blocks's: with a table per group of layers, the longest
        prefix every group can serve, a windowed group the blocks the next query reads). Touches nothing."""
        km = engine.kv_manager
        if not km.enable_prefix_caching:
            return 0
        hashes = hash_full_blocks(prompt, km.block_size, limit=max_hit_blocks(len(prompt), km.block_size),
                                  extend=km.extend_hashes)
        return km.cached_tables(hashes)[0] * km.block_size

    # ---------------------------------------------------------------- what happened
    def stats(self, duration: float) -> dict:
        """Per-replica utilisation: busy share of the run, steps, preemptions, prefix-cache hit rate."""
        out = [e.utilisation(duration) for e in self.engines]
        return {"devices": self.num_devices, "instances": out}
