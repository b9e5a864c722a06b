"""The driver on the real engine (the lab's WallClock), the step table fitted from its StepRecords, and the
detokeniser's cost measured on the tokenizer (only the plumbing is checked, never a speed)."""

import json

import pytest

from servescope.config import EngineConfig
from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.measure import detokenise
from servescope.engine.llm_engine import LLMEngine
from servescope.measure.overhead import _tiny_config
from servescope.labs.sim_validation import WallClock
from servescope.sim.cluster import Deployment
from servescope.sim.driver import drive
from servescope.sim.spec import instance_spec
from servescope.sim.step_table import fit_step_table
from servescope.sim.workload import synthetic_workload


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(_tiny_config(2)))
    return LLMEngine(EngineConfig(model=f"random:{path}", num_kv_blocks=128, max_model_len=256, max_num_seqs=8,
                                  max_num_batched_tokens=64, hardware="H100-SXM", enable_prefix_caching=False)), path


def test_the_same_driver_runs_the_engine_on_the_wall_clock(tiny_engine):
    engine, path = tiny_engine
    reqs = synthetic_workload(6, (8, 80), (2, 6), 512, request_rate=200.0, seed=3)
    first = len(engine.step_records)
    records, duration, finished = drive(WallClock(engine), reqs, max_concurrency=3)
    assert all(r.success for r in records) and [r.output_len for r in records] == [r.output_len for r in reqs]
    assert duration > 0 and all(r.ttft > 0 and len(r.itl) == r.output_len - 1 for r in records)
    # the simulator, on the same requests and engine settings, schedules the same prefill chunks
    spec = instance_spec(str(path), "H100", dtype="float32", cache=KVCacheConfig(num_kv_blocks=128,
                                                                           enable_prefix_caching=False),
                         batching=BatchingConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256))
    dep = Deployment(spec)
    sim_records, _, _ = drive(dep, reqs, max_concurrency=3)
    assert [r.output_len for r in sim_records] == [r.output_len for r in records]
    real_steps = list(engine.step_records)[first:]
    table = fit_step_table(real_steps)
    assert table.decode and table.prefill and all(r > 0 for _, pts in table.decode for _, r in pts)
    assert sum(s.num_prefill_tokens for s in real_steps) == sum(s.num_prefill_tokens for s in dep.engines[0].steps)


def test_the_detokeniser_cost_is_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(detokenise, "default_cache_path", lambda: tmp_path / "hardware.json")
    monkeypatch.setattr(detokenise, "measure_detokenise_seconds", lambda: calls.append(1) or 4e-6)
    assert detokenise.detokenise_cost(with_tokenizer=True)[0] == 4e-6
    assert detokenise.detokenise_cost(with_tokenizer=True)[0] == 4e-6
    assert detokenise.detokenise_cost(with_tokenizer=False)[0] == 0.0  # no tokenizer
    assert calls == [1] and (tmp_path / detokenise.CACHE_NAME).is_file()
