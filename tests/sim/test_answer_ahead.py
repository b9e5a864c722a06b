"""sim/parallel.py's children answer the next meeting ahead (_Group.speculate: its answer should the request being
routed not come to them and the meeting open a batch, their replicas that request could reach planned to its
arrival), and the parent takes that answer in those cases instead of waiting for one. The records are the
sequential run's whether the answers ahead are taken, never made, or made and dropped at every meeting; an
answer ahead made of plans that do not reach the arrival gives other records."""

import pytest

from servescope.sim import parallel
from servescope.sim.cluster import Deployment
from servescope.sim.driver import drive
from servescope.sim.engine import SimEngine
from servescope.sim.parallel import drive_replicas
from test_fast_paths import _same, _spec, _workload


def _both(router: str, workers: int = 2):
    spec = _spec()
    reqs = _workload(60, 4000.0) + _workload(80, 60.0, seed=7)  # a burst (queues, preemptions), then a trickle
    one, many = Deployment(spec, 4, router), Deployment(spec, 4, router)
    return drive(one, reqs), drive_replicas(many, reqs, workers), one, many


@pytest.mark.parametrize("router", ["round-robin", "least-tokens", "prefix"])
@pytest.mark.parametrize("workers", [2, 3])
def test_answers_ahead_are_taken_and_keep_the_sequential_records(router, workers, monkeypatch, tmp_path):
    log = tmp_path / "taken"
    confirm = parallel._Group.confirm

    def counted(self):  # (in a child: a file is what comes back)
        with open(log, "a") as f:
            f.write("taken\n")
        return confirm(self)

    monkeypatch.setattr(parallel._Group, "confirm", counted)
    sequential, split, one, many = _both(router, workers)
    _same(sequential, split)
    assert [e.num_steps for e in many.engines] == [e.num_steps for e in one.engines]
    assert many.stats(1.0) == one.stats(1.0)
    taken = log.read_text().count("taken") if log.exists() else 0
    assert (taken > 0) == (router != "prefix")  # (the prefix router's answer reads the caches: never ahead)


@pytest.mark.parametrize("variant", ["never", "dropped"])
def test_answers_ahead_never_made_or_always_dropped_keep_the_records(variant, monkeypatch):
    speculate = parallel._Group.speculate

    def dropped(self, j):
        speculate(self, j)
        self.undo()
        return None

    monkeypatch.setattr(parallel._Group, "speculate", (lambda self, j: None) if variant == "never" else dropped)
    sequential, split, _, _ = _both("least-tokens")
    _same(sequential, split)


def test_an_answer_ahead_whose_plans_stop_short_changes_the_records(monkeypatch):
    """The comparison can fail: replicas left where they were, the answer ahead is stale."""
    monkeypatch.setattr(SimEngine, "plan_until", lambda self, t: True)
    sequential, split, _, _ = _both("least-tokens")
    with pytest.raises(AssertionError):
        _same(sequential, split)
