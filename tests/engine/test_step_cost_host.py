"""The engine's StepRecords carry the spec's host overhead per sequence, as the simulator's steps do (one
definition: HardwareSpec.seq_overhead_s, added by the cost model). A tiny random model on a datasheet spec."""

import json

import pytest

from servescope.analysis.hardware import get_hardware
from servescope.config import EngineConfig, SamplingParams
from servescope.engine.llm_engine import LLMEngine
from servescope.measure.overhead import _tiny_config

PER_SEQ = 1e-3


def test_each_records_prediction_holds_the_host_cost_of_its_sequences(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_tiny_config(2)))
    hw = get_hardware("H100-SXM").replace(seq_overhead_s=PER_SEQ)
    engine = LLMEngine(EngineConfig(model=f"random:{path}", num_kv_blocks=64, max_model_len=256), hardware_spec=hw)
    for i in range(3):
        engine.add_request(f"r{i}", [3 + 5 * i + j for j in range(20 + 7 * i)],
                           SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    decodes = [r for r in engine.step_records if r.phase == "decode" and r.predicted_seconds is not None]
    assert {len(r.context_lens) for r in decodes} >= {3}  # decode steps of three sequences were predicted
    engine.step_cost_predictor.use_hardware(hw.replace(seq_overhead_s=0.0))
    for r in decodes:
        n = len(r.context_lens)
        without = engine.step_cost_predictor.predictor.predict([(1, c - 1) for c in r.context_lens], n).seconds
        assert r.predicted_seconds == pytest.approx(without + n * PER_SEQ)
