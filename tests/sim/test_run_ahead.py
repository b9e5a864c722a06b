"""sim/parallel.py runs ahead: after answering a meeting, a group runs the next meeting's steps on each of its
replicas that the request being routed cannot reach (Deployment.could_choose) and that no request reached
since the last meeting that opened a batch, then applies the planned stretches of those it can reach. Done in
full at every meeting (as if the other process were
always the slower one), the records are the sequential run's; running ahead a replica the request can
reach, or one that a request reached within the batch, gives other records."""

import random

import pytest

from servescope.sim import parallel
from servescope.sim.cluster import Deployment
from servescope.sim.driver import drive
from servescope.sim.parallel import drive_replicas
from test_fast_paths import _same, _spec, _workload


# arrivals so close that most meetings open no batch: requests reach idle replicas within a batch
_BATCHES = _workload(200, 100000.0, seed=3)


def _always(monkeypatch, counted: list):
    """advance_ahead and prepay_until run to their ends at every meeting (the latter applies the stretches of the
    replicas the request can reach first, then every long one); `counted` gets the steps advance_ahead ran
    (this process's)."""
    original, prepay = parallel._Group.advance_ahead, parallel._Group.prepay_until
    monkeypatch.setattr(parallel._Group, "prepay_until", lambda self, ready: prepay(self, lambda: False))

    def full(self, j, loads, hits, ready):
        before = sum(e.steps_taken() for e in self.engines)
        original(self, j, loads, hits, lambda: False)
        counted.append(sum(e.steps_taken() for e in self.engines) - before)

    monkeypatch.setattr(parallel._Group, "advance_ahead", full)


@pytest.mark.parametrize("router", ["round-robin", "least-tokens", "prefix"])
@pytest.mark.parametrize("workers", [2, 3])
def test_running_ahead_at_every_meeting_gives_the_sequential_records(router, workers, monkeypatch):
    counted: list = []
    _always(monkeypatch, counted)
    spec = _spec()
    reqs = _workload(120, 4000.0) + [r.__class__(r.arrival + 0.2 + i / 40, r.prompt, r.output_len)
                                      for i, r in enumerate(_workload(40, 100.0, seed=5))]  # a burst, then a trickle
    _same(drive(Deployment(spec, 6, router), _BATCHES), drive_replicas(Deployment(spec, 6, router), _BATCHES,
                                                                       workers))
    one, many = Deployment(spec, 6, router), Deployment(spec, 6, router)
    _same(drive(one, reqs), drive_replicas(many, reqs, workers))
    assert [e.num_steps for e in many.engines] == [e.num_steps for e in one.engines]
    assert many.stats(1.0) == one.stats(1.0)
    assert (sum(counted) > 0) == (router != "round-robin")  # round-robin's turn is not in a group's numbers


@pytest.mark.parametrize("rule", ["candidate", "touched"])
def test_running_ahead_a_replica_the_rules_keep_changes_the_records(rule, monkeypatch):
    """The comparison above can fail: without either rule the records differ."""
    _always(monkeypatch, [])
    if rule == "candidate":
        monkeypatch.setattr(Deployment, "could_choose", lambda self, indices, loads, hits: set())
    else:
        monkeypatch.setattr(parallel._Group, "add", _forgetting(parallel._Group.add))
    spec, reqs = _spec(), _workload(120, 4000.0) if rule == "candidate" else _BATCHES
    sequential = drive(Deployment(spec, 6, "least-tokens"), reqs)
    with pytest.raises(AssertionError):
        _same(sequential, drive_replicas(Deployment(spec, 6, "least-tokens"), reqs, 2))


def _forgetting(add):
    def forget(self, j, replica):
        add(self, j, replica)
        self.touched.discard(replica)
    return forget


@pytest.mark.parametrize("router", ["least-tokens", "prefix"])
def test_the_router_only_chooses_among_each_groups_could_choose(router):
    dep = Deployment(_spec(), 7, router, balance_tokens=50)
    rng = random.Random(0)
    groups = [[0, 1, 2], [3, 4], [5, 6]]
    for k in range(2000):
        loads = [rng.randrange(0, 40 if k % 2 else 400) for _ in range(7)]  # ties too
        hits = [rng.choice([0, 0, 16, 32]) for _ in range(7)] if router == "prefix" else None
        chosen = dep.choose(f"r-{k}", loads, hits)
        group = next(g for g in groups if chosen in g)
        assert chosen in dep.could_choose(group, [loads[i] for i in group],
                                          None if hits is None else [hits[i] for i in group])
    assert len(dep.could_choose([0, 1, 2], [1, 5, 5], [0, 32, 16])) == (2 if router == "prefix" else 1)


def test_records_built_while_waiting_are_the_sequential_ones(monkeypatch):
    """A group builds the records of its finished requests while it waits (prepay_until, once nothing is left
    to apply); run_out builds only the rest. Waiting out every meeting in full, most records exist before the
    run's end, and they (the refused request's too) are the sequential run's."""
    _always(monkeypatch, [])
    built_before_the_end: list = []
    run_out = parallel._Group.run_out

    def counting(self):
        built_before_the_end.append((len(self.records), len(self.finished)))
        return run_out(self)

    monkeypatch.setattr(parallel._Group, "run_out", counting)
    spec, reqs = _spec(), _workload(150, 400.0)
    sequential = drive(Deployment(spec, 4, "least-tokens"), reqs)
    _same(sequential, drive_replicas(Deployment(spec, 4, "least-tokens"), reqs, 2))
    (built, finished), = built_before_the_end  # this process's group (the child's counts stay in the child)
    assert 0 < built <= finished and finished - built < len(reqs) // 2
    assert any(not r.success for r in sequential[0])  # the refused request has its record either way
